"""A million devices for a simulated day: the cost curve of ``emulator.fleet.simulate`` over the
fleet's size (10,000, 100,000 and 1,000,000 devices of the paper-calibrated default population,
a day each), in wall time and peak resident memory.

Goals for the 1,000,000-device day on the 2-core, 24 GiB machine: <= 30 minutes of wall time and
<= 16 GiB peak memory. Each size runs in a process of its own, so its peak resident memory is its
own (``ru_maxrss`` of that child); the memory per device is that peak over the fleet's size.
``--quick``: 100,000 devices for 2 simulated hours (no goal is judged on it).

Prints one JSON object per line; the last is the summary with the targets.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

WALL_GOAL_S = 1800.0
MEMORY_GOAL_MB = 16 * 1024.0
GOAL_DEVICES = 1_000_000
SIZES = (10_000, 100_000, 1_000_000)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def run_case(devices: int, hours: float, seed: int) -> dict:
    """One run in this process: wall and CPU time, peak resident memory, what the run did."""
    from emulator.fleet import FleetConfig, simulate

    config = FleetConfig.default().replace(devices=devices, hours=hours, seed=seed)
    started, cpu0 = time.perf_counter(), time.process_time()
    run = simulate(config, progress=False)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    s = run.summary()
    return {
        "case": "fleet",
        "devices": devices,
        "hours": hours,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "loop_wall_s": round(run.wall_s, 2),
        "peak_rss_mb": round(peak_mb, 1),
        "kb_per_device": round(1024.0 * peak_mb / devices, 2),
        "sessions": s["sessions"],
        "sessions_completed": s["sessions_completed"],
        "rounds_committed": s["rounds_committed"],
        "digest": s["digest"],
    }


def _child(devices: int, hours: float, seed: int) -> dict:
    """``run_case`` in a process of its own (its peak memory is then the run's alone)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.fleet_million",
            "--case",
            str(devices),
            "--hours",
            str(hours),
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return {
            "case": "fleet",
            "devices": devices,
            "hours": hours,
            "error": out.stderr.strip().splitlines()[-1:] or ["failed"],
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 devices for 2 simulated hours")
    parser.add_argument(
        "--sizes", type=int, nargs="+", help=f"fleet sizes to run (default {', '.join(map(str, SIZES))})"
    )
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one size in this process (what the driver spawns)
    args = parser.parse_args(argv)
    if args.case is not None:
        _emit(run_case(args.case, args.hours, args.seed))
        return
    sizes, hours = ([100_000], 2.0) if args.quick else (args.sizes or list(SIZES), args.hours)
    rows = []
    for devices in sizes:
        row = _child(devices, hours, args.seed)
        _emit(row)
        rows.append(row)
    goal = next((r for r in rows if r["devices"] == GOAL_DEVICES and r.get("hours") == 24.0 and "error" not in r), None)
    _emit(
        {
            "case": "summary",
            "curve": [
                {k: r.get(k) for k in ("devices", "hours", "wall_s", "peak_rss_mb", "kb_per_device")} for r in rows
            ],
            "targets": {
                "wall_s": {
                    "goal": WALL_GOAL_S,
                    "value": goal["wall_s"] if goal else None,
                    "met": goal is not None and goal["wall_s"] <= WALL_GOAL_S,
                },
                "peak_rss_mb": {
                    "goal": MEMORY_GOAL_MB,
                    "value": goal["peak_rss_mb"] if goal else None,
                    "met": goal is not None and goal["peak_rss_mb"] <= MEMORY_GOAL_MB,
                },
            },
            "judged": goal is not None,  # only a 1,000,000-device day is judged against the goals
        }
    )


if __name__ == "__main__":
    main()
