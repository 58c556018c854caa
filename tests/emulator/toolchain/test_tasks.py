"""Tasks declared in Python: task files load into tasks, a group is the grid of its variants,
predicates judge trials, and proxy data is dealt to devices without loss or overlap."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from device_runtime import PlanExecutor
from emulator.toolchain.bundle import build_bundle
from emulator.toolchain.tasks import (
    DEFAULT_RUNTIMES,
    ProxyData,
    Task,
    TaskError,
    TaskGroup,
    Trial,
    accuracy_after_rounds,
    evaluation_of,
    load_tasks,
    loss_after_rounds,
    loss_decreases,
    loss_is_finite,
    predicate,
)

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"


def trial(losses=(), accuracies=()) -> Trial:
    return Trial("1.31.1", tuple(losses), tuple(accuracies), tuple(1.0 for _ in accuracies))


def test_the_example_task_file_declares_a_task_that_builds_its_plan():
    (task,) = load_tasks(TASK_FILE)
    plan = task.build_plan()
    assert task.name == plan.name == "digits_mlp"
    assert plan.metadata.opset == 21 and plan.device.batch_size == task.batch_size
    assert set(task.weights(plan)) == set(plan.weight_names)
    assert task.runtimes == DEFAULT_RUNTIMES == ("1.15.1", "1.24.4", "1.32.0")
    assert task.local_epochs == 3 and task.simulated_rounds == 4


def test_a_task_group_is_every_combination_of_its_grid():
    tasks = load_tasks(TASK_FILE.with_name("digits_lr_sweep.py"))
    assert [t.name for t in tasks] == ["digits_mlp-lr0.1", "digits_mlp-lr0.2", "digits_mlp-lr0.3"]
    assert [t.hyperparameters["lr"] for t in tasks] == [0.1, 0.2, 0.3]
    graphs = {t.build_plan().work for t in tasks}
    assert len(graphs) == 3  # the learning rate is a constant of each variant's graph
    two_keys = TaskGroup(tasks[0], {"lr": [0.1, 0.2], "momentum": [0.5, 0.9]}).tasks()
    assert sorted((t.hyperparameters["lr"], t.hyperparameters["momentum"]) for t in two_keys) == [
        (0.1, 0.5),
        (0.1, 0.9),
        (0.2, 0.5),
        (0.2, 0.9),
    ]


def test_task_files_that_cannot_give_tasks_are_refused_with_the_reason(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks(tmp_path / "missing.py")
    with pytest.raises(TaskError, match="is a folder; give a task file's path"):
        load_tasks(tmp_path)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(TaskError, match="defines no `task`"):
        load_tasks(empty)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no data')\n")
    with pytest.raises(TaskError, match="failed to run: RuntimeError: no data"):
        load_tasks(broken)
    exits = tmp_path / "exits.py"  # a script's top level: `plan build` ended there with status 0 and nothing built
    exits.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(TaskError, match=r"exits\.py called sys\.exit\(0\) while it was loaded"):
        load_tasks(exits)


def test_a_task_claims_each_minor_release_once():
    with pytest.raises(TaskError, match="two patches of one minor"):
        Task(name="t", model=lambda hp: None, proxy=lambda: None, runtimes=("1.17.0", "1.17.3"))
    with pytest.raises(TaskError, match="claims no runtime"):
        Task(name="t", model=lambda hp: None, proxy=lambda: None, runtimes=())


@pytest.mark.parametrize("name", ["..", ".", "", "a b", "digits/mlp", "/tmp", "ü", "x" * 129])
def test_a_task_name_the_server_would_refuse_is_refused_when_the_task_is_declared(name):
    with pytest.raises(TaskError, match="task name .* refused: names are 1-128 ASCII letters"):
        Task(name=name, model=lambda hp: None, proxy=lambda: None)


def test_building_a_task_named_as_a_path_leaves_the_folders_around_the_bundle_alone(tmp_path):
    """The bundle keeps each task in OUT/<name>, which a build replaces: a task named '..' made that
    the bundle's parent, and its build deleted it with everything in it."""
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("not the bundle's")
    for name in ("..", str(tmp_path / "keep")):
        task_file = tmp_path / "named.py"
        task_file.write_text(
            f"import dataclasses, runpy\nbase = runpy.run_path({str(TASK_FILE)!r})['task']\n"
            f"task = dataclasses.replace(base, name={name!r})\n"
        )
        with pytest.raises(TaskError, match="refused"):
            build_bundle(task_file, tmp_path / "keep" / "bundle")
        assert (tmp_path / "keep" / "notes.txt").read_text() == "not the bundle's"


@given(st.lists(st.floats(0.01, 10), min_size=3, max_size=6))
def test_loss_decreases_passes_exactly_when_each_epoch_improves(losses):
    passed, detail = loss_decreases(epochs=3).check(trial(losses))
    assert passed == (losses[1] < losses[0] and losses[2] < losses[1])
    assert detail.startswith("losses ")


def test_loss_decreases_fails_on_nan_or_too_few_epochs():
    assert not loss_decreases(3).check(trial([2.0, 1.0, math.nan]))[0]
    assert not loss_decreases(3).check(trial([2.0, 1.0]))[0]


@given(st.lists(st.floats(0, 1), min_size=1, max_size=6), st.integers(1, 5), st.floats(0, 1))
def test_accuracy_after_rounds_reads_the_round_it_names(accuracies, rounds, threshold):
    passed, _ = accuracy_after_rounds(rounds, threshold).check(trial(accuracies=accuracies))
    assert passed == (len(accuracies) > rounds and accuracies[rounds] >= threshold)


def test_a_custom_predicate_states_what_it_needs():
    @predicate("first_loss_below_3", local_epochs=2)
    def first_loss_below_3(t: Trial) -> bool:
        return t.loss_by_epoch[0] < 3

    assert first_loss_below_3.check(trial([2.5, 2.0])) == (True, "")
    assert first_loss_below_3.check(trial([3.5, 2.0]))[0] is False
    assert first_loss_below_3.local_epochs == 2


@given(n=st.integers(8, 200), devices=st.integers(1, 6), seed=st.integers(0, 3))
def test_proxy_data_deals_every_example_once(n, devices, seed):
    examples = {"x": np.arange(n, dtype=np.float32)[:, None], "y": np.arange(n)}
    if round(n * 0.75) < devices:
        with pytest.raises(TaskError):
            ProxyData.split(examples, devices=devices, seed=seed)
        return
    proxy = ProxyData.split(examples, devices=devices, seed=seed)
    ids = np.concatenate([s["y"] for s in proxy.shards] + [proxy.holdout["y"]])
    assert sorted(ids.tolist()) == list(range(n)) and len(proxy.shards) == devices
    for part in [*proxy.shards, proxy.holdout]:
        assert np.array_equal(part["x"][:, 0], part["y"])  # tensors of an example stay together


_DTYPES = st.sampled_from(["float32", "int64", "int32", "bool"])
_SHAPES = st.lists(st.integers(1, 4), max_size=3).map(tuple)


@given(
    features=st.dictionaries(
        st.sampled_from(["x", "ids", "mask", "y"]),
        st.one_of(st.tuples(_DTYPES, _SHAPES), st.tuples(_DTYPES, _SHAPES, st.integers(1, 7))),
        min_size=1,
    ),
    examples=st.integers(8, 40),
    devices=st.integers(1, 3),
)
def test_random_proxy_examples_have_the_declared_dtype_shape_and_range(features, examples, devices):
    proxy = ProxyData.random(features, examples=examples, devices=devices)
    assert len(proxy.shards) == devices
    parts = [*proxy.shards, proxy.holdout]
    assert sum(len(p[next(iter(features))]) for p in parts) == examples
    for name, spec in features.items():
        for part in parts:
            value = part[name]
            assert value.dtype == np.dtype(spec[0]) and value.shape[1:] == spec[1]
            if len(spec) == 3:
                assert value.size == 0 or (value.min() >= 0 and value.max() < spec[2])


def test_loss_is_finite_fails_on_nan_infinity_or_too_few_epochs():
    assert loss_is_finite().check(trial([2.3]))[0] is True
    assert loss_is_finite(2).check(trial([2.3, 2.4]))[0] is True  # random labels: finite is all it can show
    assert [loss_is_finite().check(trial(v))[0] for v in ([math.nan], [math.inf], [])] == [False, False, False]
    assert loss_is_finite(3).local_epochs == 3


def test_an_evaluation_task_measures_its_training_tasks_model_with_its_own_data():
    train, evaluation = load_tasks(TASK_FILE.with_name("digits_eval_task.py"))
    trained, plan = train.build_plan(), evaluation.build_plan()
    assert (train.kind, evaluation.kind, plan.kind) == ("train", "eval", "eval")
    assert evaluation.evaluates is train and plan.name == evaluation.name == "digits_mlp_eval"
    assert PlanExecutor(plan).weight_spec() == PlanExecutor(trained).weight_spec()
    assert plan.device.selector.collection_uri == "app:/digits_heldout" and plan.device.batch_size == 32
    assert evaluation.runtimes == train.runtimes and evaluation.simulated_rounds == 4
    start = evaluation.weights(plan)
    assert all(np.array_equal(start[w], v) for w, v in train.weights(trained).items())


def test_an_evaluation_is_refused_what_it_cannot_be_judged_on_or_stand_alone(tmp_path):
    (train,) = load_tasks(TASK_FILE)
    with pytest.raises(TaskError, match="does not train"):
        evaluation_of(train, predicates=(loss_decreases(epochs=3),))
    with pytest.raises(TaskError, match="itself an evaluation"):
        evaluation_of(evaluation_of(train))
    with pytest.raises(TaskError, match="name of its own"):
        evaluation_of(train, name=train.name)
    alone = tmp_path / "alone.py"
    alone.write_text(f"""
import runpy
from emulator.toolchain.tasks import evaluation_of
tasks = [evaluation_of(runpy.run_path({str(TASK_FILE)!r})["task"])]
""")
    with pytest.raises(TaskError, match="does not list in `tasks`"):
        load_tasks(alone)
    narrow = tmp_path / "narrow.py"
    narrow.write_text(f"""
import runpy
from emulator.toolchain.tasks import evaluation_of
task = runpy.run_path({str(TASK_FILE)!r})["task"]
tasks = [task, evaluation_of(task, runtimes=("1.31.1",))]
""")
    with pytest.raises(TaskError, match="does not claim onnxruntime 1.15.1"):
        load_tasks(narrow)


@given(losses=st.lists(st.floats(0, 10), min_size=1, max_size=6), rounds=st.integers(1, 6), limit=st.floats(0, 10))
def test_loss_after_rounds_reads_the_round_it_names(losses, rounds, limit):
    passed, _ = loss_after_rounds(rounds, limit).check(Trial("1.31.1", (), tuple(0.5 for _ in losses), tuple(losses)))
    assert passed == (len(losses) > rounds and losses[rounds] <= limit)


def test_a_file_without_the_py_suffix_loads_when_it_is_python_and_is_said_no_task_file_when_not(tmp_path):
    words = tmp_path / "notes.txt"  # ran as Python: "task file notes.txt failed to run: NameError: ..."
    words.write_text("sweep lr\n")
    with pytest.raises(TaskError, match=r"notes\.txt is not a task file \(Python, \.py\): it does not run as Python"):
        load_tasks(words)
    data = tmp_path / "x.cfg"
    data.write_text("x = 1\n")
    with pytest.raises(TaskError, match=r"defines no `task`.* \(a task file is Python, named \.py\)"):
        load_tasks(data)
    renamed = tmp_path / "digits_task"  # Python under another name: its task, as before
    renamed.write_text(TASK_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    assert [t.name for t in load_tasks(renamed)] == [t.name for t in load_tasks(TASK_FILE)]


DATA = Path(__file__).with_name("data")
TWO_HEADS = DATA / "two_heads.onnx"  # torch's export of (logits [N, 3], features [N, 16])
AUX_FIRST = DATA / "aux_first.onnx"  # (aux_loss [], logits [N, 3])


def _onnx_task(model: Path, **fields) -> Task:
    return Task(name="heads", model=model, proxy=lambda: ProxyData((), {}), runtimes=("1.31.1",), **fields)


def test_a_task_over_a_model_with_two_predictions_is_refused_in_one_line_until_its_output_names_one():
    """A Task written by hand chooses as ``plan from-onnx`` does: the first of (logits, features)
    is not taken silently, for training, its evaluation and each variant of a group alike."""
    task = _onnx_task(TWO_HEADS)
    listing = "logits float32 [N, 3], features float32 [N, 16]"
    variant = TaskGroup(task, {"lr": [0.1, 0.2]}).tasks()[1]
    for made, name in ((task, "heads"), (evaluation_of(task), "heads"), (variant, "heads-lr0.2")):
        with pytest.raises(TaskError) as caught:
            made.build_plan()
        assert str(caught.value) == (
            f"task {name!r}: the model has 2 outputs ({listing}); set output= in the Task to the name of the one the "
            "loss reads"
        )
    with pytest.raises(TaskError) as caught:
        _onnx_task(TWO_HEADS, output="logit").build_plan()
    assert str(caught.value) == (
        f"task 'heads': output='logit' names no tensor of the model's outputs ({listing}); give the name of one"
    )
    features = _onnx_task(TWO_HEADS, output="features", loss="mse")
    assert sorted(features.build_plan().weight_names) == ["body.bias", "body.weight"]  # the features' layer alone
    assert evaluation_of(features).build_plan().kind == "eval"
    inside = _onnx_task(TWO_HEADS, output="linear", loss="mse")  # a tensor inside the graph, as before
    assert sorted(inside.build_plan().weight_names) == ["body.bias", "body.weight"]


def test_a_task_over_a_model_with_one_prediction_among_its_outputs_trains_it_and_says_so_where_asked(capsys):
    """(aux_loss, logits): the scalar first would have been read as the prediction; the logits are,
    in a line for the one who asks (``plan build``), and the library itself prints nothing."""
    task = _onnx_task(AUX_FIRST)
    said: list[str] = []
    assert sorted(task.build_plan(say=said.append).weight_names) == ["head.bias", "head.weight"]
    evaluation_of(task).build_plan(say=said.append)
    line = (
        "the model has 2 outputs (aux_loss float32 [], logits float32 [N, 3]): the loss reads 'logits', the only "
        "float one with a batch axis and a class axis (output= in the Task picks another)"
    )
    assert said == [f"heads: {line}", f"heads_eval: {line}"]
    task.build_plan()
    assert capsys.readouterr() == ("", "")
