"""The shipped workloads beyond digits (examples/data, examples/tasks, examples/fleets): their
files load as the federated datasets their READMEs describe, each task builds and passes its own
predicates on its proxy data, FedAvg over the dataset's clients reaches the accuracy its docstring
states, and each fleet config names a task file and a dataset that fit each other. Offline: the
recipes' downloads are not run here; their parsing and rendering are, on inputs made here."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from device_runtime.executor import PlanExecutor
from emulator.fleet.federated_data import load_data, load_leaf
from emulator.toolchain.release import release_test
from emulator.toolchain.tasks import load_tasks
from examples.data.make_shakespeare import role_texts, speeches, windows
from tests.examples.fedavg import fedavg

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = {
    # name: (clients, x feature, train examples, test examples, label classes)
    "glyphs": (165, ("float32", (256,)), 8219, 1974, 62),
    "shakespeare": (299, ("uint8", (20,)), 88154, 21991, 81),  # character ids: uint8
}


def _task(name: str):
    [task] = load_tasks(ROOT / "examples" / "tasks" / f"{name}_task.py")
    return task


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_shipped_files_load_as_leaf_data_with_their_clients_features_and_splits(name: str) -> None:
    clients, (dtype, shape), n_train, n_test, classes = WORKLOADS[name]
    data = load_leaf(ROOT / "examples" / "data" / name)
    assert len(data.client_ids) == clients and data.test_split == "files"
    assert (data.features["x"].dtype, data.features["x"].shape) == (dtype, shape)
    assert data.features["y"].dtype == ("int64" if dtype == "float32" else dtype) and data.label == "y"
    assert sum(data.sizes().values()) == n_train
    assert sum(len(ex["y"]) for ex in data.test.values()) == n_test
    assert set(data.test) == set(data.train)  # by-sample split: every client in both
    labels = np.concatenate([ex["y"] for _, ex in data])
    assert labels.min() >= 0 and labels.max() < classes


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_task_builds_and_passes_its_predicates_on_its_proxy_data(name: str) -> None:
    task = _task(name)
    proxy = task.proxy_data()
    data = load_leaf(ROOT / "examples" / "data" / name)
    # the proxy is the shipped data itself: every shard is one client's training examples
    train = {c: ex for c, ex in data}
    assert all(any(np.array_equal(s["x"], ex["x"]) for ex in train.values()) for s in proxy.shards)
    report = release_test(task, pool=None, runtimes=[])  # the reference run on this interpreter's onnxruntime
    checks = {c["name"]: c for c in report["reference"]["checks"]}
    assert report["reference"]["passed"], checks
    assert any(name.startswith("accuracy_after_") for name in checks)


@pytest.mark.parametrize(("name", "rounds", "at_least"), [("glyphs", 5, 0.45), ("shakespeare", 5, 0.25)])
def test_fedavg_over_the_dataset_clients_learns_in_a_few_rounds(name: str, rounds: int, at_least: float) -> None:
    data = load_leaf(ROOT / "examples" / "data" / name)
    accuracy = fedavg(_task(name), data, rounds=rounds, clients_per_round=10)
    assert accuracy[0] < 0.05 and accuracy[-1] >= at_least, accuracy


@pytest.mark.slow
@pytest.mark.parametrize(("name", "at_least"), [("glyphs", 0.75), ("shakespeare", 0.35)])
def test_fedavg_over_the_dataset_clients_reaches_the_accuracy_the_task_states(name: str, at_least: float) -> None:
    """The figure each task's docstring states: 40 rounds of 10 clients."""
    data = load_leaf(ROOT / "examples" / "data" / name)
    accuracy = fedavg(_task(name), data, rounds=40, clients_per_round=10)
    print(name, [round(a, 3) for a in accuracy[::5]], accuracy[-1])
    assert accuracy[-1] >= at_least, accuracy


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_fleet_config_names_a_task_file_and_a_dataset_that_fit_each_other(name: str) -> None:
    path = ROOT / "examples" / "fleets" / f"{name}.toml"
    config = tomllib.loads(path.read_text(encoding="utf-8"))
    task_file = (path.parent / config["task"]["file"]).resolve()
    data_path = (path.parent / config["data"]["path"]).resolve()
    assert task_file == ROOT / "examples" / "tasks" / f"{name}_task.py"
    data = load_data(f"{config['data']['format']}:{data_path}")
    [task] = load_tasks(task_file)
    assert set(data.features) == {"x", "y"} and data.label == task.label
    # a device session on one client's examples: the device path feeds the dataset's features to the plan
    plan = task.build_plan()
    executor = PlanExecutor(plan)
    examples = data.train[data.client_ids[0]]
    result = executor.run_device(task.weights(plan), executor.batches_from_examples(lambda: [examples]))
    assert result.num_examples == len(examples["y"]) and result.metrics["count"] == len(examples["y"])


# ----------------------------------------------------------------------------- the recipes' own steps

PLAY = """# A Play

## ACT I

### SCENE I. A heath.

_Thunder. Enter two
Witches_

**First Witch**  
When shall we meet again,\\--  
[Aside]_  
In thunder\u2014or rain?

**SECOND WITCH**  
When the battle's lost.

_Exeunt_

**First Witch**  
Anon.
"""


def test_a_play_becomes_speeches_by_role_without_stage_directions() -> None:
    assert speeches(PLAY) == [
        ("FIRST WITCH", "When shall we meet again,-- In thunder--or rain?"),
        ("SECOND WITCH", "When the battle's lost."),
        ("FIRST WITCH", "Anon."),
    ]
    texts = role_texts({"a_play": PLAY})
    assert texts == {
        "a_play_FIRST_WITCH": "When shall we meet again,-- In thunder--or rain? Anon.",
        "a_play_SECOND_WITCH": "When the battle's lost.",
    }


def test_windows_are_followed_by_the_character_after_them() -> None:
    from examples.data import make_shakespeare as recipe

    text = "".join(chr(ord("a") + i % 26) for i in range(200))
    x, y = windows(text)
    assert len(x) == len(range(0, len(text) - recipe.SEQ_LEN, recipe.STRIDE))
    for i, (window, nxt) in enumerate(zip(x, y)):
        start = i * recipe.STRIDE
        assert window == text[start : start + recipe.SEQ_LEN] and nxt == text[start + recipe.SEQ_LEN]


def test_a_glyph_is_rendered_on_its_baseline_with_its_case_visible() -> None:
    pytest.importorskip("PIL")
    matplotlib = pytest.importorskip("matplotlib")
    from examples.data.make_glyphs import SIDE, render

    font = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    small, capital = render(font, "o"), render(font, "O")
    assert small.shape == capital.shape == (SIDE, SIDE)
    assert set(np.unique(np.r_[small.ravel(), capital.ravel()])) <= {0.0, 0.5, 1.0}
    assert 0 < (small > 0).sum() < (capital > 0).sum()  # o is smaller than O: case stays visible
    rows = lambda image: np.nonzero(image.max(axis=1))[0]  # noqa: E731
    assert rows(small).max() == rows(capital).max()  # both sit on the baseline
