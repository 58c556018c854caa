"""Plan execution on a real onnxruntime release: a worker process inside that release's cached env.

One interpreter can import one onnxruntime, but a fleet runs many releases and release tests need
each claimed one (paper, section 7.3). A :class:`RuntimeWorker` is a long-lived ``python -I`` in
the env :mod:`emulator.releases.envs` made for a release; it holds onnxruntime sessions by model
hash and runs the work graph's training loop (or one forward run) on what it is sent. The env has
only onnxruntime and numpy, so the worker's code is the self-contained :data:`WORKER_SOURCE`, and
messages are frames of a JSON header and raw array bytes over its stdin/stdout (no pickle).

* :class:`WorkerExecutor` is a :class:`~device_runtime.PlanExecutor` whose device part runs in a
  worker: the device reads, shuffles and batches its examples itself (the SDK's code), the worker
  only runs the steps, and the client update is formed here exactly as the executor forms it. A
  device's run is one request per step (the worker keeps the run's weights), so ``should_abort``
  is checked between steps as in process; a forced stop (``RunOptions.terminate``) reaches a step
  in flight through a control pipe, whose reader thread sets the worker's own terminate flag, and
  the interrupted run is dropped whole;
* :class:`ReleasePlans` hands an ``FLRuntime`` such executors for its ``runtime_version``, so an
  emulated device of version 1.17.3 trains on onnxruntime 1.17.3 (its ``FLRuntime``'s
  ``RuntimeEnvironment(loaded_plans=...)``);
* :class:`WorkerPool` keeps one worker per release, shared by the devices of that release;
* :func:`assign_releases` gives a fleet its version mix from the shares a config names.

Step timing and memory are measured inside the worker: the CPU time of each step of :meth:`RuntimeWorker.train`
(``time.thread_time``: the session runs on the calling thread alone, one intra-op thread as on
devices, so other processes on the machine do not change it, where its wall time under a load of 8
on two cores was 1-25 times as long), and the resident set over the worker's baseline after
importing onnxruntime, sampled after each step, less the batches of the other steps, which the
request holds all along and a device reads one at a time (with a real proxy set they were most of
the peak: 3 local epochs of 500 images of 3x224x224 are 860 MB).

A request that gets no answer within the worker's ``timeout`` (``$FEDFLEET_WORKER_TIMEOUT``
seconds, 300 by default: a graph that never ends, such as a ``Loop`` with a huge trip count) stops
the worker (the release tests' local epochs, one request of N steps, have N times as long), and a worker that died (killed, or crashed inside onnxruntime) is named with its signal;
either way :class:`WorkerError`, and the pool starts a new worker for the release's next use. A
worker that cannot start in its env because the env's files were damaged has the env made again.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import onnxruntime as ort

from device_runtime.executor import (
    DISABLED_OPTIMIZERS,
    DeviceResult,
    PlanExecutor,
    TrainingInterrupted,
    device_result,
)
from device_runtime.plan import Plan
from device_runtime.plan_cache import LoadedPlans

from .envs import RuntimeEnv, RuntimeEnvError, child_environ

__all__ = [
    "TIMEOUT_ENV_VAR",
    "ReleasePlans",
    "RuntimeWorker",
    "TrainResult",
    "WorkerError",
    "WorkerExecutor",
    "WorkerPool",
    "assign_releases",
]

#: How often a host waiting for a step polls its stop flag (a forced stop lands within this, plus
#: the time onnxruntime takes to reach its next node).
STOP_POLL_S = 0.005

#: Seconds a worker may take to answer one request (a step, a forward run, a proxy shard's local
#: epochs) before it is stopped: ``$FEDFLEET_WORKER_TIMEOUT``, else 300.
TIMEOUT_ENV_VAR = "FEDFLEET_WORKER_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0

# Runs in the release's env (only onnxruntime and numpy there). The frame helpers are also
# exec'd by the host, so both ends share one definition of the framing.
WORKER_SOURCE = r"""
import json, os, struct, sys, threading, time
import numpy as np

def write_frame(stream, header, arrays):
    index, blobs, offset = {}, [], 0
    for name, value in arrays.items():
        value = np.asarray(value, order="C")  # (ascontiguousarray makes scalars 1-D)
        data = value.tobytes()
        index[name] = [value.dtype.str, list(value.shape), offset, len(data)]
        blobs.append(data)
        offset += len(data)
    head = json.dumps({"header": header, "arrays": index}).encode()
    stream.write(struct.pack("<IQ", len(head), offset) + head + b"".join(blobs))
    stream.flush()

def read_frame(stream):
    prefix = stream.read(12)
    if len(prefix) < 12:
        return None, None
    head_len, body_len = struct.unpack("<IQ", prefix)
    meta = json.loads(stream.read(head_len))
    body = stream.read(body_len)
    arrays = {}
    for name, (dtype, shape, offset, length) in meta["arrays"].items():
        arrays[name] = np.frombuffer(body[offset:offset + length], dtype=np.dtype(dtype)).reshape(shape)
    return meta["header"], arrays

def rss_mb():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

class Interrupted(Exception):
    pass

def serve(control_fd):
    import onnxruntime as ort
    base = rss_mb()
    sessions, runs = {}, {}
    # Stops arrive on their own pipe, read by a thread, so a step in flight (onnxruntime releases
    # the GIL while it runs) ends at its next node through its RunOptions' terminate flag.
    guard, stopped, running = threading.Lock(), set(), {}
    def control():
        with os.fdopen(control_fd, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(64)
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    with guard:
                        stopped.add(line.decode())
                        if line.decode() in running:
                            running[line.decode()].terminate = True
    if control_fd >= 0:
        threading.Thread(target=control, daemon=True).start()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    def session(key, arrays):
        if key not in sessions:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.log_severity_level = 3
            sessions[key] = ort.InferenceSession(
                arrays["model"].tobytes(), opts, providers=["CPUExecutionProvider"], disabled_optimizers=DISABLED_OPTIMIZERS
            )
        return sessions[key]
    def step(run_id, feeds):
        run = runs[run_id]
        options = ort.RunOptions()
        with guard:
            if run_id in stopped:
                raise Interrupted("stopped before the step began")
            running[run_id] = options
        try:
            feeds.update(run["weights"])
            result = sessions[run["key"]].run(run["outs"] + run["metrics"], feeds, options)
        except Exception as exc:
            if options.terminate:
                raise Interrupted("stopped while the step was running") from exc
            raise
        finally:
            with guard:
                running.pop(run_id, None)
        if run["outs"]:  # an evaluation plan leaves the weights as they are
            run["weights"] = dict(zip(run["names"], result[:len(run["outs"])]))
        run["steps"] += 1
        return [float(v) for v in result[len(run["outs"]):]]
    def forget(run_id):
        runs.pop(run_id, None)
        with guard:
            stopped.discard(run_id)
    while True:
        request, arrays = read_frame(inp)
        if request is None:
            return
        run_id = request.get("run")
        try:
            op = request["op"]
            if op == "hello":
                write_frame(out, {"ok": True, "version": ort.__version__, "base_rss_mb": base}, {})
                continue
            if op == "status":
                write_frame(out, {"ok": True, "open_runs": {r: run["steps"] for r, run in runs.items()}, "sessions": len(sessions)}, {})
                continue
            if op in ("step", "finish", "discard"):
                if op == "discard":
                    forget(run_id)
                    write_frame(out, {"ok": True}, {})
                elif run_id not in runs:
                    write_frame(out, {"ok": False, "error": "no open run %r" % run_id}, {})
                elif op == "step":
                    started = time.perf_counter()
                    values = step(run_id, {k[5:]: v for k, v in arrays.items() if k.startswith("feed/")})
                    write_frame(out, {"ok": True, "metric_values": values, "step_s": time.perf_counter() - started}, {})
                else:
                    weights = runs[run_id]["weights"]
                    forget(run_id)
                    write_frame(out, {"ok": True}, {"w/" + k: v for k, v in weights.items()})
                continue
            sess = session(request["key"], arrays)
            if op == "load":
                write_frame(out, {"ok": True}, {})
            elif op == "run":
                feeds = {k[5:]: v for k, v in arrays.items() if k.startswith("feed/")}
                values = sess.run(request["outputs"], feeds)
                write_frame(out, {"ok": True}, dict(zip(request["outputs"], values)))
            elif op == "begin":
                runs[run_id] = {"key": request["key"], "names": request["weights"], "outs": request["weight_outputs"],
                                "metrics": request["metrics"], "steps": 0,
                                "weights": {k[2:]: v for k, v in arrays.items() if k.startswith("w/")}}
                write_frame(out, {"ok": True}, {})
            elif op == "train":
                weights = {k[2:]: v for k, v in arrays.items() if k.startswith("w/")}
                names, outs, metrics = request["weights"], request["weight_outputs"], request["metrics"]
                values, times, peak = [], [], rss_mb()
                # The request holds every step's batch; a device holds one at a time: the others are not its memory.
                batch_bytes = [sum(v.nbytes for k, v in arrays.items() if k.startswith("b%d/" % i)) for i in range(request["steps"])]
                held = (sum(batch_bytes) - max(batch_bytes, default=0)) / 2**20
                for step_number in range(request["steps"]):
                    feeds = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("b%d/" % step_number)}
                    feeds.update(weights)
                    started = time.thread_time()  # the step's CPU: its one thread's, whatever else runs
                    result = sess.run(outs + metrics, feeds)
                    times.append(time.thread_time() - started)
                    if outs:  # an evaluation plan leaves the weights as they are
                        weights = dict(zip(names, result[:len(outs)]))
                    values.append([float(v) for v in result[len(outs):]])
                    peak = max(peak, rss_mb())
                reply = {"ok": True, "metric_values": values, "step_s": times, "peak_mb": peak - base - held}
                write_frame(out, reply, {"w/" + k: v for k, v in weights.items()})
            else:
                write_frame(out, {"ok": False, "error": "unknown op %r" % op}, {})
        except Interrupted as exc:
            forget(run_id)  # an interrupted run keeps nothing: its weights are gone with it
            write_frame(out, {"ok": False, "interrupted": True, "error": str(exc)}, {})
        except Exception as exc:
            if run_id is not None:
                forget(run_id)
            write_frame(out, {"ok": False, "error": "%s: %s" % (type(exc).__name__, " ".join(str(exc).split())[:800])}, {})

if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else -1)
""".replace("DISABLED_OPTIMIZERS", repr(list(DISABLED_OPTIMIZERS)))  # the device's sessions' own

_FRAMING: dict[str, Any] = {"__name__": "fedfleet_worker_framing"}
exec(compile(WORKER_SOURCE, "<fedfleet worker>", "exec"), _FRAMING)  # noqa: S102 - our own constant
_write_frame: Callable[[IO[bytes], dict, Mapping[str, np.ndarray]], None] = _FRAMING["write_frame"]
_read_frame: Callable[[IO[bytes]], tuple[dict | None, dict | None]] = _FRAMING["read_frame"]


class WorkerError(RuntimeError):
    """The worker could not run what it was sent (the release refused the graph, say), or died."""


@dataclass(frozen=True)
class TrainResult:
    """What a worker's training loop measured: the final weights and, per step, the metric
    values (in the plan's ``metric_names`` order) and the CPU time (seconds); peak memory over its baseline."""

    weights: dict[str, np.ndarray]
    metric_values: list[list[float]]
    step_s: list[float]
    peak_memory_mb: float


def _key(model: bytes) -> str:
    return hashlib.sha256(model).hexdigest()


def _default_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise WorkerError(
            f"${TIMEOUT_ENV_VAR} is {raw!r}; give the seconds a release's worker may take to answer, such as 600"
        )
    return value


def _ending(returncode: int) -> str:
    """How a worker process ended, for a person: its signal by name."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if name == "SIGKILL":
        return "was killed (SIGKILL: out of memory, or another process killed it)"
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"):
        return f"crashed ({name}) inside onnxruntime or numpy"
    return f"was stopped by {name}"


class RuntimeWorker:
    """One worker process running onnxruntime ``version`` (``python`` is its env's interpreter).
    Calls are serialized; one worker may be shared by threads. A request not answered within
    ``timeout`` seconds (default ``$FEDFLEET_WORKER_TIMEOUT`` or 300) stops the worker; a
    :meth:`train` request of N steps has N times as long."""

    def __init__(self, version: str, python: str, *, timeout: float | None = None) -> None:
        self.version = version
        self.timeout = timeout if timeout is not None else _default_timeout()
        control_read, self._control = os.pipe()  # stops for a step in flight (see ``step``)
        # A file, not a pipe: nobody reads stderr while the worker runs, and a full pipe would stall it.
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [python, "-I", "-c", WORKER_SOURCE, str(control_read)],
                pass_fds=(control_read,),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=child_environ(),
            )
        except BaseException:
            os.close(self._control)
            self._stderr.close()
            raise
        finally:
            os.close(control_read)
        self._lock = threading.Lock()
        self._loaded: set[str] = set()
        self._runs = itertools.count(1)
        try:
            hello, _ = self._call({"op": "hello"}, {})
        except BaseException:
            self.close()
            raise
        self.reported_version: str = hello["version"]
        if version != "host" and self.reported_version != version:
            self.close()
            raise WorkerError(f"the worker for onnxruntime {version} imports onnxruntime {self.reported_version}")

    @classmethod
    def for_release(
        cls,
        version: str,
        *,
        timeout: float | None = None,
        cache: str | os.PathLike[str] | None = None,
        base_python: str | os.PathLike[str] | None = None,
        create: bool = True,
    ) -> RuntimeWorker:
        """A worker in the cached env of ``version`` (made first if missing, see ``RuntimeEnv``;
        made again if its files were damaged so that no worker starts there)."""
        env = RuntimeEnv.for_release(version, cache=cache, base_python=base_python, create=create)
        try:
            return cls(version, str(env.python), timeout=timeout)
        except WorkerError:
            problem = env.problem()
            if problem is None:  # the env is sound: the worker failed for a reason of its own
                raise
            if not create:
                raise RuntimeEnvError(
                    f"the env of onnxruntime {version} at {env.path} is damaged ({problem}); remove it "
                    f"(python -m emulator.releases.cache remove {version}) and run again"
                ) from None
        env = env.repaired(base_python=base_python)
        return cls(version, str(env.python), timeout=timeout)

    @classmethod
    def host(cls, *, timeout: float | None = None) -> RuntimeWorker:
        """A worker on this interpreter's onnxruntime: the reference the releases are compared with."""
        worker = cls("host", sys.executable, timeout=timeout)
        worker.version = worker.reported_version
        return worker

    @property
    def alive(self) -> bool:
        """False once the process has ended (killed, crashed, stopped after a timeout, closed)."""
        return self._proc.poll() is None

    def _call(
        self, header: dict, arrays: Mapping[str, np.ndarray], *, stop: Callable[[], bool] | None = None
    ) -> tuple[dict, dict]:
        """Send one request and read its reply. While waiting, ``stop()`` is polled every few
        milliseconds; once it is true the worker is told to end the run's step in flight. A reply
        that does not come within ``timeout`` stops the worker."""
        with self._lock:
            if self._proc.poll() is not None:
                raise WorkerError(
                    f"the onnxruntime {self.version} worker {_ending(self._proc.returncode)}; {self._stderr_tail()}"
                )
            try:
                assert self._proc.stdin is not None and self._proc.stdout is not None
                _write_frame(self._proc.stdin, header, arrays)
                self._await_reply(header, stop)
                reply, values = _read_frame(self._proc.stdout)
            except (BrokenPipeError, OSError, ValueError) as exc:
                if self._died():
                    reply, values = None, None
                else:
                    raise WorkerError(
                        f"the onnxruntime {self.version} worker failed: {exc}; {self._stderr_tail()}"
                    ) from None
            if reply is None:
                self._died()
                raise WorkerError(
                    f"the onnxruntime {self.version} worker {_ending(self._proc.returncode)} while it ran "
                    f"{header['op']!r}; {self._stderr_tail()}"
                )
            if reply.get("interrupted"):
                raise TrainingInterrupted(
                    f"training was stopped by force while a step was running on onnxruntime {self.version}"
                )
            if not reply.get("ok"):
                raise WorkerError(f"onnxruntime {self.version}: {reply.get('error')}")
            return reply, values or {}

    def _await_reply(self, header: dict, stop: Callable[[], bool] | None) -> None:
        """Wait until the reply can be read: one reply is outstanding and the last was read whole,
        so the buffer is empty and the pipe's readiness is the reply's."""
        assert self._proc.stdout is not None
        # a `train` request runs many steps (a release's local epochs): the limit holds for each of them
        steps = int(header.get("steps", 1)) if header["op"] == "train" else 1
        deadline = time.monotonic() + self.timeout * max(1, steps)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._proc.kill()
                self._proc.wait()
                raise WorkerError(
                    f"onnxruntime {self.version} did not answer {header['op']!r} within {self.timeout * max(1, steps):g} s"
                    f"{f' ({steps} steps)' if steps > 1 else ''} (a graph "
                    f"that does not end, such as a Loop with a huge trip count?); its worker was stopped "
                    f"(${TIMEOUT_ENV_VAR} sets the limit)"
                )
            polling = stop is not None and "run" in header
            if select.select([self._proc.stdout], [], [], min(left, STOP_POLL_S) if polling else left)[0]:
                return
            if polling and stop is not None and stop():
                os.write(self._control, f"{header['run']}\n".encode())
                stop = None  # said once; the reply (interrupted) follows

    def _died(self) -> bool:
        """Whether the process has ended, given a moment to (a broken pipe comes before its exit)."""
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _stderr_tail(self) -> str:
        if self._proc.poll() is None or self._stderr.closed:
            return "it is still running"
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - 600))
        tail = " ".join(self._stderr.read().decode(errors="replace").split())
        return f"stderr: {tail}" if tail else "nothing on stderr"

    def _model(self, model: bytes) -> tuple[str, dict[str, np.ndarray]]:
        key = _key(model)
        if key in self._loaded:
            return key, {}
        self._call({"op": "load", "key": key}, {"model": np.frombuffer(model, dtype=np.uint8)})
        self._loaded.add(key)
        return key, {}

    def load(self, model: bytes) -> None:
        """Create the session now (a graph the release refuses fails here, with its message)."""
        self._model(model)

    def run(self, model: bytes, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One forward run of ``model``: the named outputs."""
        key, _ = self._model(model)
        _, values = self._call(
            {"op": "run", "key": key, "outputs": list(outputs)}, {f"feed/{k}": np.asarray(v) for k, v in feeds.items()}
        )
        return {k: np.array(v) for k, v in values.items()}

    def train(
        self, plan: Plan, weights: Mapping[str, np.ndarray], batches: Sequence[Mapping[str, np.ndarray]]
    ) -> TrainResult:
        """Run the work graph's step over ``batches`` (feeds keyed by graph input names) in order,
        feeding each step's new weights to the next."""
        key, _ = self._model(plan.work)
        arrays = {f"w/{k}": np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        for step, batch in enumerate(batches):
            arrays.update({f"b{step}/{k}": np.asarray(v) for k, v in batch.items()})
        reply, values = self._call(
            {
                "op": "train",
                "key": key,
                "steps": len(batches),
                "weights": list(plan.weight_names),
                "weight_outputs": list(plan.weight_outputs),
                "metrics": list(plan.metric_names),
            },
            arrays,
        )
        final = {k[2:]: np.array(v) for k, v in values.items()}
        return TrainResult(final, reply["metric_values"], reply["step_s"], float(reply["peak_mb"]))

    def begin(self, plan: Plan, weights: Mapping[str, np.ndarray]) -> str:
        """Open a run of the work graph from ``weights``: the worker keeps its weights between
        :meth:`step` calls, so a device's steps send only their batches."""
        key, _ = self._model(plan.work)
        run = str(next(self._runs))
        self._call(
            {
                "op": "begin",
                "run": run,
                "key": key,
                "weights": list(plan.weight_names),
                "weight_outputs": list(plan.weight_outputs),
                "metrics": list(plan.metric_names),
            },
            {f"w/{k}": np.asarray(v, dtype=np.float32) for k, v in weights.items()},
        )
        return run

    def step(self, run: str, feeds: Mapping[str, np.ndarray], *, stop: Callable[[], bool] | None = None) -> list[float]:
        """One step of ``run`` on a batch: its metric values. When ``stop()`` becomes true while
        the step runs, onnxruntime ends it at its next node and :class:`TrainingInterrupted` is
        raised; the worker then drops the run (nothing of it is kept)."""
        reply, _ = self._call(
            {"op": "step", "run": run}, {f"feed/{k}": np.asarray(v) for k, v in feeds.items()}, stop=stop
        )
        return list(reply["metric_values"])

    def finish(self, run: str) -> dict[str, np.ndarray]:
        """Close ``run``: its final weights."""
        _, values = self._call({"op": "finish", "run": run}, {})
        return {k[2:]: np.array(v) for k, v in values.items()}

    def discard(self, run: str) -> None:
        """Close ``run`` and drop its weights (an interrupted or failed device session)."""
        self._call({"op": "discard", "run": run}, {})

    def open_runs(self) -> dict[str, int]:
        """The runs the worker holds weights for, with the steps each has taken."""
        reply, _ = self._call({"op": "status"}, {})
        return dict(reply["open_runs"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdout, self._stderr):
            if stream is not None:
                stream.close()
        if self._control >= 0:
            os.close(self._control)
            self._control = -1

    def __enter__(self) -> RuntimeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerExecutor(PlanExecutor):
    """A plan executor whose device part runs in a worker on another onnxruntime release. The
    server part and the deploy-time smoke test still run in this process."""

    def __init__(self, plan: Plan, worker: RuntimeWorker) -> None:
        super().__init__(plan)
        self.worker = worker

    def feeds(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of example tensors as the work graph's inputs (names and dtypes)."""
        return self._feeds(batch)[0]

    def run_device(
        self,
        weights: Mapping[str, np.ndarray],
        open_batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
        *,
        should_abort: Callable[[], bool] | None = None,
        run_options: ort.RunOptions | None = None,
    ) -> DeviceResult:
        """Same contract as :meth:`PlanExecutor.run_device`, step by step in the worker:
        ``should_abort`` is checked before every batch, and ``run_options.terminate`` set from
        another thread ends a step in flight in the worker (a forced stop), both as
        :class:`TrainingInterrupted`. An interrupted run leaves nothing behind in the worker."""
        plan = self.plan
        initial = self.check_weights(weights)
        forced = (lambda: bool(run_options.terminate)) if run_options is not None else None
        values: list[list[float]] = []
        total = 0
        begun = self.worker.begin(plan, initial)
        run: str | None = begun  # None once finished: nothing to drop in the worker
        try:
            for _epoch in range(plan.device.epochs):
                for batch in open_batches():
                    if should_abort is not None and should_abort():
                        raise TrainingInterrupted("training was interrupted: the device's conditions stopped holding")
                    if forced is not None and forced():
                        raise TrainingInterrupted("training was stopped by force before a step began")
                    feeds, n = self._feeds(batch)
                    if n:
                        values.append(self.worker.step(begun, feeds, stop=forced))
                        total += n
            final = self.worker.finish(begun)
            run = None
        finally:
            if run is not None:
                try:
                    self.worker.discard(run)
                except WorkerError:  # the worker died with the run: nothing of it is left anyway
                    pass
        sums = {m: sum(float(v[i]) for v in values) for i, m in enumerate(plan.metric_names)}
        return device_result(plan, initial, final, sums, total)


class WorkerPool:
    """One worker per release, started on first use and shared by every device of that release; a
    worker that has died (or was stopped after a timeout) is replaced at the release's next use.
    ``timeout`` and ``env_options`` (``cache``, ``base_python``, ``create``) go to each worker."""

    def __init__(self, *, timeout: float | None = None, **env_options: Any) -> None:
        self._timeout = timeout if timeout is not None else _default_timeout()
        self._env_options = env_options
        self._workers: dict[str, RuntimeWorker] = {}
        self._lock = threading.Lock()
        # A pool dropped without close() (a fleet shard that is simply discarded, say) still ends
        # its worker processes, when it is collected or at the latest when this interpreter exits.
        weakref.finalize(self, _close_workers, self._workers)

    def worker(self, version: str) -> RuntimeWorker:
        """The release's worker. Raises :class:`RuntimeEnvError` when its env cannot be made (the
        index unreachable, a full disk: nothing the release did) and :class:`WorkerError` when the
        worker does not start."""
        with self._lock:
            worker = self._workers.get(version)
            if worker is not None and not worker.alive:
                worker.close()
                worker = None
            if worker is None:
                worker = RuntimeWorker.for_release(version, timeout=self._timeout, **self._env_options)
                self._workers[version] = worker
            return worker

    def env_ready(self, version: str) -> bool:
        """Whether the release's worker can start without installing its env first."""
        if version in self._workers:
            return True
        try:
            RuntimeEnv.for_release(version, cache=self._env_options.get("cache"), create=False)
        except (RuntimeEnvError, ValueError):
            return False
        return True

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_workers(workers: dict[str, RuntimeWorker]) -> None:
    for worker in list(workers.values()):
        worker.close()
    workers.clear()


class ReleasePlans(LoadedPlans):
    """As ``RuntimeEnvironment(loaded_plans=ReleasePlans(pool))`` of ``FLRuntime(runtime_version="1.17.3")``:
    the device's plans are checked against its version (as on a phone) and trained on that real
    release."""

    def __init__(self, pool: WorkerPool) -> None:
        super().__init__()
        self.pool = pool
        self._executors: dict[tuple[str, str], WorkerExecutor] = {}

    def load(
        self, plan_id: str, data: bytes, runtime_version: str, *, max_nodes: tuple[int, str] | None = None
    ) -> tuple[Plan, PlanExecutor]:
        plan, _ = super().load(plan_id, data, runtime_version, max_nodes=max_nodes)
        key = (plan_id, runtime_version)
        if key not in self._executors:
            self._executors[key] = WorkerExecutor(plan, self.pool.worker(runtime_version))
        return plan, self._executors[key]

    def executors(self) -> dict[tuple[str, str], WorkerExecutor]:
        """The executors made so far, by (plan id, runtime version): which plan the devices of
        each release were served, and the worker (``executor.worker.version``) that trained it."""
        return dict(self._executors)


def assign_releases(count: int, shares: Mapping[str, float], rng: random.Random) -> list[str]:
    """``count`` devices' onnxruntime releases in the proportions ``shares`` names (largest
    remainders, then shuffled by ``rng``): ``{"1.17.3": 0.3, "1.31.1": 0.7}`` over 10 devices gives
    exactly 3 and 7."""
    if not shares or any(not (s >= 0) for s in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"release shares must be non-negative with a positive sum, got {dict(shares)}")
    total = sum(shares.values())
    exact = {v: count * s / total for v, s in shares.items()}
    counts = {v: int(e) for v, e in exact.items()}
    for v in sorted(exact, key=lambda v: (counts[v] - exact[v], v))[: count - sum(counts.values())]:
        counts[v] += 1
    releases = [v for v in sorted(counts) for _ in range(counts[v])]
    rng.shuffle(releases)
    return releases
