"""`fedfleet simulate --task TASK.py --data FORMAT:PATH`: any task file the toolchain builds, on a
federated dataset in each format the field uses (written here in tmp_path from scikit-learn's digits,
cut into "writers"), through the CLI entry; the summary's new keys; the override rules of a task
file's RoundConfig; and one line with exit code 2 for input the fleet cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from emulator.cli.commands import main
from emulator.fleet import FleetConfig
from emulator.fleet.federated_data import parse_data_spec
from emulator.fleet.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "tasks"
WRITERS = 24
#: A small fleet whose rounds commit in two simulated hours: the task file's RoundConfig is made for
#: a fast model on a real server; these [task] keys override it (and are the built-in task's).
FLEET = """[fleet]
devices = 60
hours = 2.0
start_utc_hour = 6.0

[task]
goal_count = 6
report_timeout_s = 600.0
selection_timeout_s = 300.0
retry_min_s = 60.0
retry_max_s = 300.0
compute_s_per_example = 0.2
"""
SUMMARY_KEYS = (
    "time_to_target_accuracy_s",
    "client_accuracy_percentiles",
    "data_clients",
    "devices_per_client",
    "task_file",
    "tasks",
    "data",
    "accuracy",
)


def writers() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The digits dealt to WRITERS clients, each a few digits only (a natural non-IID split)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    order = np.argsort(y, kind="stable")
    for w, part in enumerate(np.array_split(order, WRITERS)):
        out[f"w{w:03d}"] = (x[part], y[part])
    return out


def split(examples: tuple[np.ndarray, np.ndarray], test_every: int = 5) -> tuple[tuple, tuple]:
    x, y = examples
    test = np.arange(len(y)) % test_every == 0
    return (x[~test], y[~test]), (x[test], y[test])


def write_leaf(folder: Path) -> Path:
    for which in ("train", "test"):
        (folder / which).mkdir(parents=True)
        users = {}
        for cid, ex in writers().items():
            x, y = split(ex)[0 if which == "train" else 1]
            users[cid] = {"x": x.tolist(), "y": y.tolist()}
        body = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()], "user_data": users}
        (folder / which / f"digits_{which}.json").write_text(json.dumps(body))
    return folder


def write_tff(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for which in ("train", "test"):
        with h5py.File(folder / f"digits_{which}.h5", "w") as f:
            for cid, ex in writers().items():
                x, y = split(ex)[0 if which == "train" else 1]
                group = f.create_group(f"examples/{cid}")
                group.create_dataset("pixels", data=x.reshape(-1, 8, 8))
                group.create_dataset("label", data=y.astype(np.int32))
    return folder


def write_parquet(path: Path) -> Path:
    clients, xs, ys = [], [], []
    for cid, (x, y) in writers().items():
        clients += [cid] * len(y)
        xs += x.tolist()
        ys += y.tolist()
    pq.write_table(pa.table({"writer": clients, "x": xs, "y": ys}), path)
    return path


def write_csv(path: Path) -> Path:
    """One scalar feature and a label it decides: what a CSV of numbers holds."""
    rng = np.random.default_rng(0)
    lines = ["client,x,y"]
    for c in range(WRITERS):
        for _ in range(30):
            value = float(rng.normal(0.5 if c % 2 else -0.5, 1.0))
            lines.append(f"c{c:02d},{value:.4f},{int(value > 0)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_npz(path: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(path, x=(digits.data / 16.0).astype(np.float32), y=digits.target.astype(np.int64))
    return path


def simulate(tmp_path: Path, capsys, *args: str, fleet: str = FLEET) -> tuple[int, dict | None, str]:
    config = tmp_path / "fleet.toml"
    config.write_text(fleet, encoding="utf-8")
    code = main(["simulate", str(config), "--no-progress", "--seed", "1", *args])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if code == 0 and lines else None), captured.err


def check_summary(summary: dict) -> None:
    for key in SUMMARY_KEYS:
        assert key in summary
    assert summary["rounds_committed"] >= 1 and summary["accuracy"] is not None
    percentiles = summary["client_accuracy_percentiles"]
    assert percentiles is not None and 0.0 <= percentiles["p10"] <= percentiles["p50"] <= percentiles["p90"] <= 1.0


def test_a_leaf_folder_with_a_task_file_runs_twice_to_one_digest_and_reaches_its_target(tmp_path, capsys):
    data = write_leaf(tmp_path / "leaf")
    args = ("--task", str(TASKS / "digits_task.py"), "--data", f"leaf:{data}", "--target-accuracy", "0.3")
    code, first, err = simulate(tmp_path, capsys, *args)
    assert code == 0, err
    check_summary(first)
    assert first["data_clients"] == WRITERS and first["devices_per_client"] == 2.5 and first["tasks"] == ["digits_mlp"]
    assert f"{WRITERS} training clients for 60 devices" in err and "reused" in err
    assert first["client_accuracy_percentiles"]["clients"] == WRITERS  # LEAF's test/ folder: every writer
    assert first["time_to_target_accuracy_s"] is not None and 0 < first["time_to_target_accuracy_s"] <= 7200
    code, second, _ = simulate(tmp_path, capsys, *args)
    assert code == 0 and second["digest"] == first["digest"]


def test_a_bundle_folder_runs_as_its_task_file(tmp_path, capsys):
    """``--task DIR`` of a bundle (what ``plan test`` and ``deploy`` take) runs ``DIR/task.py``."""
    from examples.tasks.digits_cnn_task import cnn_model

    (tmp_path / "cnn.onnx").write_bytes(cnn_model())
    bundle = tmp_path / "cnn"
    assert main(["plan", "from-onnx", str(tmp_path / "cnn.onnx"), "--label", "y", "-o", str(bundle)]) == 0
    fleet = FLEET.replace("hours = 2.0", "hours = 0.5")
    code, folder, err = simulate(tmp_path, capsys, "--task", str(bundle), fleet=fleet)
    assert code == 0, err
    code, file, err = simulate(tmp_path, capsys, "--task", str(bundle / "task.py"), fleet=fleet)
    assert code == 0, err
    assert folder is not None and file is not None and folder["tasks"] == ["cnn"]
    assert folder["digest"] == file["digest"] and folder["task_file"] == file["task_file"]


def test_a_bundle_built_from_a_task_file_beside_its_model_runs_as_plan_test_loads_it(tmp_path, capsys):
    """``plan build`` copies a task file into the bundle, not the model the file reads beside itself:
    ``--task DIR`` loads the file the bundle was built from, as ``plan test`` and ``deploy`` do."""
    from examples.tasks.digits_cnn_task import cnn_model

    source = tmp_path / "src"
    source.mkdir()
    (source / "cnn.onnx").write_bytes(cnn_model())
    (source / "mine.py").write_text(
        "from pathlib import Path\n"
        "from emulator.toolchain.tasks import ProxyData, Task\n"
        "EXAMPLES = {'x': ('float32', (1, 8, 8)), 'y': ('int64', (), 10)}\n"
        "task = Task(name='mine', model=Path(__file__).with_name('cnn.onnx'), runtimes=('1.24.4',),\n"
        "            proxy=lambda: ProxyData.random(EXAMPLES, examples=8, devices=2, seed=0))\n"
    )
    bundle = tmp_path / "bundle"
    assert main(["plan", "build", str(source / "mine.py"), "-o", str(bundle)]) == 0
    capsys.readouterr()
    fleet = FLEET.replace("hours = 2.0", "hours = 0.25")
    code, summary, err = simulate(tmp_path, capsys, "--task", str(bundle), fleet=fleet)
    assert code == 0, err
    assert summary is not None and summary["tasks"] == ["mine"] and summary["task_file"] == str(source / "mine.py")


def test_token_ids_past_the_rows_of_the_embedding_that_looks_them_up_are_refused_before_the_run(tmp_path, capsys):
    """Every session meeting token 7 in an embedding of 5 rows failed in onnxruntime, and the run
    ended with no round committed: the line names the feature, the table, its rows and the ids."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = {"emb": rng.normal(size=(5, 3)), "w": rng.normal(size=(3, 2)), "b": np.zeros(2)}
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["emb", "tokens"], ["vectors"]),  # [N, 4, 3]
            helper.make_node("ReduceMean", ["vectors"], ["mean"], axes=[1], keepdims=0),
            helper.make_node("Gemm", ["mean", "w", "b"], ["logits"]),
        ],
        "bag",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    (tmp_path / "bag.onnx").write_bytes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    )
    bundle = tmp_path / "bag"
    assert (
        main(
            ["plan", "from-onnx", str(tmp_path / "bag.onnx"), "--label", "y", "--runtimes", "1.24.4", "-o", str(bundle)]
        )
        == 0
    )
    fleet = "[fleet]\ndevices = 10\nhours = 0.1\n"
    errs: dict[int, str] = {}
    for top, code_wanted in ((5, 0), (8, 2), (256, 2), (-1, 2)):  # ids 0 to 4 fit the 5 rows; 0 to 7 do not
        x = (np.arange(1024).reshape(256, 4) % abs(top)).astype(
            np.uint8 if top == 256 else np.int64
        )  # uint8: 255 + 1 wrapped
        if top == -1:  # ids 0 to 4, padded with -1, which onnxruntime reads as the last row
            x = np.where(np.arange(4) == 3, -1, np.arange(1024).reshape(256, 4) % 5)
        np.savez(tmp_path / f"ids{top}.npz", x=x, y=x[:, 0] % 2)
        spec = f"npz:{tmp_path / f'ids{top}.npz'},clients=4,rename=x:tokens"
        code, _, errs[top] = simulate(tmp_path, capsys, "--task", str(bundle), "--data", spec, fleet=fleet)
        assert code == code_wanted, errs[top]
    assert (
        f"feature 'tokens' of npz:{tmp_path / 'ids8.npz'},clients=4,rename=x:tokens runs from 0 to 7, but the plan 'bag' "
        f"({bundle / 'task.py'}) looks its values up in 'emb', of 5 rows (ids 0 to 4): every session meeting a larger "
        "id would fail; use a model with a row per id (a vocabulary of at least 8), or data whose ids are below 5"
    ) in errs[8]
    assert "runs from 0 to 255, but" in errs[256] and "(a vocabulary of at least 256)" in errs[256]
    assert "runs from -1 to 4, but" in errs[-1] and "a device refuses a negative id" in errs[-1]


def test_uint8_pixels_a_plan_reads_as_floats_are_said_to_be_cast_not_scaled(tmp_path, capsys):
    """A model made for pixels in [0, 1] fed 0 to 255 learns nothing and nothing said why."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(tmp_path / "u8.npz", x=(digits.data * 15).astype(np.uint8), y=digits.target)
    fleet = "[fleet]\ndevices = 10\nhours = 0.1\n"
    task = ("--task", str(TASKS / "digits_task.py"))
    code, _, err = simulate(tmp_path, capsys, *task, "--data", f"npz:{tmp_path / 'u8.npz'},clients=10", fleet=fleet)
    assert code == 0, err
    said = "the data's uint8 x feeds the plan's float input cast, not scaled (pixels stay 0 to 255): a model made for"
    assert f"fedfleet simulate: {said} pixels in [0, 1] needs the data saved divided by 255\n" in err
    np.savez(tmp_path / "i64.npz", x=(digits.images * 15).astype(np.int64), y=digits.target)  # a table's [8, 8] ints
    code, _, err = simulate(tmp_path, capsys, *task, "--data", f"npz:{tmp_path / 'i64.npz'},clients=10", fleet=fleet)
    assert code == 0 and "the data's int64 x feeds the plan's float input cast, not scaled" in err
    floats = write_npz(tmp_path / "floats.npz")
    code, _, err = simulate(tmp_path, capsys, *task, "--data", f"npz:{floats},clients=10", fleet=fleet)
    assert code == 0 and "cast, not scaled" not in err


def test_a_tff_h5_folder_runs_the_built_in_task_sized_to_its_images(tmp_path, capsys):
    data = write_tff(tmp_path / "tff")
    code, summary, err = simulate(tmp_path, capsys, "--data", f"tff-h5:{data}")
    assert code == 0, err
    check_summary(summary)
    assert summary["task_file"] == "built-in" and summary["time_to_target_accuracy_s"] is None


def test_a_parquet_table_trains_an_onnx_task(tmp_path, capsys):
    data = write_parquet(tmp_path / "digits.parquet")
    code, summary, err = simulate(
        tmp_path,
        capsys,
        "--task",
        str(TASKS / "digits_cnn_task.py"),
        "--data",
        f"table:{data},client=writer,test_split=clients",
    )
    assert code == 0, err
    check_summary(summary)
    assert summary["tasks"] == ["digits_cnn"] and summary["data_clients"] < WRITERS  # some writers held out


def test_a_csv_table_from_the_config_with_fewer_devices_than_clients(tmp_path, capsys):
    write_csv(tmp_path / "people.csv")
    fleet = FLEET.replace("devices = 60", "devices = 20") + (
        '\n[data]\nformat = "table"\npath = "people.csv"\noptions = {client = "client", test_split = "clients"}\n'
    )
    code, summary, err = simulate(tmp_path, capsys, fleet=fleet)
    assert code == 0, err
    assert summary["data_clients"] > 20 and summary["devices_per_client"] < 1
    assert "20 of them, drawn with the seed" in err


def write_images(folder: Path) -> Path:
    """The writers' digits as a datasets DatasetDict of Image and ClassLabel features (as flwrlabs/femnist
    holds them), saved with save_to_disk; the test split holds every fifth example of each writer."""
    import datasets
    from PIL import Image

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "digit": datasets.ClassLabel(names=[str(d) for d in range(10)]),
            "writer_id": datasets.Value("string"),
        }
    )
    splits: dict[str, dict[str, list]] = {"train": {k: [] for k in features}, "test": {k: [] for k in features}}
    for cid, ex in writers().items():
        for name, (x, y) in zip(("train", "test"), split(ex)):
            splits[name]["image"] += [Image.fromarray((v.reshape(8, 8) * 255).astype(np.uint8), mode="L") for v in x]
            splits[name]["digit"] += y.tolist()
            splits[name]["writer_id"] += [cid] * len(y)
    datasets.DatasetDict({k: datasets.Dataset.from_dict(v, features=features) for k, v in splits.items()}).save_to_disk(
        str(folder)
    )
    return folder


def test_a_saved_datasetdict_of_images_runs_the_built_in_task_on_its_pixels(tmp_path, capsys):
    data = write_images(tmp_path / "saved")
    code, summary, err = simulate(tmp_path, capsys, "--data", f"table:{data},client=writer_id,label=digit")
    assert code == 0, err
    check_summary(summary)
    assert summary["data_clients"] == WRITERS and summary["client_accuracy_percentiles"]["clients"] == WRITERS


def test_a_csv_of_many_numeric_columns_stacked_into_the_vector_a_task_file_reads(tmp_path, capsys):
    rows = ['"writer",' + ",".join(f'"px{i}"' for i in range(64)) + ',"y","note"']
    for cid, (x, y) in writers().items():
        rows += [
            f'"{cid}",' + ",".join(f"{v:.4f}" for v in row) + f',{label},"a ""quoted"", note"'
            for row, label in zip(x, y)
        ]
    (tmp_path / "wide.csv").write_text("\n".join(rows) + "\n")
    fleet = FLEET + '\n[data]\nformat = "table"\npath = "wide.csv"\noptions = {client = "writer", stack = "x"}\n'
    code, summary, err = simulate(tmp_path, capsys, "--task", str(TASKS / "digits_task.py"), fleet=fleet)
    assert code == 0, err
    check_summary(summary)


def test_an_npz_cut_by_a_dirichlet_partitioner_runs_a_training_and_an_evaluation_task(tmp_path, capsys):
    data = write_npz(tmp_path / "digits.npz")
    code, summary, err = simulate(
        tmp_path,
        capsys,
        "--task",
        str(TASKS / "digits_eval_task.py"),
        "--data",
        f"npz:{data},partition=dirichlet,alpha=0.5,clients=30",
    )
    assert code == 0, err
    check_summary(summary)
    assert summary["tasks"] == ["digits_mlp", "digits_mlp_eval"] and summary["data_clients"] == 30


def test_the_built_in_digits_spec_runs_a_task_group(tmp_path, capsys):
    code, summary, err = simulate(
        tmp_path, capsys, "--task", str(TASKS / "digits_lr_sweep.py"), "--data", "digits,partition=shards,clients=40"
    )
    assert code == 0, err
    assert summary["tasks"] == ["digits_mlp-lr0.1", "digits_mlp-lr0.2", "digits_mlp-lr0.3"]
    assert summary["rounds_committed"] >= 1 and summary["data_clients"] == 40


SECURE_TASK = """
from device_runtime import build_mlp_plan
from emulator.toolchain.tasks import Task
from example_store import ExampleSelector
from server_stub import RoundConfig

def mlp(hp):
    return build_mlp_plan(64, (16,), 10, learning_rate=hp["lr"], batch_size=8, epochs=1,
                          selector=ExampleSelector("app:/digits"), secure_aggregation=True)

task = Task(name="secure_mlp", model=mlp, proxy=lambda: None, hyperparameters={"lr": 0.3},
            rounds=RoundConfig(goal_count=10, secagg_min_group_size=5, secagg_round_timeout_s=10.0,
                               selection_timeout_s=300.0, report_timeout_s=180.0, retry_window_s=(60.0, 300.0)))
"""


def secure_fleet(tmp_path: Path) -> tuple[Path, Path]:
    task = tmp_path / "secure_task.py"
    task.write_text(SECURE_TASK)
    config = tmp_path / "fleet.toml"
    config.write_text("[fleet]\ndevices = 60\nhours = 1.0\nstart_utc_hour = 6.0\n[task]\ncompute_s_per_example = 0.2\n")
    return task, config


def test_whole_number_labels_a_csv_writes_as_floats_run_the_built_in_task(tmp_path):
    """A CSV's label column of 0.0, 1.0, 2.0 (what pandas writes for ints beside a missing value):
    LEAF's loader takes such labels as class ids, and the built-in task refused them."""
    path = write_csv(tmp_path / "people.csv")
    path.write_text(path.read_text().replace(",0\n", ",0.0\n").replace(",1\n", ",1.0\n"))
    spec = parse_data_spec(f"table:{path},client=client")
    workload = load_workload(FleetConfig.default().replace(data=spec, devices=10))
    assert workload.data.features["y"].dtype == "float64" and workload.inputs["y"].dtype == "int64"


def test_a_secure_task_file_turns_on_the_fleets_attested_secure_path(tmp_path):
    task, config = secure_fleet(tmp_path)
    workload = load_workload(FleetConfig.load(config).replace(task_file=task))
    assert (
        workload.secure and workload.tasks[0].rounds.goal_count == 10
    )  # the task's RoundConfig: [task] sets no round key
    assert not load_workload(FleetConfig.load(config)).secure


@pytest.mark.slow
def test_a_secure_task_file_commits_rounds_summed_in_attested_groups(tmp_path, capsys):
    task, config = secure_fleet(tmp_path)
    code = main(
        [
            "simulate",
            str(config),
            "--task",
            str(task),
            "--seed",
            "3",
            "--no-progress",
            "--data",
            "digits,partition=iid,clients=20",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["rounds_committed"] >= 1 and summary["errors"] == {}
    assert summary["shapes"].get("-v[]+^", 0) >= 10  # reports summed in attested groups


def test_a_sharded_run_of_a_task_file_on_a_dataset_equals_the_single_process_run():
    from emulator.fleet import simulate, simulate_sharded
    from emulator.fleet.federated_data import parse_data_spec

    config = FleetConfig.load(ROOT / "examples" / "fleets" / "small.toml").replace(
        devices=40,
        hours=1.0,
        task_file=TASKS / "digits_eval_task.py",
        data=parse_data_spec("digits,partition=dirichlet,clients=25"),
    )
    alone = simulate(config, progress=False)
    sharded = simulate_sharded(config, shards=2, ray=False)
    assert sharded.digest == alone.digest and alone.summary()["rounds_committed"] >= 1
    assert sharded.summary()["client_accuracy_percentiles"] == alone.summary()["client_accuracy_percentiles"]


def test_a_task_files_round_config_holds_but_for_the_task_keys_the_fleet_config_sets(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(f'[task]\nfile = "{TASKS / "digits_task.py"}"\ngoal_count = 7\nretry_min_s = 20.0\n')
    config = FleetConfig.load(fleet)
    (task,) = load_workload(config).tasks
    assert task.rounds.goal_count == 7 and task.rounds.max_rounds == 20  # the fleet's key; the task's own
    assert task.rounds.report_timeout_s == 60.0 and tuple(task.rounds.retry_window_s) == (
        20.0,
        1800.0,
    )  # both retry keys
    assert load_workload(config.replace(goal=9)).tasks[0].rounds.goal_count == 9  # --goal
    kept = load_workload(config.replace(devices=30)).tasks[0].rounds
    assert kept.goal_count == 7 and kept.report_timeout_s == 60.0  # a command-line override sets nothing else
    default = load_workload(FleetConfig.default()).tasks[0].rounds
    assert default.goal_count == 100 and default.report_timeout_s == 180.0  # the built-in task runs [task]'s


@pytest.mark.parametrize(
    "args, fleet_extra, says",
    [
        (("--task", "no_such_task.py"), "", "no such file"),
        (
            ("--task", "{tmp}"),
            "",
            "a folder; give the path of a task file (as `fedfleet plan build` takes) or a bundle folder holding task.py",
        ),
        ((), '[task]\nfile = "missing.py"\n', "no task file at"),
        (("--task", "{broken}"), "", "does not load"),
        (("--task", "{not_a_plan}"), "", "does not build"),
        (("--data", "leaf:/no/such/folder"), "", "does not exist"),
        (("--data", "parquet:x.parquet"), "", "unknown data format"),
        (
            ("--task", str(TASKS / "digits_task.py"), "--data", "tff-h5:{tff}"),
            "",
            "(missing: x, y); use data with those features, or a task file whose plan inputs name the data's "
            "features; or give the data's features (label, pixels go unread) the names the plan reads, x, y, with "
            "the data spec's option rename=OLD:NEW+OLD2:NEW2",
        ),
        (("--task", str(TASKS / "digits_task.py")), "[task]\nhidden = [16]\n", "shapes the built-in digits MLP only"),
        (  # the flag a newcomer typed, not only the config key it sets
            ("--task", str(TASKS / "digits_task.py"), "--secure"),
            "",
            "[task] secure (--secure) shapes the built-in digits MLP only; with a task file, set it in ",
        ),
        (("--target-accuracy", "1.5"), "", "between 0 and 1"),
        (("--data", "table:{negative},client=client"), "", "goes down to -1; number the classes from 0"),
        (
            ("--data", "table:{huge},client=client"),
            "",
            "label 'y' of table:{huge} goes up to 1000000000000, past its limit of 99999",
        ),
        (
            ("--data", "table:{wide},client=client"),
            "",
            "has f0 float64[], f1 float64[], f10 float64[], f11 float64[], f2 float64[], f3 float64[], f4 float64[], "
            "f5 float64[] and 5 more (label y); name a task file that reads them (--task or [task] file); a table's 12 "
            "numeric columns become one vector feature NAME with the option stack=NAME",
        ),
        (
            ("--task", str(TASKS / "digits_task.py"), "--data", "table:{text},client=client"),
            "",
            "feature 'x' of the data table:{text} is text; the plan reads numbers (read it as word ids with the data "
            "spec's option words=x)",
        ),
        (("--data", "table:{nan},client=client"), "", "column 'x' holds values that are NaN, infinite"),
        (
            ("--data", "table:{fraction},client=client"),
            "",
            "the label 'y' of table:{fraction} is float64 with fractions",
        ),
        (  # every device would refuse its batches: said before the run, not as 0 rounds after it
            ("--task", str(TASKS / "digits_cnn_task.py"), "--data", "table:{twelve},client=client"),
            "",
            "runs from 0 to 11, but the plan 'digits_cnn' ({cnn}) scores 10 classes (ids 0 to 9), and the data holds "
            "11 in 2 examples, 10 in 2 examples outside them; use a task whose model has an output per class",
        ),
        (  # a plan whose header names no class count: the classes are its loss's logits' width
            ("--task", str(TASKS / "digits_task.py"), "--data", "table:{twelve},client=client"),
            "",
            "scores 10 classes (ids 0 to 9), and the data holds 11 in 2 examples, 10 in 2 examples outside them",
        ),
        (  # a label column named neither label nor y: stack= takes it into the vector
            ("--task", str(TASKS / "digits_task.py"), "--data", "table:{unlabelled},client=client,stack=x"),
            "",
            "(missing: y); use data with those features, or a task file whose plan inputs name the data's "
            "features; the data has no label (without the data spec's option label=NAME, a feature named label or "
            "y): name the one holding it with label=NAME, which stack= then leaves out of its vector",
        ),
        (
            (
                "--task",
                str(TASKS / "digits_task.py"),
                "--data",
                "table:{unlabelled},client=client,stack=x,rename=cls:y",
            ),
            "",
            "rename: 'cls' is not a feature of table:{unlabelled}, whose features are x: stack=x holds every numeric "
            "column but the label, and without label= the label is a column named label or y, which it has not; if "
            "'cls' is the label, name it with label=cls",
        ),
        (
            ("--task", str(TASKS / "digits_task.py"), "--data", "npz:{onehot},partition=iid,clients=4"),
            "",
            "feature 'y' of the data npz:{onehot},clients=4,partition=iid has [10] values per example; the plan reads "
            "int64[] (a class id per example: one-hot labels are saved as ids with y.argmax(axis=1))",
        ),
        (  # TFF's Shakespeare: text and no label, which no plan reads as it is
            ("--data", "tff-h5:{lines}"),
            "",
            "plans read numbers, not text: the data spec's option chars=snippets cuts it into next-character examples "
            "x and y as LEAF cuts Shakespeare (chars=snippets,window=20 fits --task examples/tasks/shakespeare_task.py)",
        ),
        (
            ("--task", str(TASKS / "shakespeare_task.py"), "--data", "tff-h5:{lines}"),
            "",
            "(missing: x, y); use data with those features, or a task file whose plan inputs name the data's "
            "features; plans read numbers, not text: the data spec's option chars=snippets cuts it into "
            "next-character examples x and y as LEAF cuts Shakespeare (window=20 fits the plan's x)",
        ),
        (
            ("--data", "table:{text},client=client"),
            "",
            "(label y); plans read numbers, not text: the data spec's option words=x reads it as word ids",
        ),
        (
            ("--task", str(TASKS / "digits_cnn_task.py"), "--data", "table:{halves},client=client"),
            "",
            "holds fractions, but the plan 'digits_cnn'",
        ),
    ],
)
def test_input_the_fleet_cannot_run_gets_one_line_and_exit_code_2(tmp_path, capsys, args, fleet_extra, says):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('the proxy data is not there')\n")
    not_a_plan = tmp_path / "not_a_plan.py"
    not_a_plan.write_text(
        "from emulator.toolchain.tasks import ProxyData, Task\n"
        "task = Task(name='t', model=lambda hp: 42, proxy=lambda: None)\n"
    )
    tff = write_tff(tmp_path / "tff") if any("{tff}" in a for a in args) else None
    lines = tmp_path / "lines.h5"  # TFF's Shakespeare: each role's lines as byte strings, nothing else
    with h5py.File(lines, "w") as f:
        for role in ("ROMEO", "JULIET"):
            f.create_dataset(
                f"examples/{role}/snippets", data=np.array(["What light"] * 3, object), dtype=h5py.string_dtype()
            )
    negative = tmp_path / "negative.csv"  # labels -1 and 1: each device's training would refuse them
    negative.write_text("client,x,y\n" + "".join(f"c{i % 4},{i / 8},{1 if i % 2 else -1}\n" for i in range(64)))
    huge = tmp_path / "huge.csv"  # one label id of 10**12: the built-in task's output layer would be 7 TiB
    huge.write_text("client,x,y\n" + "".join(f"c{i % 4},{i / 8},{10**12 if i == 5 else i % 3}\n" for i in range(64)))
    wide = tmp_path / "wide.csv"  # twelve numeric columns, and a plan that reads one
    wide.write_text("client," + ",".join(f"f{i}" for i in range(12)) + ",y\n" + "c0," + ",".join(["0.5"] * 12) + ",1\n")
    text = tmp_path / "text.csv"
    text.write_text("client,x,y\nc0,good day,1\nc1,bad day,0\n")
    nan = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"client": ["c0", "c1"], "x": [[0.5, float("nan")], [0.5, 0.5]], "y": [0, 1]}), nan)
    fraction = tmp_path / "fraction.csv"
    fraction.write_text("client,x,y\nc0,0.5,1.0\nc1,0.25,0.5\n")
    twelve = tmp_path / "twelve.parquet"  # the digits task's 64 pixels, labelled 0 to 11
    pq.write_table(
        pa.table({"client": [f"c{i % 4}" for i in range(24)], "x": [[0.5] * 64] * 24, "y": list(range(12)) * 2}), twelve
    )
    unlabelled = tmp_path / "unlabelled.csv"  # the digits task's 64 pixels and a label called cls
    unlabelled.write_text(
        "client," + ",".join(f"p{i}" for i in range(64)) + ",cls\n" + "c0," + ",".join(["0.5"] * 64) + ",1\n"
    )
    onehot = tmp_path / "onehot.npz"  # Keras' to_categorical labels
    np.savez(onehot, x=np.full((40, 64), 0.5, np.float32), y=np.eye(10, dtype=np.float32)[np.arange(40) % 10])
    halves = tmp_path / "halves.parquet"
    pq.write_table(pa.table({"client": ["c0", "c1"] * 4, "x": [[0.5] * 64] * 8, "y": [0.5, 1.0] * 4}), halves)
    names = {
        "halves": halves,
        "lines": lines,
        "unlabelled": unlabelled,
        "onehot": onehot,
        "twelve": twelve,
        "cnn": TASKS / "digits_cnn_task.py",
        "fraction": fraction,
        "wide": wide,
        "text": text,
        "nan": nan,
        "broken": broken,
        "not_a_plan": not_a_plan,
        "tff": tff,
        "negative": negative,
        "huge": huge,
        "tmp": tmp_path,
    }
    args = tuple(a.format(**names) for a in args)
    says = says.format(**names)
    fleet = "[fleet]\ndevices = 10\nhours = 0.1\n" + ("\n" + fleet_extra if fleet_extra else "")
    code, _, err = simulate(tmp_path, capsys, *args, fleet=fleet)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_character_ids_are_held_as_uint8_and_fed_to_the_plan_as_its_int64_with_the_same_values(tmp_path):
    """LEAF's full Shakespeare (4.2 million windows of 80 characters) took 2.7 GB as int64 ids: they
    are held as uint8 now, and the batches the plan trains on are its int64, id for id."""
    from device_runtime.batching import batches_from_examples
    from emulator.fleet import generate_population
    from emulator.fleet.federated_data import encode_characters

    text = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to suffer~"
    users = {
        role: {"x": [text[i : i + 20] for i in starts], "y": [text[i + 20] for i in starts]}
        for role, starts in (("HAMLET", range(30)), ("OPHELIA", range(30, 60)))
    }
    body = {"users": list(users), "num_samples": [30, 30], "user_data": users}
    (tmp_path / "shakespeare.json").write_text(json.dumps(body))
    config = FleetConfig.default().replace(
        data=parse_data_spec(f"leaf:{tmp_path / 'shakespeare.json'}"),
        task_file=TASKS / "shakespeare_task.py",
        devices=2,
    )
    workload = load_workload(config)
    assert {n: s.dtype for n, s in workload.data.features.items()} == {"x": "uint8", "y": "uint8"}
    held = workload.data.dataset.train["HAMLET"]
    assert held["x"].dtype == np.uint8 and held["y"].dtype == np.uint8 and len(held["y"]) == 27
    assert {tuple(r) for r in held["x"].tolist()} <= {
        tuple(encode_characters(w).tolist()) for w in users["HAMLET"]["x"]
    }
    spec = next(s for s in generate_population(config) if workload.data.client_of(s.index) == "HAMLET")
    examples = workload.device_examples(spec)[workload.collection]
    batches = list(batches_from_examples(workload.training[0].plan.device, lambda: [examples])())
    fed = {n: np.concatenate([b[n] for b in batches]) for n in ("x", "y")}
    assert workload.inputs["x"].dtype == workload.inputs["y"].dtype == "int64"
    assert fed["x"].dtype == np.int64 and fed["y"].dtype == np.int64
    assert sorted(zip(map(tuple, fed["x"].tolist()), fed["y"].tolist())) == sorted(
        zip(map(tuple, held["x"].tolist()), held["y"].tolist())
    )


def test_a_task_files_eligibility_policies_are_what_the_simulated_server_and_devices_judge(tmp_path, capsys):
    """``Task.eligibility`` goes with the task to the fleet's server, as ``fedfleet deploy`` sends it:
    devices whose stores hold fewer examples than the task asks for are turned away, and the note
    says where to ask less."""
    (tmp_path / "task.py").write_text(
        "import dataclasses, runpy\n"
        "from device_runtime import EligibilityPolicies\n"
        f"base = runpy.run_path({str(TASKS / 'digits_task.py')!r})['task']\n"
        "task = dataclasses.replace(base, eligibility=EligibilityPolicies(min_examples=10**6))\n",
        encoding="utf-8",
    )
    fleet = FLEET.replace("hours = 2.0", "hours = 0.3")
    code, summary, err = simulate(tmp_path, capsys, "--task", str(tmp_path / "task.py"), fleet=fleet)
    assert code == 0, err
    assert summary is not None and summary["sessions_accepted"] == 0
    assert set(summary["checkins_rejected_by"]) <= {"INELIGIBLE:min_examples", "RUNTIME_VERSION_UNSUPPORTED"}
    assert summary["checkins_rejected_by"]["INELIGIBLE:min_examples"] > 0
    assert "(the task file's Task.eligibility)" in err
