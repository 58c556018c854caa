"""Emulated devices that run a real old onnxruntime: plan execution in a worker process inside the
release's own env, a fleet with a version mix where each device trains the plan served for its
version on that version, and interruptions that reach the worker: ``should_abort`` before every
step, a forced stop inside a step in flight, and nothing of an interrupted run left behind."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime import (
    FLRuntime,
    Outcome,
    PlanExecutor,
    RuntimeEnvironment,
    TrainingInterrupted,
    build_mlp_plan,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.clock import VirtualClock
from emulator.devices.inprocess import InProcessTransport
from emulator.releases.envs import RuntimeEnv, RuntimeEnvError, requirements_for
from emulator.releases.workers import (
    TIMEOUT_ENV_VAR,
    ReleasePlans,
    RuntimeWorker,
    WorkerError,
    WorkerExecutor,
    WorkerPool,
    assign_releases,
)
from emulator.toolchain.bundle import build_bundle, release_test_bundle
from emulator.toolchain.release_signing import public_key_bytes
from emulator.toolchain.versioning import versioned_plan
from example_store import ExampleSelector, SQLiteExampleStore
from server_stub import AdminClient, AdminKeys, FLService, RoundConfig, ServerStore, create_app
from server_stub.admin_client import task_body

TASK_FILE = Path(__file__).resolve().parents[3] / "examples" / "tasks" / "digits_task.py"
OLD, NEW = "1.17.3", "1.31.1"
URL = "http://fl.internal"


@pytest.mark.timeout(1800)  # a cold cache installs the release first
def test_a_release_worker_trains_like_the_in_process_executor(digits):
    plan = build_mlp_plan(64, (16,), 10, opset=17, batch_size=8, epochs=2, selector=ExampleSelector("app:/digits"))
    weights = initial_weights(plan, seed=3)
    data = [{"x": digits.x_train[:40], "y": digits.y_train[:40]}]
    local = PlanExecutor(plan)
    want = local.run_device(weights, local.batches_from_examples(lambda: data))
    with RuntimeWorker.for_release(OLD) as worker:
        assert worker.reported_version == OLD
        remote = WorkerExecutor(versioned_plan(plan, OLD), worker)
        got = remote.run_device(weights, remote.batches_from_examples(lambda: data))
    assert got.num_examples == want.num_examples == 40
    for name, value in want.update.items():
        np.testing.assert_allclose(got.update[name], value, rtol=1e-5, atol=1e-6)
    assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-5)


@pytest.mark.timeout(1800)
def test_a_graph_the_release_cannot_run_fails_with_its_own_message():
    plan = build_mlp_plan(64, (), 10, opset=21, selector=ExampleSelector("app:/digits"))
    forced = versioned_plan(plan, "1.15.1", opset=19)  # Equal-19: in 1.15's opset, not in its kernels
    with RuntimeWorker.for_release("1.15.1") as worker:
        with pytest.raises(WorkerError, match="onnxruntime 1.15.1: .*NOT_IMPLEMENTED.*Equal"):
            worker.load(forced.work)
        worker.load(versioned_plan(plan, "1.15.1").work)  # the versioned plan avoids it


@given(count=st.integers(0, 200), weights=st.lists(st.integers(0, 10), min_size=1, max_size=5).filter(any))
def test_release_shares_give_each_release_its_proportion(count, weights):
    shares = {f"1.{15 + i}.0": float(w) for i, w in enumerate(weights)}
    releases = assign_releases(count, shares, random.Random(count))
    counts = Counter(releases)
    assert len(releases) == count
    total = sum(shares.values())
    for release, share in shares.items():
        assert abs(counts[release] - count * share / total) < 1  # largest remainders: never a whole device off


@pytest.mark.timeout(1800)
def test_devices_on_two_real_releases_each_train_their_versioned_plan_and_report(tmp_path, digits):
    bundle = tmp_path / "bundle"
    build_bundle(TASK_FILE, bundle, runtimes=[OLD, NEW])
    clock = VirtualClock()
    tester = Ed25519PrivateKey.generate()  # whoever ran the release tests signs the report; the server trusts them
    service = FLService(
        ServerStore(tmp_path / "server.db"),
        clock=clock.now,
        wall_clock=clock.now,
        require_release_reports=True,
        release_trust=frozenset({public_key_bytes(tester)}),
    )
    keys, key = AdminKeys.generate()
    releases = assign_releases(4, {OLD: 0.5, NEW: 0.5}, random.Random(0))
    with WorkerPool() as pool, InProcessTransport(create_app(service, admin_keys=keys)) as transport:
        (built,) = release_test_bundle(bundle, pool, signing_key=tester)
        with AdminClient(URL, admin_key=key, transport=transport) as admin:
            admin.create_population("digits")
            config = RoundConfig(goal_count=4, over_selection=1.0, min_fraction=1.0, min_reports=1)
            admin.deploy_body(
                "digits",
                task_body(
                    built.task.name,
                    built.plan,
                    built.checkpoint,
                    config,
                    versioned_plans=built.versions,
                    release_report=built.report(),
                ),
            )
            plans = ReleasePlans(pool)
            outcomes, served = [], {}
            for round_number in range(2):
                for i, release in enumerate(releases):
                    store = SQLiteExampleStore(tmp_path / f"d{i}.db")
                    if round_number == 0:
                        part = slice(50 * i, 50 * i + 50)
                        store.add(
                            "app:/digits",
                            ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])),
                        )
                    with FLRuntime(
                        "digits",
                        URL,
                        store,
                        transport=transport,
                        runtime_version=release,
                        environment=RuntimeEnvironment(clock=clock.now, loaded_plans=plans),
                    ) as runtime:
                        outcomes.append((release, runtime.run_session().outcome))
                        served.setdefault(release, set()).update(runtime._plans)
                    store.close()
            rounds = admin.rounds("digits")
        workers = {release: pool.worker(release).reported_version for release in (OLD, NEW)}
    assert Counter(releases) == {OLD: 2, NEW: 2}
    assert outcomes == [(r, Outcome.COMPLETED) for r in releases] * 2  # both releases reported, both rounds
    assert [(r["status"], r["metrics"]["reported"]) for r in rounds] == [("committed", 4)] * 2
    assert served == {r: {built.manifest["versions"][r]["sha256"]} for r in (OLD, NEW)}  # each got its own plan
    assert workers == {OLD: OLD, NEW: NEW}
    service.store.close()


HEAVY = build_mlp_plan(512, (1024,) * 4, 10, opset=17, batch_size=512, epochs=1, selector=ExampleSelector("app:/x"))


@pytest.mark.timeout(1800)
def test_a_forced_stop_ends_the_workers_step_in_flight_and_keeps_nothing_of_the_run():
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((512, 512)).astype(np.float32), "y": rng.integers(0, 10, 512)}]
    weights = initial_weights(HEAVY, seed=0)
    with RuntimeWorker.for_release(OLD) as worker:
        executor = WorkerExecutor(versioned_plan(HEAVY, OLD), worker)
        whole = executor.run_device(weights, executor.batches_from_examples(lambda: data))
        step_s = worker.train(executor.plan, weights, [executor.feeds(data[0])]).step_s[0]  # the step alone, warm
        run_options = ort.RunOptions()
        stopped_at = []

        def stop() -> None:
            stopped_at.append(time.perf_counter())
            run_options.terminate = True

        def examples():  # the stop comes once the first of eight steps is under way, however late a
            threading.Timer(step_s / 4, stop).start()  # loaded machine runs the timer: the run lasts 8 steps
            yield from data * 8

        with pytest.raises(TrainingInterrupted, match="by force") as interrupted:
            executor.run_device(weights, executor.batches_from_examples(examples), run_options=run_options)
        assert stopped_at, "the run ended before the stop was sent"
        assert worker.open_runs() == {}  # the interrupted run's weights are gone
        again = executor.run_device(weights, executor.batches_from_examples(lambda: data))
    # onnxruntime ended the step in flight: a stop that waited for the step to finish would be seen
    # before the next one began (the steps follow each other within a millisecond of a 0.1-1 s step)
    assert "while a step was running" in str(interrupted.value)
    for name, value in whole.update.items():  # the worker is as before the interrupted run
        np.testing.assert_array_equal(again.update[name], value)


@pytest.fixture(scope="module")
def small_worker():
    with RuntimeWorker.for_release(OLD) as worker:
        yield worker


SMALL = build_mlp_plan(64, (8,), 10, opset=17, batch_size=8, epochs=2, selector=ExampleSelector("app:/digits"))


@settings(max_examples=15, deadline=None)
@given(abort_at=st.integers(1, 10))
def test_should_abort_is_checked_before_every_step_in_the_worker(small_worker, digits, abort_at):
    executor = WorkerExecutor(versioned_plan(SMALL, OLD), small_worker)
    data = [{"x": digits.x_train[:40], "y": digits.y_train[:40]}]  # 5 batches, 2 epochs: 10 steps
    checks = []

    def should_abort() -> bool:  # note how many steps the worker's run had taken at each check
        checks.append(sum(small_worker.open_runs().values()))
        return len(checks) == abort_at

    with pytest.raises(TrainingInterrupted):
        executor.run_device(
            initial_weights(SMALL), executor.batches_from_examples(lambda: data), should_abort=should_abort
        )
    assert checks == list(range(abort_at))  # one check before each step, with the steps before it done
    assert small_worker.open_runs() == {}


@pytest.mark.timeout(1800)
def test_a_device_session_stopped_by_force_on_an_old_release_ends_interrupted(tmp_path):
    clock = VirtualClock()
    service = FLService(ServerStore(tmp_path / "server.db"), clock=clock.now, wall_clock=clock.now)
    keys, key = AdminKeys.generate()
    rng = np.random.default_rng(1)
    run_options, stopped_at, started = ort.RunOptions(), [], []

    def stop() -> None:
        stopped_at.append(time.perf_counter())
        run_options.terminate = True

    def should_abort() -> bool:  # asked before the first of four steps: stop it once it is under way
        if not started:  # (four, so that a timer a loaded machine runs late still finds a step running)
            started.append(threading.Timer(0.05, stop))
            started[0].start()
        return False

    with WorkerPool() as pool, InProcessTransport(create_app(service, admin_keys=keys)) as transport:
        with AdminClient(URL, admin_key=key, transport=transport) as admin:
            admin.create_population("heavy")
            config = RoundConfig(goal_count=1, over_selection=1.0, min_fraction=1.0, min_reports=1)
            admin.deploy_task("heavy", "train", HEAVY, encode_checkpoint(initial_weights(HEAVY)), config)
        with SQLiteExampleStore(tmp_path / "device.db") as store:
            x = rng.standard_normal((4 * 512, 512)).astype(np.float32)
            store.add("app:/x", ({"x": xi, "y": int(yi)} for xi, yi in zip(x, rng.integers(0, 10, 4 * 512))))
            with FLRuntime(
                "heavy",
                URL,
                store,
                transport=transport,
                runtime_version=OLD,
                environment=RuntimeEnvironment(clock=clock.now, loaded_plans=ReleasePlans(pool)),
            ) as runtime:
                result = runtime.run_session(should_abort=should_abort, run_options=run_options)
        open_runs = pool.worker(OLD).open_runs()
    assert stopped_at  # the session ended because of the stop, not before it was sent
    assert result.outcome is Outcome.INTERRUPTED and [e.kind for e in result.events][-1] == "interrupted"
    assert open_runs == {}
    service.store.close()


def test_a_worker_that_dies_is_reported_with_the_tail_of_its_stderr():
    plan = build_mlp_plan(64, (), 10, opset=17, selector=ExampleSelector("app:/digits"))
    with RuntimeWorker.host() as worker:
        worker.load(plan.work)
        worker._proc.kill()
        worker._proc.wait()
        with pytest.raises(WorkerError, match=r"worker was killed \(SIGKILL: out of memory, or another process"):
            worker.load(build_mlp_plan(64, (8,), 10, opset=17, selector=ExampleSelector("app:/digits")).work)


def test_a_worker_makes_its_sessions_as_the_device_does_without_folding_constants():
    """The Loop the dynamo exporter writes for nn.EmbeddingBag ends onnxruntime 1.32 in a segmentation
    fault when its constant folding runs; a release's worker runs a plan's graphs as the device does
    (``DISABLED_OPTIMIZERS``), so it computes this one rather than dying."""
    graph = Path(__file__).parents[1] / "toolchain" / "data" / "embedding_bag.onnx"
    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(graph)).graph.initializer}
    ids = np.array([[1, 2, 2, 5], [0, 3, 4, 1]], dtype=np.int64)
    with RuntimeWorker.host() as worker:
        (logits,) = worker.run(graph.read_bytes(), {"ids": ids}, ["logits"]).values()
    want = weights["bag.weight"][ids].mean(1) @ weights["fc.weight"].T + weights["fc.bias"]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)


def endless_loop() -> bytes:
    """y = x + 1, 2**62 times: a graph onnxruntime loads and then never ends."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["go"], ["go_on"]), helper.make_node("Add", ["v", "one"], ["v_next"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("go", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("go_on", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_next", TensorProto.FLOAT, [1]),
        ],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body)],
        "endless",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[
            helper.make_tensor("trips", TensorProto.INT64, [], [2**62]),
            helper.make_tensor("go", TensorProto.BOOL, [], [True]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _answers(worker: RuntimeWorker) -> bool:
    plan = build_mlp_plan(64, (), 10, opset=17, selector=ExampleSelector("app:/digits"))
    worker.load(versioned_plan(plan, OLD).work)
    return worker.alive


@pytest.mark.timeout(1800)  # a cold cache installs the release first
def test_a_worker_that_does_not_answer_in_time_is_stopped_and_its_pool_starts_another():
    with WorkerPool() as pool:
        hung = pool.worker(OLD)
        hung.load(endless_loop())
        hung.timeout = 1.0  # after it started: importing onnxruntime on a loaded machine may take longer
        with pytest.raises(WorkerError) as stopped:
            hung.run(endless_loop(), {"x": np.zeros(1, np.float32)}, ["y"])
        assert f"onnxruntime {OLD} did not answer 'run' within 1 s" in str(stopped.value)
        assert "\n" not in str(stopped.value) and not hung.alive
        again = pool.worker(OLD)
        assert again is not hung and _answers(again)


@pytest.mark.timeout(1800)
def test_a_worker_killed_mid_run_is_named_by_its_signal_and_replaced_at_its_next_use():
    with WorkerPool() as pool:
        killed = pool.worker(OLD)
        killed.load(endless_loop())
        crash = threading.Timer(0.3, lambda: os.kill(killed._proc.pid, signal.SIGSEGV))
        crash.start()
        with pytest.raises(
            WorkerError, match=r"worker crashed \(SIGSEGV\) inside onnxruntime or numpy while it ran 'run'"
        ):
            killed.run(endless_loop(), {"x": np.zeros(1, np.float32)}, ["y"])
        crash.join()
        again = pool.worker(OLD)
        assert again is not killed and _answers(again)


def test_a_damaged_env_is_made_again_or_named_when_it_may_not_be(tmp_path):
    env = RuntimeEnv(OLD, tmp_path / f"onnxruntime-{OLD}")
    env.python.parent.mkdir(parents=True)
    env.python.symlink_to(sys.executable)  # its interpreter, but none of its packages: site-packages deleted
    env.marker.write_text(json.dumps({"onnxruntime": OLD, "requirements": requirements_for(OLD)}))
    assert env.is_valid()
    with pytest.raises(RuntimeEnvError) as named:
        RuntimeWorker.for_release(OLD, cache=tmp_path, create=False)
    assert f"the env of onnxruntime {OLD} at {env.path} is damaged (ModuleNotFoundError" in str(named.value)
    assert f"python -m emulator.releases.cache remove {OLD}" in str(named.value)
    with pytest.raises(RuntimeEnvError, match="is not a Python with venv that runs"):  # made again, with this base
        RuntimeWorker.for_release(OLD, cache=tmp_path, base_python=tmp_path / "no-python")
    assert not env.path.exists()


def test_a_timeout_that_is_not_a_positive_number_is_refused(monkeypatch):
    for raw in ("soon", "0", "-5", "nan", "inf"):
        monkeypatch.setenv(TIMEOUT_ENV_VAR, raw)
        with pytest.raises(WorkerError, match=f"FEDFLEET_WORKER_TIMEOUT is '{raw}'; give the seconds"):
            WorkerPool()


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_real_env_whose_onnxruntime_was_deleted_is_installed_again_when_a_worker_starts(tmp_path):
    env = RuntimeEnv.for_release(OLD, cache=tmp_path)
    native = next(env.path.glob("lib/python3*/site-packages/onnxruntime/capi/onnxruntime_pybind11_state*"))
    native.unlink()
    assert env.is_valid() and "onnxruntime_pybind11_state" in (env.problem() or "")
    with RuntimeWorker.for_release(OLD, cache=tmp_path) as worker:
        assert worker.reported_version == OLD and env.problem() is None


def test_the_timeout_holds_for_each_step_of_local_epochs_not_for_all_of_them(digits):
    """The release tests send a release's local epochs as one request of many steps: a model whose
    steps each take a fraction of the timeout, but all of them together several times it, trains to
    the end (it was stopped as if its graph never ended)."""
    plan = build_mlp_plan(64, (1536, 1536), 10, opset=17, batch_size=128, selector=ExampleSelector("app:/digits"))
    weights = initial_weights(plan, seed=0)
    batch = {"x": digits.x_train[:128].astype(np.float32), "y": digits.y_train[:128].astype(np.int64)}
    with RuntimeWorker.host() as worker:
        worker.train(plan, weights, [batch])  # the session is made
        started = time.monotonic()
        worker.train(plan, weights, [batch] * 3)
        worker.timeout = 2 * (time.monotonic() - started)  # about six steps, in wall time
        trained = worker.train(plan, weights, [batch] * 24)  # about four times the timeout in all
        assert worker.alive and len(trained.step_s) == 24


def test_step_times_are_the_steps_cpu_not_the_wall_time_another_process_takes(digits):
    """ms/step and budget.step_ms measure the release's step, not the machine's load: a worker held
    still (SIGSTOP, as a busy machine's scheduler does) for 0.6 s during its steps reports no step
    of that length (the wall time made one release's steps look several times another's)."""
    plan = build_mlp_plan(64, (1024, 1024), 10, opset=17, batch_size=64, selector=ExampleSelector("app:/digits"))
    weights = initial_weights(plan, seed=0)
    batch = {"x": digits.x_train[:64].astype(np.float32), "y": digits.y_train[:64].astype(np.int64)}
    with RuntimeWorker.host() as worker:
        worker.train(plan, weights, [batch])  # the session is made
        pid = worker._proc.pid
        pause = threading.Timer(
            0.05, lambda: (os.kill(pid, signal.SIGSTOP), time.sleep(0.6), os.kill(pid, signal.SIGCONT))
        )
        pause.start()
        started = time.monotonic()
        trained = worker.train(plan, weights, [batch] * 40)
        wall = time.monotonic() - started
        pause.join()
    assert wall > 0.6 and len(trained.step_s) == 40
    assert max(trained.step_s) < 0.3, max(trained.step_s)


def test_peak_memory_counts_the_step_in_flight_batch_not_every_batch_of_the_request():
    """A release's local epochs arrive as one request holding all their batches; a device reads one
    at a time, so more proxy examples (40 batches of 1 MB here) do not raise the peak (they did,
    by all their bytes: a memory budget then measured the proxy set, not the model)."""
    plan = build_mlp_plan(1024, (), 10, opset=17, batch_size=256, selector=ExampleSelector("app:/d"))
    weights = initial_weights(plan, seed=0)
    batch = {
        "x": np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32),
        "y": np.zeros(256, np.int64),
    }
    with RuntimeWorker.host() as worker:
        few = worker.train(plan, weights, [batch] * 2).peak_memory_mb
        many = worker.train(plan, weights, [batch] * 40).peak_memory_mb  # 40 MB of batches in the request
    assert many - few < 12, (few, many)
