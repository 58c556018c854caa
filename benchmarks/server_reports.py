"""The FL server's memory for reports of a large model arriving together: its peak RSS while K
reports of an S-byte update are sent at once, spooled (this release) against held whole and bounded
in float64 copies of the whole update (the release before), in the same run.

Each case starts its own server process (``python -m server_stub``, one uvicorn worker, a fresh
database) with a task of an MLP whose update is about S bytes, checks in K + 2 devices, takes the
report of one, then sends K reports at once from K threads of this process and waits for the
answers. The server's peak
RSS is its kernel's high-water mark (``VmHWM``), reset once the devices are in
(``/proc/PID/clear_refs``) and read once the K reports are answered, so that the figure is the
reports' alone (the round's commit, a report later, is not in it); its RSS after the deploy and
check-ins and one report is the case's floor: the first report of a round makes its sum and
onnxruntime's buffers for adding to it (about 100 MB for an update of 16 MB, alike in both cases),
which the round holds whatever comes after. Every update declares more examples than
``max_examples_per_report`` and carries a large delta: each is capped and clipped, the case that
holds a bounded copy.

- ``spooled``: the server as it is: bodies over ``SPOOL_IN_MEMORY_BYTES`` go to files, reports
  wait for their turn without a worker thread, and each is bounded in place (``bound_report``);
- ``held_whole``: the same server with every body kept in memory as it arrives and bounded by
  ``device_runtime.influence.bound_update`` (float64 copies of the whole update), as the release
  before held and bounded them. Its bodies are read into one buffer each, not joined from their
  pieces as that release's were (twice a body at its end): the baseline is, if anything, low.

Both commit the same model, to the last bit (``models_equal``), once one more report comes. A
first line times the bounding of one update in this process, ``bound_update`` against
``bound_report``, with tracemalloc's peak.

    cd /work/main && .venv/bin/python -m benchmarks.server_reports [--quick]

Prints one JSON object per case; the last line is the summary, with the ratio of the spooled
server's peak above its floor to the held-whole server's (target: at most ``RATIO_GOAL``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import numpy as np

from benchmarks.server_load import wait_ready, write_admin_key
from device_runtime import PlanExecutor, build_mlp_plan, encode_checkpoint, initial_weights
from device_runtime.influence import bound_update
from example_store import ExampleSelector
from server_stub import AdminClient, RoundConfig, free_port

POPULATION = "big"
#: The held-whole server: bodies kept in memory and bounded in whole float64 copies.
HELD_WHOLE = (
    "import sys; from server_stub import reports; from server_stub.cli import main; "
    "from device_runtime.influence import bound_update; "
    "reports.SPOOL_IN_MEMORY_BYTES = 1 << 62; reports.bound_report = bound_update; sys.exit(main())"
)
SPOOLED = "import sys; from server_stub.cli import main; sys.exit(main())"
MAX_EXAMPLES = 1000
#: The spooled server's peak above its floor, at most this fraction of the held-whole server's.
RATIO_GOAL = 0.6


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _plan(update_mb: float):
    """An MLP of 1,024 features, one hidden layer and 10 classes whose weights are ``update_mb`` MB."""
    hidden = max(1, round(update_mb * 1e6 / 4 / (1024 + 1 + 10)))
    return build_mlp_plan(1024, (hidden,), 10, selector=ExampleSelector("app:/big"))


def _update(plan, rng: np.random.Generator) -> bytes:
    """A device's update, capped (2,000 examples) and clipped (a delta of norm about 100 a weight)."""
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    for name in plan.weight_names:
        update[name] = rng.standard_normal(update[name].shape, dtype=np.float32)
        update[name] *= 2 * MAX_EXAMPLES
    for name in ("num_examples", "count"):
        if name in update:
            update[name] = np.array(2 * MAX_EXAMPLES, dtype=update[name].dtype)
    return encode_checkpoint(update)


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def _case(name: str, code: str, plan, checkpoint: bytes, bodies: list[bytes]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        key, key_file = write_admin_key(Path(tmp))
        server = [sys.executable, "-c", code, "--db", str(Path(tmp) / "bench.db"), "--port", str(port)]
        server += ["--admin-key-file", str(key_file), "--log-level", "warning", "--allow-untested-plans"]
        proc = subprocess.Popen(server, stdout=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            config = RoundConfig(
                goal_count=len(bodies) + 2,  # one report before the K, one after them (it commits)
                over_selection=1.0,
                min_fraction=1.0,
                min_reports=1,
                selection_timeout_s=3600,
                report_timeout_s=3600,
                max_examples_per_report=MAX_EXAMPLES,
            )
            with AdminClient(url, admin_key=key, timeout_s=600) as admin:
                admin.create_population(POPULATION)
                admin.deploy_task(POPULATION, "train", plan, checkpoint, config)
                with httpx.Client(base_url=url, timeout=60) as http:
                    sessions = [
                        http.post(f"/v1/populations/{POPULATION}/checkin", json={"runtime_version": "1.31.1"}).json()
                        for _ in range(len(bodies) + 2)
                    ]
                if not all(s.get("status") == "accepted" for s in sessions):
                    raise RuntimeError(f"a device was not selected: {sessions}")
                statuses: list[int] = []
                _report(url, sessions[-2], bodies[0], statuses)  # the round's sum and onnxruntime's buffers made
                floor_kb = _rss_kb(proc.pid, "VmRSS")
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from here on
                started = time.perf_counter()
                threads = [  # the first K devices' reports at once
                    threading.Thread(target=_report, args=(url, s, body, statuses)) for s, body in zip(sessions, bodies)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                elapsed = time.perf_counter() - started
                peak_kb = _rss_kb(proc.pid, "VmHWM")
                _report(url, sessions[-1], bodies[0], statuses)  # commits the round
                if statuses != [200] * (len(bodies) + 2):
                    raise RuntimeError(f"reports answered {statuses}")
                model, number, _ = admin.model_bytes(POPULATION)
                if number != 1:
                    raise RuntimeError(f"the round did not commit (model of round {number})")
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "case": name,
        "reports": len(bodies),
        "update_mb": round(len(bodies[0]) / 1e6, 1),
        "floor_mb": round(floor_kb / 1024, 1),
        "peak_mb": round(peak_kb / 1024, 1),
        "peak_above_floor_mb": round((peak_kb - floor_kb) / 1024, 1),
        "above_floor_per_report_in_updates": round((peak_kb - floor_kb) * 1024 / len(bodies) / len(bodies[0]), 2),
        "reports_answered_s": round(elapsed, 2),
        "model_sha256": hashlib.sha256(model).hexdigest(),
    }


def _report(url: str, session: dict, body: bytes, statuses: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=600) as http:
        answer = http.post(
            f"/v1/sessions/{session['session_id']}/report",
            content=body,
            headers={"Authorization": f"Bearer {session['token']}"},
        )
    statuses.append(answer.status_code)


def _bounding(plan, body: bytes) -> dict:
    """One update bounded here by each function: seconds and tracemalloc's peak."""
    from device_runtime import decode_checkpoint
    from server_stub.reports import bound_report

    update = decode_checkpoint(body)
    out: dict = {"case": "bound_one_update", "update_mb": round(len(body) / 1e6, 1)}
    for name, bound in (("float64_copies", bound_update), ("in_place", bound_report)):
        tracemalloc.start()
        started = time.perf_counter()
        bounded = bound(update, plan.weight_names, max_examples=MAX_EXAMPLES, clip_norm=10.0)
        out[f"{name}_s"] = round(time.perf_counter() - started, 3)
        out[f"{name}_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 1e6, 1)
        tracemalloc.stop()
        assert bounded.capped and bounded.clipped
        del bounded
    out["ratio_s"] = round(out["in_place_s"] / out["float64_copies_s"], 3)
    out["ratio_peak"] = round(out["in_place_peak_mb"] / out["float64_copies_peak_mb"], 3)
    return out


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"takes a positive number, not {text!r}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4 reports of 16 MB instead of 5 of 64 MB")
    parser.add_argument("--reports", type=_positive(int), help="reports sent at once (default 5; 4 with --quick)")
    parser.add_argument("--update-mb", type=_positive(float), help="the update's size (default 64; 16 with --quick)")
    args = parser.parse_args()
    count = args.reports or (4 if args.quick else 5)
    size_mb = args.update_mb or (16.0 if args.quick else 64.0)
    plan = _plan(size_mb)
    checkpoint = encode_checkpoint(initial_weights(plan, seed=0))
    rng = np.random.default_rng(0)
    bodies = [_update(plan, rng) for _ in range(count)]
    _emit(_bounding(plan, bodies[0]))
    held = _case("held_whole", HELD_WHOLE, plan, checkpoint, bodies)
    _emit(held)
    spooled = _case("spooled", SPOOLED, plan, checkpoint, bodies)
    _emit(spooled)
    ratio = round(spooled["peak_above_floor_mb"] / max(held["peak_above_floor_mb"], 0.1), 3)
    _emit(
        {
            "benchmark": "server_reports",
            "summary": True,
            "reports": count,
            "update_mb": spooled["update_mb"],
            "peak_above_floor_mb": {
                "held_whole": held["peak_above_floor_mb"],
                "spooled": spooled["peak_above_floor_mb"],
            },
            "ratio_peak_above_floor_spooled_vs_held_whole": ratio,
            "models_equal": held["model_sha256"] == spooled["model_sha256"],
            "targets": {
                "peak_above_floor_vs_held_whole": {"value": ratio, "goal": RATIO_GOAL, "met": ratio <= RATIO_GOAL}
            },
        }
    )


if __name__ == "__main__":
    main()
