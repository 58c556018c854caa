"""``fedfleet model``: a task's committed model out of a real server or a run folder, as a checkpoint
file or the bundle's ONNX model with its trained weights, and one line for each mistake."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from device_runtime import PlanExecutor, decode_checkpoint, encode_checkpoint, load_plan
from emulator.cli import commands as cli
from emulator.cli.model import RUN_DATABASE
from emulator.toolchain import trained_model
from emulator.toolchain.model_bundle import bundle_from_onnx
from server_stub import RoundConfig, ServerThread
from server_stub.persistence import NewTask, ServerStore
from tests.emulator.toolchain.test_trained_model import mlp_with_a_merged_bias, trained
from tests.support import LoopbackApp

ADMIN_KEY = "operator-key-for-the-model-command-0123456789"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    (folder / "mlp.onnx").write_bytes(mlp_with_a_merged_bias())
    bundle_from_onnx(folder / "mlp.onnx", folder / "bundle", label="y", runtimes=["1.31.1"])
    return folder / "bundle"


def _record(store: ServerStore, task_id: int, rounds: dict[int, tuple[str, dict | None]]) -> None:
    """Rounds on record as a server writes them: each number's status and, committed, its model."""
    now = time.time()
    for number, (status, weights) in rounds.items():
        checkpoint = encode_checkpoint(weights) if weights is not None else None
        metrics = {"selected": 3, "reported": 3 if checkpoint else 0}
        store.record_round(task_id, number, 1, status, metrics, now - 100 + number, now - 99 + number, checkpoint)


def _run_folder(
    tmp_path: Path, bundle: Path, rounds: dict[int, tuple[str, dict | None]] | None = None
) -> tuple[Path, ServerStore]:
    """A run folder whose server kept the bundle's task ``mlp`` of population ``digits`` and its
    ``rounds`` (``_record``; by default round 1 committed its initial model): the folder, its store
    (open)."""
    run = tmp_path / "run"
    (run / RUN_DATABASE).parent.mkdir(parents=True)
    store = ServerStore(run / RUN_DATABASE)
    store.create_population("digits")
    plan = (bundle / "mlp" / "plan.fedplan").read_bytes()
    initial = (bundle / "mlp" / "initial.ckpt").read_bytes()
    (task,) = store.add_tasks("digits", [NewTask("mlp", plan, initial, {})])
    _record(store, task.id, rounds if rounds is not None else {1: ("committed", decode_checkpoint(initial))})
    return run, store


@pytest.fixture(scope="module")
def models(bundle, digits) -> dict[int, dict]:
    first = trained(bundle, digits, steps=1)
    return {1: first, 2: trained(bundle, digits, steps=2)}


def _one_line(capsys, says: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedfleet model: ") and says in err, err


def test_the_model_of_a_servers_committed_round_is_written_as_a_checkpoint_and_as_the_trained_onnx_model(
    bundle, models, digits, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    plan = (bundle / "mlp" / "plan.fedplan").read_bytes()
    initial = (bundle / "mlp" / "initial.ckpt").read_bytes()
    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "mlp", plan, initial, RoundConfig())
        admin.deploy_task("p", "later", plan, initial, RoundConfig())  # queued: no round yet
        (task,) = [t for t in server.store.tasks("p") if t.name == "mlp"]
        _record(
            server.store, task.id, {1: ("committed", models[1]), 2: ("committed", models[2]), 3: ("abandoned", None)}
        )
        base = ["model", "--server", server.url, "--population", "p"]

        assert cli.main([*base, "--task", "mlp", "-o", str(tmp_path / "last.ckpt")]) == 0
        assert capsys.readouterr().out == f"wrote {tmp_path / 'last.ckpt'}: task mlp's model of round 2, 4 tensors\n"
        last = decode_checkpoint((tmp_path / "last.ckpt").read_bytes())
        assert all(np.array_equal(last[k], models[2][k]) for k in models[2])
        assert cli.main([*base, "--task", "mlp", "--round", "1", "-o", str(tmp_path / "one.ckpt")]) == 0
        one = decode_checkpoint((tmp_path / "one.ckpt").read_bytes())
        assert all(np.array_equal(one[k], models[1][k]) for k in models[1])
        capsys.readouterr()

        out = tmp_path / "trained.onnx"
        assert cli.main([*base, "--task", "mlp", "--onnx", str(bundle), "-o", str(out)]) == 0
        said = capsys.readouterr().out
        assert said == (
            f"wrote {out}: {bundle / 'model.onnx'} with task mlp's model of round 2: 4 initializers trained, among "
            "them b2 (the exporter's merged copy of zeros); 1 kept as they were\n"
        )
        x, y = digits.x_test, digits.y_test
        (logits,) = ort.InferenceSession(str(out)).run(["logits"], {"x": x})
        evaluated = PlanExecutor(load_plan(plan)).evaluate(last, [{"x": x, "y": y}])
        assert float(np.mean(logits.argmax(axis=1) == y)) == pytest.approx(evaluated["eval_accuracy"], abs=1e-12)

        assert cli.main(["rounds", "--server", server.url, "--population", "p"]) == 0
        listed = capsys.readouterr().out.splitlines()
        assert listed[0].endswith("  model")
        ids = [r["checkpoint_id"] for r in admin.rounds("p")]
        assert [line.split()[-1] for line in listed[1:]] == [ids[0][:12], ids[1][:12], "-"]

        for argv, code, says in (
            (
                [*base, "--task", "mlp", "--round", "3", "-o", str(tmp_path / "x.ckpt")],
                2,
                "round 3 of task mlp was abandoned: it committed no model",
            ),
            (
                [*base, "--task", "mlp", "--round", "7", "-o", str(tmp_path / "x.ckpt")],
                2,
                f"task mlp has no round 7 on record at {server.url}",
            ),
            (
                [*base, "--task", "later", "-o", str(tmp_path / "x.ckpt")],
                2,
                "task later of population p has no committed round yet",
            ),
            ([*base, "--task", "mpl", "-o", str(tmp_path / "x.ckpt")], 1, "has no task 'mpl' (did you mean mlp?)"),
            ([*base[:4], "q", "--task", "mlp", "-o", str(tmp_path / "x.ckpt")], 1, "population 'q' does not exist"),
            (
                [*base, "--task", "mlp", "-o", str(tmp_path / "last.ckpt")],
                2,
                "last.ckpt exists; name a new file, or pass --force",
            ),
            (
                [*base, "--task", "mlp", "-o", str(tmp_path / "x.onnx")],
                2,
                "without --onnx BUNDLE a checkpoint is written",
            ),
            ([*base, "-o", str(tmp_path / "x.ckpt")], 2, "with --server, give --population and --task"),
        ):
            assert cli.main(argv) == code, argv
            _one_line(capsys, says)
        assert not (tmp_path / "x.ckpt").exists()
        assert cli.main([*base, "--task", "mlp", "-o", str(tmp_path / "last.ckpt"), "--round", "1", "--force"]) == 0

        server.store.prune_models(time.time() + 1)  # round 1's model dropped, the last one kept
        assert cli.main([*base, "--task", "mlp", "--round", "1", "-o", str(tmp_path / "x.ckpt")]) == 2
        _one_line(capsys, "round 1 of task mlp committed, but its model was dropped by fedfleet prune")
        assert cli.main(["rounds", "--server", server.url, "--population", "p"]) == 0
        assert capsys.readouterr().out.splitlines()[1].endswith("  pruned")


def test_the_model_of_a_run_folder_is_read_from_the_database_its_server_kept(bundle, models, tmp_path, capsys):
    run, store = _run_folder(
        tmp_path, bundle, {1: ("committed", models[1]), 2: ("abandoned", None), 3: ("committed", models[2])}
    )
    plan = (bundle / "mlp" / "plan.fedplan").read_bytes()
    initial = (bundle / "mlp" / "initial.ckpt").read_bytes()
    (evaluation,) = store.add_tasks("digits", [NewTask("mlp_eval", plan, initial, {"group": {"evaluates": "mlp"}})])
    store.record_round(evaluation.id, 1, 1, "committed", {"evaluated_checkpoint_id": "ab" * 32}, 1.0, 2.0)
    store.close()

    assert cli.main(["model", "--run", str(run), "-o", str(tmp_path / "m.ckpt")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'm.ckpt'}: task mlp's model of round 3, 4 tensors\n"
    got = decode_checkpoint((tmp_path / "m.ckpt").read_bytes())
    assert all(np.array_equal(got[k], models[2][k]) for k in models[2])
    out = tmp_path / "m.onnx"
    assert cli.main(["model", "--run", str(run), "--round", "1", "--onnx", str(bundle), "-o", str(out)]) == 0
    assert "with task mlp's model of round 1" in capsys.readouterr().out and out.is_file()
    for argv, says in (
        (["--round", "2"], "round 2 of task mlp was abandoned"),
        (
            ["--task", "mlp_eval"],
            "task mlp_eval is an evaluation: its rounds measure the model of the task it evaluates",
        ),
        (["--task", "mpl"], f"the run {run} has no task 'mpl' (did you mean mlp?); it has mlp, mlp_eval"),
        (["--population", "digit"], f"the run {run} has no population 'digit' (did you mean digits?); it has digits"),
    ):
        assert cli.main(["model", "--run", str(run), *argv, "-o", str(tmp_path / "x.ckpt")]) == 2, argv
        _one_line(capsys, says)
    (tmp_path / "no_run" / RUN_DATABASE).parent.mkdir(parents=True)
    (tmp_path / "no_run" / RUN_DATABASE).write_text("not a database")
    assert cli.main(["model", "--run", str(tmp_path / "no_run"), "-o", str(tmp_path / "x.ckpt")]) == 2
    _one_line(capsys, "does not read as a run's server database ((sqlite3.DatabaseError) file is not a database)")
    (tmp_path / "no_run" / RUN_DATABASE).write_bytes(b"")  # was given a new server's tables, then "the populations ;"
    assert cli.main(["model", "--run", str(tmp_path / "no_run"), "-o", str(tmp_path / "x.ckpt")]) == 2
    _one_line(capsys, f"{tmp_path / 'no_run' / RUN_DATABASE} is empty: no server ran on it")
    assert (tmp_path / "no_run" / RUN_DATABASE).stat().st_size == 0
    ServerStore(tmp_path / "no_run" / RUN_DATABASE).close()  # a server's tables, no population
    assert cli.main(["model", "--run", str(tmp_path / "no_run"), "-o", str(tmp_path / "x.ckpt")]) == 2
    _one_line(capsys, f"the run {tmp_path / 'no_run'} has no population: its server recorded no deploy")
    assert cli.main(["model", "--run", str(tmp_path), "-o", str(tmp_path / "x.ckpt")]) == 2
    _one_line(capsys, f"{tmp_path} is no run folder (no {RUN_DATABASE}): give the folder `fedfleet simulate --out RUN`")


@pytest.mark.slow
def test_a_from_onnx_bundle_trained_by_a_simulated_fleet_exports_the_model_onnxruntime_runs_as_the_plan_does(
    tmp_path, capsys, digits
):
    """End to end through the commands a model engineer types: from-onnx, simulate --out, model --onnx."""
    (tmp_path / "mlp.onnx").write_bytes(mlp_with_a_merged_bias())
    bundle, run = tmp_path / "bundle", tmp_path / "run"
    assert (
        cli.main(
            ["plan", "from-onnx", str(tmp_path / "mlp.onnx"), "--label", "y", "--runtimes", "1.31.1", "-o", str(bundle)]
        )
        == 0
    )
    simulate = ["simulate", "--task", str(bundle), "--data", "digits", "--devices", "60", "--hours", "1"]
    assert cli.main([*simulate, "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["model", "--run", str(run), "-o", str(tmp_path / "m.ckpt")]) == 0
    assert cli.main(["model", "--run", str(run), "--onnx", str(bundle), "-o", str(tmp_path / "m.onnx")]) == 0
    weights = decode_checkpoint((tmp_path / "m.ckpt").read_bytes())
    initial = decode_checkpoint((bundle / "mlp" / "initial.ckpt").read_bytes())
    assert not np.allclose(weights["zeros"], weights["b2"]) and not np.array_equal(weights["w1"], initial["w1"])
    x, y = digits.x_test, digits.y_test
    (logits,) = ort.InferenceSession(str(tmp_path / "m.onnx")).run(["logits"], {"x": x})
    plan = load_plan((bundle / "mlp" / "plan.fedplan").read_bytes())
    evaluated = PlanExecutor(plan).evaluate(weights, [{"x": x, "y": y}])
    assert float(np.mean(logits.argmax(axis=1) == y)) == pytest.approx(evaluated["eval_accuracy"], abs=1e-12)


class HostileOperatorServer(LoopbackApp):
    """A server on a loopback port (uvicorn) answering the operator endpoints ``fedfleet model``
    reads as ``mode`` says: rounds paged back in a circle or forward, a model whose round is not a
    number or whose task is not a name, a model of 3 GiB declared, a checkpoint other than the one the round names."""

    def __init__(self) -> None:
        self.mode = ""
        app = Starlette(routes=[Route("/{path:path}", self._answer)])
        super().__init__(app)

    async def _answer(self, request: Request) -> Response:
        path = request.url.path
        if path == "/v1/populations":
            return Response(json.dumps({"populations": ["p"]}), media_type="application/json")
        if path.endswith("/model"):
            head = {"X-Round": {"superscript": "\u00b2", "digits": "9" * 5000}.get(self.mode, "5")}
            head["X-Task"] = "t%0Aand%20a%20second%20line" if self.mode == "task" else "t"
            return Response(b"", headers=head)
        if path.endswith("/rounds"):
            before = int(request.query_params.get("before", "100"))
            older = {"circle": 100, "forward": before + 1}.get(self.mode)
            link = {"Link": f'</v1/populations/p/rounds?before={older}>; rel="next"'} if older else {}
            record = {"round": 5, "task": "t", "attempt": 1, "status": "committed", "checkpoint_id": "ab" * 32}
            rounds = [] if older else [{**record, "metrics": {}, "started_at": 1.0, "ended_at": 2.0}]
            return Response(json.dumps({"rounds": rounds}), media_type="application/json", headers=link)
        if self.mode == "another":  # a checkpoint, but not the one whose id the round names
            return Response(encode_checkpoint({"w": np.zeros(3, np.float32)}))
        return Response(b"\0" * 16, headers={"Content-Length": str(3 << 30)})  # a resource, and cut off after


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileOperatorServer]:
    with HostileOperatorServer() as server:
        yield server


@pytest.mark.parametrize(
    "mode, round_, says",
    [
        ("circle", "3", "rounds names no older round to page back from in its Link header"),
        ("forward", "3", "rounds names no older round to page back from in its Link header"),
        ("superscript", None, "/model is not a model: it names no round (X-Round)"),
        ("digits", None, "/model is not a model: it names no round (X-Round)"),
        ("task", None, "/model is not a model: it names no task (X-Task)"),
        ("huge", "5", f"is {3 << 30} bytes, more than the {1 << 30} a device reads"),
        ("another", "5", "sent for round 5 of task t is not the one its round committed (its bytes do not hash"),
    ],
)
def test_a_hostile_servers_model_answer_is_one_line_never_a_hang_a_traceback_or_gigabytes_held(
    hostile, mode, round_, says, tmp_path, capsys, monkeypatch
):
    """Rounds paged in a circle or forward were read for ever; a round of '²' or of 5,000 digits
    raised ValueError out of int(); a task of two lines was said in two; a model of gigabytes was read whole into memory; another
    checkpoint than the round's was written as its model."""
    monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", ADMIN_KEY)
    hostile.mode = mode
    argv = ["model", "--server", hostile.url, "--population", "p", "--task", "t", "-o", str(tmp_path / "m.ckpt")]
    assert cli.main(argv + (["--round", round_] if round_ else [])) == 2
    _one_line(capsys, says)
    assert not list(tmp_path.iterdir())


def test_the_output_is_refused_in_a_missing_folder_or_as_the_bundles_own_model(bundle, tmp_path, capsys):
    """-o in a missing folder was said of the hidden file written aside; -o BUNDLE/model.onnx --force
    replaced the model the bundle's plan was made from with a trained one."""
    run, store = _run_folder(tmp_path, bundle)
    store.close()
    source = (bundle / "model.onnx").read_bytes()
    base = ["model", "--run", str(run)]
    assert cli.main([*base, "-o", str(tmp_path / "no" / "m.ckpt")]) == 2
    _one_line(capsys, f"-o {tmp_path / 'no' / 'm.ckpt'}: no folder {tmp_path / 'no'}; make it")
    assert cli.main([*base, "--onnx", str(bundle), "-o", str(bundle / "model.onnx"), "--force"]) == 2
    _one_line(capsys, f"-o {bundle / 'model.onnx'} is the bundle's own model.onnx")
    assert (bundle / "model.onnx").read_bytes() == source
    assert cli.main([*base, "--onnx", str(bundle), "-o", str(tmp_path / "m.onnx")]) == 0


def test_a_large_models_data_file_is_written_anew_and_not_over_another_file_without_force(
    bundle, tmp_path, capsys, monkeypatch
):
    """Over ``EXTERNAL_DATA_BYTES`` (here every model) the tensors go to FILE.onnx.data: onnx appended
    them to a file of that name, so each --force grew it by the whole model, and a file of that name
    that was not the export's own was written into without --force."""
    monkeypatch.setattr(trained_model, "EXTERNAL_DATA_BYTES", 0)
    run, store = _run_folder(tmp_path, bundle)
    store.close()
    out, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    argv = ["model", "--run", str(run), "--onnx", str(bundle), "-o", str(out)]
    assert cli.main(argv) == 0
    size = data.stat().st_size
    assert cli.main([*argv, "--force"]) == 0
    assert data.stat().st_size == size and sorted(p.name for p in tmp_path.iterdir()) == [
        "m.onnx",
        "m.onnx.data",
        "run",
    ]
    (x,) = ort.InferenceSession(str(out)).run(["logits"], {"x": np.zeros((1, 64), np.float32)})
    assert x.shape == (1, 10)
    out.unlink()
    capsys.readouterr()
    assert cli.main(argv) == 2
    _one_line(capsys, f"{data} exists, where a large model's tensors are written beside -o {out}")


def test_a_servers_model_larger_than_its_other_answers_is_read_to_the_bound_of_a_devices_checkpoint(
    tmp_path, monkeypatch
):
    """The operators' client held ``/v1/populations/P/model`` to the 64 MiB of a JSON answer, so the
    model of a ResNet-50 (100 MB), which every device downloads, could not be fetched by its operator;
    here the bound of other answers is made smaller than the digits model to show the same."""
    from device_runtime import protocol
    from tests.support import deploy

    with ServerThread(tmp_path / "server.db", admin_key=ADMIN_KEY) as server, server.admin() as admin:
        _, weights = deploy(admin)
        monkeypatch.setattr(protocol, "MAX_ANSWER_BYTES", 1024)
        data, number, task = admin.model_bytes("digits")
    assert len(data) > 1024 and number == 0 and task == "train"
    assert all(np.array_equal(v, weights[k]) for k, v in decode_checkpoint(data).items())
