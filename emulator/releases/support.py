"""Measure the highest ONNX opset and IR version each real onnxruntime release loads and runs.

``device_runtime/ort_support.json`` is the record the plan format reads (``max_opset_for_runtime``,
``max_ir_version_for_runtime``, ``min_runtime_for_opset``); this module writes it. Release notes and
the onnxruntime compatibility page lag behind the wheels and skip patch releases, so the record is
measured on the wheels themselves: each release in its own env (:mod:`emulator.releases.envs`) gets a
ladder of tiny models (``y = Identity(x) + x``) built and serialized here with the project's onnx
(the old envs have no onnx), and a rung counts only when the session is created *and* the run
returns ``2x``. Two ladders:

* IR versions 7.. at opset 13, which every supported release runs, so only the IR version varies;
* opsets 13.. at the release's measured max IR version, so only the opset varies.

Each ladder goes past what this onnx knows (it serializes any number); if a release still loads
the top rung the sweep was too short and the measurement fails rather than under-reporting.

Run ``python -m emulator.releases.support [--releases 1.17.3 1.20.1] [--jobs 2]``: one JSON line per
release on stdout, and the rows merged (one per minor) into the record.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import importlib.util
import json
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Protocol

from .envs import FIRST_MINOR, LAST_MINOR, RuntimeEnv, RuntimeEnvError, available_releases

__all__ = [
    "InstalledRuntime",
    "check",
    "default_record_path",
    "main",
    "measure",
    "merge_rows",
    "probe_model",
    "write_record",
]

BASE_OPSET = 13  # IR ladder's opset, and the opset ladder's first rung: every release 1.15+ runs it
BASE_IR = 7  # the IR version opset 13 was released with

# Runs inside the release's env (or this process): try each model, report None or the first line
# of the error. Only onnxruntime and numpy are there.
PROBE_CODE = """\
import base64
import numpy as np
import onnxruntime as ort

def _try(model_bytes):
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        x = np.array([1.0, -2.5, 3.0], dtype=np.float32)
        (y,) = session.run(None, {"x": x})
        if not np.array_equal(y, 2 * x):
            return "wrong result: %r" % (y,)
        return None
    except Exception as exc:  # any failure to load or run is a refusal
        text = str(exc).strip().splitlines()
        return (type(exc).__name__ + ": " + (text[0] if text else ""))[:400]

result = {
    "version": ort.__version__,
    "errors": [_try(base64.b64decode(m)) for m in payload["models"]],
}
"""


class Runner(Protocol):
    @property
    def version(self) -> str: ...

    def run_json(self, code: str, payload: Any = None) -> Any: ...


class InstalledRuntime:
    """The onnxruntime imported by this process, behind the same ``run_json`` as a RuntimeEnv."""

    def __init__(self) -> None:
        import onnxruntime

        self.version: str = onnxruntime.__version__

    def run_json(self, code: str, payload: Any = None) -> Any:
        namespace: dict[str, Any] = {"__name__": "__fedfleet_snippet__", "payload": json.loads(json.dumps(payload))}
        exec(compile(code, "<fedfleet snippet>", "exec"), namespace)
        return json.loads(json.dumps(namespace.get("result")))


def probe_model(opset: int, ir_version: int) -> bytes:
    """``y = Identity(x) + x`` over float32[3], stamped with ``opset`` and ``ir_version`` as given."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["x1"]), helper.make_node("Add", ["x1", "x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="fedfleet-probe")
    model.ir_version = ir_version  # explicit: make_model would stamp this onnx's newest
    return model.SerializeToString()


def _errors(env: Runner, models: Sequence[bytes]) -> tuple[str, list[str | None]]:
    reply = env.run_json(PROBE_CODE, {"models": [base64.b64encode(m).decode("ascii") for m in models]})
    return reply["version"], reply["errors"]


def check(env: Runner, *, opset: int, ir_version: int) -> str | None:
    """None if ``env``'s onnxruntime loads and runs the probe model, else why it refused."""
    return _errors(env, [probe_model(opset, ir_version)])[1][0]


def _highest(what: str, rungs: Sequence[int], errors: Sequence[str | None], version: str) -> int:
    accepted = [rung for rung, error in zip(rungs, errors) if error is None]
    if not accepted or accepted[0] != rungs[0]:
        raise RuntimeError(f"onnxruntime {version} refuses {what} {rungs[0]}, the ladder's base: {errors[0]}")
    if accepted[-1] == rungs[-1]:
        raise RuntimeError(f"onnxruntime {version} loads {what} {rungs[-1]}, the top of the ladder: extend it")
    top = accepted[-1]
    if accepted != list(range(rungs[0], top + 1)):  # a gap would make "max" meaningless
        raise RuntimeError(f"onnxruntime {version} accepts {what}s {accepted}: not a contiguous range")
    return top


def _ladder_tops() -> tuple[int, int]:
    import onnx

    return max(30, onnx.defs.onnx_opset_version() + 2), max(14, onnx.IR_VERSION + 2)


def measure(env: Runner) -> dict[str, Any]:
    """``{"version", "max_opset", "max_ir"}`` of the onnxruntime in ``env``, measured on probe models."""
    top_opset, top_ir = _ladder_tops()
    irs = list(range(BASE_IR, top_ir + 1))
    version, errors = _errors(env, [probe_model(BASE_OPSET, ir) for ir in irs])
    if version != env.version:
        raise RuntimeError(f"env for onnxruntime {env.version} runs onnxruntime {version}")
    max_ir = _highest("IR version", irs, errors, version)
    opsets = list(range(BASE_OPSET, top_opset + 1))
    _, errors = _errors(env, [probe_model(opset, max_ir) for opset in opsets])
    max_opset = _highest("opset", opsets, errors, version)
    return {"version": version, "max_opset": max_opset, "max_ir": max_ir}


def default_record_path() -> Path:
    """``device_runtime/ort_support.json`` next to the importable package (found without importing it,
    so a broken record can still be rewritten)."""
    spec = importlib.util.find_spec("device_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("device_runtime is not importable")
    return Path(next(iter(spec.submodule_search_locations))) / "ort_support.json"


def merge_rows(existing: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per minor, newest measurement winning, oldest minor first."""
    by_minor = {row["minor"]: row for row in existing}
    by_minor.update({row["minor"]: row for row in new})
    return [by_minor[minor] for minor in sorted(by_minor)]


def write_record(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """One row per line, so a re-measurement diffs line by line."""
    text = "[\n" + ",\n".join("  " + json.dumps(row) for row in rows) + "\n]\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _read_record(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []


def _measure_release(release: str, cache: str | None, today: dt.date) -> dict[str, Any]:
    measured = measure(RuntimeEnv.for_release(release, cache=cache))
    return {
        "release": release,
        "minor": int(release.split(".")[1]),
        "max_opset": measured["max_opset"],
        "max_ir": measured["max_ir"],
        "measured_on": today.isoformat(),
    }


def main(argv: Sequence[str] | None = None, *, today: dt.date | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.releases.support", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--releases", nargs="+", help=f"onnxruntime releases (default: latest patch of 1.{FIRST_MINOR}-1.{LAST_MINOR})"
    )
    parser.add_argument("--query-index", action="store_true", help="ask `pip index versions` for the releases")
    parser.add_argument("--output", type=Path, default=None, help="record to merge into (default: the package's)")
    parser.add_argument("--cache", default=None, help="env cache (default: $FEDFLEET_RUNTIME_CACHE or ~/.cache)")
    parser.add_argument("--jobs", type=int, default=1, help="releases installed and measured at once")
    args = parser.parse_args(argv)
    releases = args.releases or available_releases(query_index=args.query_index)
    output = args.output or default_record_path()
    today = today or dt.date.today()
    lock = threading.Lock()
    failed = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_measure_release, release, args.cache, today): release for release in releases}
        for future in as_completed(futures):
            try:
                row = future.result()
            except (RuntimeEnvError, RuntimeError) as exc:
                failed += 1
                out(json.dumps({"release": futures[future], "error": str(exc)}))
                continue
            with lock:  # written after each release, so an interrupted run keeps what it measured
                write_record(output, merge_rows(_read_record(output), [row]))
            out(json.dumps(row))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
