"""``fedfleet simulate [FLEET.toml] --out DIR``: a fleet day in virtual time, its tables, plots
and report in DIR, and its summary as the last line of the output (one JSON object).

The progress bar (simulated hours, rounds committed, devices active) goes to stderr, so that
stdout holds only the summary and can be piped into ``jq``.

Past one process: ``--ray [ADDRESS]`` spreads the devices over ``--shards`` Ray actors (a local
cluster without ADDRESS); the run equals the single-process one, digest for digest.
``--seeds 0,1,2`` and ``--sweep KEY=V1,V2`` (repeatable; a key without a section is the task's,
e.g. ``goal_count=8,16``) run every combination as independent runs, as Ray tasks with
``--ray``: one summary line per run (with its parameters), then a line with all the digests."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import FleetConfig, FleetConfigError
from .events import SimulationError
from .traces import TraceError


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a fleet in virtual time (the paper-calibrated defaults without a file)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("fleet", nargs="?", help="a fleet config (TOML); see examples/fleets/default.toml")
    p.add_argument("--out", help="where to write sessions.csv, rounds.csv, timeline.csv, summary.json, the plots and report.html")
    p.add_argument("--devices", type=int, help="override the number of devices")
    p.add_argument("--hours", type=float, help="override the simulated hours")
    p.add_argument("--seed", type=int, help="override the seed (the same seed gives the same run)")
    p.add_argument("--goal", type=int, help="override the round goal (reports a round needs; the default 100 needs thousands of devices)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--http", action="store_true",
                   help="send the devices' requests over real loopback HTTP (uvicorn) instead of into the app in process")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run on Ray: a local cluster, or the one at ADDRESS (e.g. auto, ray://host:10001)")
    p.add_argument("--shards", type=int,
                   help="spread the devices over this many shards (Ray actors with --ray; default 2 with --ray)")
    p.add_argument("--seeds", help="independent runs with these seeds, e.g. 0,1,2")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="independent runs over a grid of config values, e.g. goal_count=8,16 (repeatable)")


def run_simulate(args: argparse.Namespace) -> int:
    from .ray_backend import RayBackendError
    from .simulator import ProgressBar, simulate

    try:
        config = FleetConfig.load(args.fleet) if args.fleet else FleetConfig.default()
        config = config.replace(devices=args.devices, hours=args.hours, seed=args.seed, goal=args.goal)
    except FleetConfigError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.exists() and not out.is_dir():
            print(f"fedfleet simulate: --out {args.out} is a file; name a directory for the run's tables and report", file=sys.stderr)
            return 2
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"fedfleet simulate: cannot write the run to --out {args.out} ({exc.strerror or exc}); name a directory "
                  "that can be created", file=sys.stderr)
            return 2
    if args.shards is not None and args.shards < 1:
        print(f"fedfleet simulate: --shards {args.shards}: a run needs at least 1 shard", file=sys.stderr)
        return 2
    if args.seeds or args.sweep:
        return _run_sweep(args, config, out)
    sharded = args.ray is not None or args.shards is not None
    if sharded and args.http:
        print("fedfleet simulate: --http runs the fleet in one process; leave out --ray/--shards (or --http)", file=sys.stderr)
        return 2
    progress = None if args.no_progress else ProgressBar(config.horizon_s)
    try:
        if sharded:
            from .ray_backend import simulate_sharded

            run = simulate_sharded(config, shards=args.shards or 2, out_dir=out, progress=progress or False,
                                   ray=args.ray is not None, address=args.ray or None)
        else:
            run = simulate(config, out_dir=out, progress=progress or False, http=args.http)
    except (SimulationError, RayBackendError, TraceError) as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = f"; {out} holds only the server's database of the rounds so far" if out is not None else ""
        print(f"\nfedfleet simulate: interrupted, no tables or report written{where}", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()
    summary = run.summary()
    if out is not None and not (out / "summary.json").exists():
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    if summary.get("rounds") and not summary.get("rounds_committed"):
        print(f"fedfleet simulate: no round committed: {_why_no_round(summary, config)}", file=sys.stderr)
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


def _per_example(summary: dict, config: FleetConfig) -> str:
    cost = (summary.get("plan_cost") or {}).get("compute_s_per_example", config.task.compute_s_per_example)
    return "?" if cost is None else f"{cost:.4g}"


def _why_no_round(summary: dict, config: FleetConfig) -> str:
    """Why a run committed no round, from its figures: too few devices available at once (or
    able to hold the plan), or sessions that trained but reported after their round's window closed."""
    goal, peak = config.task.goal_count, summary.get("available_peak") or 0
    if peak < goal:
        short = summary.get("devices_short_of_memory") or 0
        memory = (f" ({short} devices took no part: their memory cannot hold the plan's "
                  f"{(summary.get('plan_cost') or {}).get('memory_mb', 0):.4g} MB)") if short else ""
        return (f"each needs {goal} reports and at most {peak:.0f} of {config.fleet.devices} devices were "
                f"available at once{memory}; simulate more --devices or a smaller --goal")
    trained = sum(n for shape, n in summary.get("shapes", {}).items() if shape.startswith("-v[]+"))
    late = sum(n for shape, n in summary.get("shapes", {}).items() if shape.endswith("#"))
    if trained and late >= trained / 2:
        return (f"{late} of the {trained} sessions that trained reported after their round's window closed "
                f"(task.report_timeout_s = {config.task.report_timeout_s:g} s from check-in); lengthen it, or "
                f"make sessions shorter: the plan costs {_per_example(summary, config)} simulated s per example and epoch on "
                "the reference phone (raise task.reference_flops_per_s or set task.compute_s_per_example)")
    return (f"each needs {goal} reports; {summary.get('sessions_accepted', 0)} sessions were accepted and "
            f"{summary.get('sessions_completed', 0)} reported in time; see rounds.csv and sessions.csv")


def _run_sweep(args: argparse.Namespace, config: FleetConfig, out: Path | None) -> int:
    import time

    from .ray_backend import RayBackendError, parse_sweep, run_many, sweep_configs

    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        print(f"fedfleet simulate: --seeds {args.seeds!r}: write whole numbers separated by commas, e.g. 0,1,2", file=sys.stderr)
        return 2
    try:
        runs = sweep_configs(config, seeds=seeds, grid=parse_sweep(args.sweep))
    except FleetConfigError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    if args.http or args.shards:
        print("fedfleet simulate: --seeds/--sweep run whole fleets side by side; leave out --http and --shards", file=sys.stderr)
        return 2
    dirs = [out / f"run-{i}" for i in range(len(runs))] if out is not None else None
    started = time.perf_counter()
    try:
        summaries = run_many([c for _, c in runs], ray=args.ray is not None, address=args.ray or None, out_dirs=dirs)
    except (SimulationError, RayBackendError, TraceError) as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    for (params, _), summary in zip(runs, summaries):
        print(json.dumps({"params": params, **summary}, separators=(",", ":")), flush=True)
    last = {
        "runs": len(summaries),
        "params": [p for p, _ in runs],
        "digests": [s.get("digest") for s in summaries],
        "backend": "ray" if args.ray is not None else "local",
        "wall_s": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(last, separators=(",", ":")), flush=True)
    return 0
