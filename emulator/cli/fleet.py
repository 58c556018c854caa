"""``fedfleet simulate [FLEET.toml] --out DIR``: a fleet day in virtual time, its tables, plots
and report in DIR, and its summary as the last line of the output (one JSON object).

``--task TASK.py`` runs a task file (training and evaluation tasks, task groups, secure tasks) as
``fedfleet deploy`` would deploy it, ``--data FORMAT:PATH`` a federated dataset whose clients are the
devices' examples, and ``--target-accuracy A`` reports the simulated time to a model that good.

The progress bar (simulated hours, rounds committed, devices active; off a terminal, a line each
simulated hour) goes to stderr, so that
stdout holds only the summary and can be piped into ``jq``.

Past one process: ``--ray [ADDRESS]`` spreads the devices over ``--shards`` Ray actors (a local
cluster without ADDRESS); the run equals the single-process one, digest for digest.
``--seeds 0,1,2`` and ``--sweep KEY=V1,V2`` (repeatable; a key without a section is the task's,
e.g. ``goal_count=8,16``) run every combination as independent runs, as Ray tasks with
``--ray``: one summary line per run (with its parameters), then a line with all the digests."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from server_stub.cli import Terminated, sigterm_as_interrupt
from server_stub.errors import did_you_mean_path, install_hint

from ..fleet.config import FleetConfig, FleetConfigError, FleetSection
from ..fleet.events import SimulationError
from ..fleet.traces import TraceError

#: The size and length of a run without a fleet config, which --help names.
DEFAULT_FLEET = FleetSection()


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a fleet in virtual time (the paper-calibrated defaults without a file)",
        description=__doc__.replace("``", ""),  # the docstring is the page; --help prints it as plain text
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("fleet", nargs="?", help="a fleet config (TOML); see examples/fleets/default.toml")
    p.add_argument(
        "--out",
        help="where to write config.toml (the config the run ran: fedfleet simulate DIR/config.toml runs it again), "
        "sessions.csv, rounds.csv, timeline.csv, summary.json, the plots and report.html "
        "(without it, only the summary line is written)",
    )
    p.add_argument(
        "--devices", type=int, help=f"override the number of devices ({DEFAULT_FLEET.devices:,} without a fleet config)"
    )
    p.add_argument(
        "--hours", type=float, help=f"override the simulated hours ({DEFAULT_FLEET.hours:g} without a fleet config)"
    )
    p.add_argument("--seed", type=int, help="override the seed (the same seed gives the same run)")
    p.add_argument(
        "--goal",
        type=int,
        help="override the round goal (reports a round needs; the default 100 needs thousands of devices)",
    )
    p.add_argument(
        "--task",
        metavar="TASK.py",
        help="run this task file (what fedfleet plan build takes), or a bundle folder's task.py, instead of the built-in digits MLP",
    )
    p.add_argument(
        "--data",
        metavar="FORMAT:PATH[,K=V...]",
        help="a federated dataset, each client a device's examples: leaf:DIR, tff-h5:FILE, "
        "table:FILE,client=COLUMN, npz:FILE, digits,partition=dirichlet (default: the digits sampled per device)",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        metavar="A",
        help="report time_to_target_accuracy_s: simulated seconds to the first committed model with test accuracy >= A",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        default=None,
        help="run the built-in task under Secure Aggregation (task.secure; a task file says it itself)",
    )
    p.add_argument(
        "--dp",
        choices=("central", "distributed"),
        help="differential privacy for the training tasks: the server adds the noise (central) or the devices do, "
        "under Secure Aggregation (distributed, needs --secure, or a task file's secure_aggregation)",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float,
        metavar="Z",
        help="with --dp: the noise's std over the clip (dp.noise_multiplier, default 1; 0 is no noise, for audits)",
    )
    p.add_argument("--dp-clip", type=float, metavar="C", help="with --dp: each update's L2 clip (dp.clip, default 1)")
    p.add_argument(
        "--delta", type=float, metavar="D", help="with --dp: the delta epsilon is reported at (default 1e-5)"
    )
    p.add_argument(
        "--max-epsilon",
        type=float,
        metavar="E",
        help="with --dp: the task completes before a round would take epsilon past E (dp.max_epsilon)",
    )
    p.add_argument(
        "--dp-tree-rounds",
        type=int,
        metavar="N",
        help="with --dp central: DP-FTRL, the noise of each tree of N rounds from tree aggregation (dp.tree_rounds)",
    )
    p.add_argument(
        "--audit-canaries",
        type=int,
        metavar="K",
        help="with --dp: K canary devices for the one-shot privacy audit; the summary gets audit_epsilon",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--http",
        action="store_true",
        help="send the devices' requests over real loopback HTTP (uvicorn) instead of into the app in process "
        "(not bit-identical from one run to the next: its digest is not the in-process run's)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on Ray: a local cluster, or the one at ADDRESS (e.g. auto, ray://host:10001)",
    )
    p.add_argument(
        "--shards",
        type=int,
        help="spread the devices over this many shards (Ray actors with --ray; default 2 with --ray)",
    )
    p.add_argument("--seeds", help="independent runs with these seeds, e.g. 0,1,2")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="independent runs over a grid of config values, e.g. goal_count=8,16 (repeatable)",
    )


def run_simulate(args: argparse.Namespace) -> int:
    try:
        with sigterm_as_interrupt():
            return _run_simulate(args)
    except Terminated:  # while the run was set up, or between a sweep's runs
        print("\nfedfleet simulate: terminated (SIGTERM)", file=sys.stderr)
        return 143


def _run_simulate(args: argparse.Namespace) -> int:
    from ..fleet.federated_data import FederatedDataError, parse_data_spec
    from ..fleet.ray_backend import RayBackendError
    from ..fleet.simulator import ProgressBar, simulate
    from ..fleet.workload import load_workload
    from ..toolchain.bundle import MANIFEST, SOURCE, TASK_FILE, bundle_task_file
    from ..toolchain.tasks import TaskError
    from .plan import check_task_file, refuse_file_kind

    out = Path(args.out) if args.out else None
    # a bundle's own folders (what plan build, from-onnx and from-torch wrote) keep the run's files out
    if out is not None and (out / TASK_FILE).is_file() and ((out / SOURCE).is_file() or any(out.glob(f"*/{MANIFEST}"))):
        print(
            f"fedfleet simulate: --out {args.out} is a bundle folder (`fedfleet plan build` wrote it); give another "
            "folder for the run's tables and report",
            file=sys.stderr,
        )
        return 2
    if out is not None and (out / MANIFEST).is_file() and (out.parent / TASK_FILE).is_file():
        print(
            f"fedfleet simulate: --out {args.out} is one task's folder of the bundle {out.parent}; give another "
            "folder for the run's tables and report",
            file=sys.stderr,
        )
        return 2
    if out is not None and (refused := _own_config(out)) is not None:
        print(f"fedfleet simulate: --out {args.out} {refused}", file=sys.stderr)
        return 2
    if args.target_accuracy is not None and not 0.0 <= args.target_accuracy <= 1.0:
        print(
            f"fedfleet simulate: --target-accuracy {args.target_accuracy}: give an accuracy between 0 and 1",
            file=sys.stderr,
        )
        return 2
    if args.task is not None and (Path(args.task) / TASK_FILE).is_file():
        args.task = str(
            bundle_task_file(args.task)
        )  # a bundle (what plan test and deploy take): the task file they load
    if args.task is not None and not Path(args.task).is_file():
        print(
            f"fedfleet simulate: --task {args.task}: "
            f"{'a folder' if Path(args.task).is_dir() else 'no such file' + did_you_mean_path(args.task)}; "
            f"give the path of a task file (as `fedfleet plan build` takes) or a bundle folder holding {TASK_FILE}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.task is not None:
            check_task_file(args.task)
    except TaskError as exc:
        print(f"fedfleet simulate: --task {exc}", file=sys.stderr)
        return 2
    try:
        if args.fleet is not None:
            refuse_file_kind(args.fleet, "a fleet config", ".py", ".onnx", ".pt", ".pth")
    except TaskError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    try:
        config = FleetConfig.load(args.fleet) if args.fleet else FleetConfig.default()
        data = parse_data_spec(args.data) if args.data is not None else None
        config = config.replace(
            devices=args.devices,
            hours=args.hours,
            seed=args.seed,
            goal=args.goal,
            task_file=args.task,
            target_accuracy=args.target_accuracy,
            data=data,
            secure=args.secure,
            dp=_dp_overrides(args),
            named=OPTION_KEYS | {f"dp.{key}": f"--{flag.replace('_', '-')}" for flag, key in DP_FLAGS.items()},
        )
    except FederatedDataError as exc:
        print(f"fedfleet simulate: --data {args.data}: {exc}", file=sys.stderr)
        return 2
    except FleetConfigError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    loose = [f"--{flag.replace('_', '-')}" for flag in list(DP_FLAGS)[1:5] if getattr(args, flag) is not None]
    if loose and config.dp.mode is None:
        print(
            f"fedfleet simulate: {', '.join(loose)} set differential privacy up: add --dp central|distributed",
            file=sys.stderr,
        )
        return 2
    try:
        workload = load_workload(config)  # the task file built and the data read before anything runs
    except SimulationError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    for line in (workload.mapping_line(), workload.cast_line()):
        if line is not None:
            print(f"fedfleet simulate: {line}", file=sys.stderr)
    if out is not None and importlib.util.find_spec("matplotlib") is None:  # else a traceback after the whole run
        print(
            f"fedfleet simulate: --out {args.out} gets the run's plots, which need matplotlib: {install_hint('sim')}; "
            "or leave out --out for the summary line alone",
            file=sys.stderr,
        )
        return 2
    made_out = out is not None and not out.exists()
    if out is not None:
        if out.exists() and not out.is_dir():
            print(
                f"fedfleet simulate: --out {args.out} is a file; name a directory for the run's tables and report",
                file=sys.stderr,
            )
            return 2
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=out):  # a folder that exists may still refuse files (read-only)
                pass
        except OSError as exc:
            print(
                f"fedfleet simulate: cannot write the run to --out {args.out} ({exc.strerror or exc}); name a directory "
                "that can be created and written",
                file=sys.stderr,
            )
            return 2
    if args.shards is not None and args.shards < 1:
        print(f"fedfleet simulate: --shards {args.shards}: a run needs at least 1 shard", file=sys.stderr)
        return 2
    if args.shards is not None and args.shards > config.fleet.devices:  # empty shards, each costing every window
        print(
            f"fedfleet simulate: --shards {args.shards}: more shards than the fleet's {config.fleet.devices:,} "
            f"devices; use at most {config.fleet.devices:,} (a shard per core or Ray worker is what speeds a run up)",
            file=sys.stderr,
        )
        return 2
    if args.seeds is not None or args.sweep:  # --seeds "" is a mistake to say, not a single run
        return _run_sweep(args, config, out)
    sharded = args.ray is not None or args.shards is not None
    if sharded and args.http:
        print(
            "fedfleet simulate: --http runs the fleet in one process; leave out --ray/--shards (or --http)",
            file=sys.stderr,
        )
        return 2
    progress = None if args.no_progress else ProgressBar(config.horizon_s)

    def notice(message: str) -> None:
        print(f"fedfleet simulate: {message}", file=sys.stderr)

    try:
        try:
            if sharded:
                from ..fleet.ray_backend import simulate_sharded

                run = simulate_sharded(
                    config,
                    shards=args.shards or 2,
                    out_dir=out,
                    progress=progress or False,
                    ray=args.ray is not None,
                    address=args.ray or None,
                    notice=notice,
                )
            else:
                run = simulate(
                    config,
                    out_dir=out,
                    progress=progress or False,
                    http=args.http,
                    notice=notice,
                )
        finally:  # the bar drawn for the last time before a line below says how the run ended
            if progress is not None:
                progress.close()
    except (SimulationError, RayBackendError, TraceError) as exc:
        if out is not None:  # a refused run leaves nothing: its server's database is all it wrote
            _remove_failed_run(out, made_out)
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"\nfedfleet simulate: {how}, {_left_behind(out)}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    summary = run.summary()
    if out is not None and not (out / "summary.json").exists():
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    _say_unfilled(summary)
    print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


def _own_config(out: Path) -> str | None:
    """Why a run may not write its ``config.toml`` into ``out``: one there that no run wrote (a
    config file of the user's, which the run's would replace), else None."""
    from ..fleet.report import CONFIG_HEADER, CONFIG_TOML

    path = out / CONFIG_TOML
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            first = f.readline().decode("utf-8", "replace")
    except OSError:  # unreadable: not one a run wrote, which it could not replace either
        first = ""
    if first.startswith(CONFIG_HEADER):
        return None
    return (
        f"holds {CONFIG_TOML}, where the run records the config it ran, which would replace it; name another "
        "folder, or move the file"
    )


def _left_behind(out: Path | None) -> str:
    """What a run stopped by Ctrl-C or SIGTERM left in ``out``: the run ended, its tables and
    summary are written before its plots, which take longest to draw."""
    if out is not None and (out / "summary.json").exists():
        return (
            f"while its report was drawn: {out} holds the run's tables and summary.json (which fedfleet compare "
            "reads), not its plots or report.html"
        )
    if out is not None and (out / "rounds.csv").exists():
        return f"while its tables were written: {out} holds some of them and no summary.json"
    where = f"; {out} holds only the server's database of the rounds so far" if out is not None else ""
    return f"no tables or report written{where}"


def _say_unfilled(summary: dict, run: str = "") -> None:
    """On stderr, a run that committed no round or could not fill one, and why, and each cause its
    sessions failed by (``failure_notes``; ``run``: which run of a sweep, by its parameters)."""
    if summary.get("rounds") and not summary.get("rounds_committed"):
        print(f"fedfleet simulate: {run}no round committed: {summary.get('round_completion_note')}", file=sys.stderr)
    elif summary.get("cannot_fill"):
        print(f"fedfleet simulate: {run}{summary['cannot_fill']}", file=sys.stderr)
    for note in summary.get("failure_notes") or ():  # why sessions failed, each cause with its option
        print(f"fedfleet simulate: {run}{note}", file=sys.stderr)


def _remove_failed_run(out: Path, made_out: bool) -> None:
    """What a run that failed wrote in ``out``: the folder itself when the run made it, else the
    server's database of the run (in ``out/server``, which a run replaces when it starts)."""
    if made_out:
        shutil.rmtree(out, ignore_errors=True)
        return
    for leftover in (out / "server").glob("server.db*"):
        leftover.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (out / "server").rmdir()  # only when empty


#: ``fedfleet simulate``'s differential privacy flags and the ``[dp]`` keys they set.
#: The fleet config key each of simulate's options sets, as an error names it.
OPTION_KEYS = {
    "fleet.devices": "--devices",
    "fleet.hours": "--hours",
    "fleet.seed": "--seed",
    "task.goal_count": "--goal",
    "task.target_accuracy": "--target-accuracy",
}
DP_FLAGS = {
    "dp": "mode",
    "noise_multiplier": "noise_multiplier",
    "dp_clip": "clip",
    "delta": "delta",
    "max_epsilon": "max_epsilon",
    "dp_tree_rounds": "tree_rounds",
    "audit_canaries": "audit_canaries",
}


def _dp_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``[dp]`` keys the command line sets (the fleet config's hold for the others)."""
    return {key: getattr(args, flag) for flag, key in DP_FLAGS.items() if getattr(args, flag) is not None}


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="two or more simulated runs side by side in one HTML page",
        description="Two or more run folders (as fedfleet simulate --out writes them) side by side in one HTML page: "
        "a summary table with a column per run, accuracy and loss against simulated hours and against rounds, rounds "
        "committed over time, bytes per round and per-client accuracy percentiles (when measured).",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders written by fedfleet simulate --out (that of a --seeds/--sweep run: its runs)",
    )
    p.add_argument("--out", default="compare.html", help="the HTML page to write (a .html file)")
    p.add_argument(
        "--label",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the runs' names on the page, one per run in order: --label A B, or --label A --label B"
        " (default: the folders' names)",
    )


def run_compare(args: argparse.Namespace) -> int:
    from ..fleet.compare import FleetCompareError, write_compare
    from ..fleet.report import FleetReportError

    if Path(args.out).suffix.lower() not in (".html", ".htm"):  # c.png, or a run folder's name, got HTML unsaid
        print(
            f"fedfleet compare: --out {args.out}: the comparison is one HTML page; name a .html file", file=sys.stderr
        )
        return 2
    from ..fleet.report import REPORT_HTML

    target = Path(args.out).resolve()
    folders = [Path(run) for run in args.runs] + [p for run in args.runs for p in Path(run).glob("run-*")]
    mine = [folder for folder in folders if target == (folder / REPORT_HTML).resolve()]
    if mine:  # the page would replace the run's own report, which only a new run draws again
        print(
            f"fedfleet compare: --out {args.out} is the report of the run {mine[0]}; name another .html file "
            "(compare.html, say)",
            file=sys.stderr,
        )
        return 2
    try:
        runs = write_compare(args.runs, args.out, args.label or None)
    except (FleetCompareError, FleetReportError) as exc:
        print(f"fedfleet compare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"fedfleet compare: cannot write --out {args.out} ({exc.strerror or exc}); name a file in a folder that exists",
            file=sys.stderr,
        )
        return 2
    print(f"{args.out}: {len(runs)} runs ({', '.join(r.label for r in runs)})")
    return 0


def _run_folder(index: int, params: dict) -> str:
    """``run-1-seed=1,goal_count=8``: in order, and named by its parameters, the label ``fedfleet
    compare`` gives the run by default."""
    named = ",".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in params.items())
    return f"run-{index}-" + re.sub(r"[^A-Za-z0-9._=,+-]", "_", named)[:150]


def _run_sweep(args: argparse.Namespace, config: FleetConfig, out: Path | None) -> int:
    import time

    from ..fleet.ray_backend import RayBackendError, parse_sweep, run_many, sweep_configs

    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds is not None else None
        if seeds is not None and (min(seeds) < 0 or len(set(seeds)) < len(seeds)):
            raise ValueError("a seed below 0 or twice")
    except ValueError:
        print(
            f"fedfleet simulate: --seeds {args.seeds!r}: write whole numbers from 0 separated by commas, each "
            "once, e.g. 0,1,2",
            file=sys.stderr,
        )
        return 2
    try:
        runs = sweep_configs(config, seeds=seeds, grid=parse_sweep(args.sweep))
    except FleetConfigError as exc:
        print(f"fedfleet simulate: {exc}", file=sys.stderr)
        return 2
    if args.http or args.shards:
        print(
            "fedfleet simulate: --seeds/--sweep run whole fleets side by side; leave out --http and --shards",
            file=sys.stderr,
        )
        return 2
    dirs = (
        [out / _run_folder(i, params) for i, (params, _) in enumerate(runs)] if out is not None else [None] * len(runs)
    )
    stale = sorted(p.name for p in out.glob("run-*") if p.is_dir() and p not in dirs) if out is not None else []
    if stale:  # fedfleet compare OUT reads every run-* folder: an earlier sweep's would stand beside this one's
        print(
            f"fedfleet simulate: --out {args.out} holds runs this sweep does not make ({', '.join(stale[:3])}"
            f"{f' and {len(stale) - 3} more' if len(stale) > 3 else ''}), which fedfleet compare {args.out} would set "
            "beside its own; name a new folder, or remove them",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()

    def named(params: dict) -> str:
        return ", ".join(f"{key}={value}" for key, value in params.items()) + ": "

    def say(params: dict, summary: dict) -> None:
        _say_unfilled(summary, named(params))
        print(json.dumps({"params": params, **summary}, separators=(",", ":")), flush=True)

    summaries = []
    if args.ray is None:  # one run after another: each line as its run ends, a refused run named
        for (params, config_i), folder in zip(runs, dirs):
            made = folder is not None and not folder.exists()
            try:
                (summary,) = run_many([config_i], ray=False, out_dirs=[folder])
            except (SimulationError, TraceError) as exc:
                if folder is not None:
                    _remove_failed_run(folder, made)
                print(f"fedfleet simulate: {named(params)}{exc}", file=sys.stderr)
                return 2
            say(params, summary)
            summaries.append(summary)
    else:
        try:
            summaries = run_many([c for _, c in runs], ray=True, address=args.ray or None, out_dirs=dirs)
        except (SimulationError, RayBackendError, TraceError) as exc:
            print(f"fedfleet simulate: {exc}", file=sys.stderr)
            return 2
        for (params, _), summary in zip(runs, summaries):
            say(params, summary)
    last = {
        "runs": len(summaries),
        "params": [p for p, _ in runs],
        "digests": [s.get("digest") for s in summaries],
        "backend": "ray" if args.ray is not None else "local",
        "wall_s": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(last, separators=(",", ":")), flush=True)
    return 0


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw a simulated run's plots and report.html again from its tables",
        description="Draw the plots and report.html of a run folder (as fedfleet simulate --out writes it) again from "
        "its tables, summary.json and config.toml: a run stopped while its plots were drawn, or one an older release "
        "drew. The recorded summary is the page's; with --out only the page is written there (its plots inline).",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run folder written by fedfleet simulate --out")
    p.add_argument("--out", metavar="FILE", help="write the page here (a .html file) instead of RUN_DIR/report.html")


def run_report(args: argparse.Namespace) -> int:
    from ..fleet.report import FleetReportError, redraw_report

    if args.out is not None and Path(args.out).suffix.lower() not in (".html", ".htm"):
        print(f"fedfleet report: --out {args.out}: the report is one HTML page; name a .html file", file=sys.stderr)
        return 2
    if args.out is not None and Path(args.out).is_dir():
        print(f"fedfleet report: --out {args.out} is a folder; name a .html file", file=sys.stderr)
        return 2
    try:
        page = redraw_report(args.run, args.out)
    except FleetReportError as exc:
        print(f"fedfleet report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = args.out if args.out is not None else args.run
        print(
            f"fedfleet report: cannot write to {where} ({exc.strerror or exc}); name a place that can be written",
            file=sys.stderr,
        )
        return 2
    print(page)
    return 0
