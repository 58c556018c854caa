"""The command line: ``fedfleet demo`` runs an emulated fleet against the embedded server,
``fedfleet server`` runs the FL server, ``fedfleet prune`` drops old rounds' models from a stopped
server's database, ``fedfleet authority`` makes an emulated attestation
authority, ``fedfleet simulate`` runs a fleet in virtual time, ``fedfleet compare`` sets runs side by
side, ``fedfleet report`` draws a run's report again, ``fedfleet plan`` and ``fedfleet deploy`` build,
test and ship FL plans, ``fedfleet status`` and ``fedfleet rounds`` show what a server runs, ``fedfleet
model`` writes a task's trained model out of a server or a simulated run."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import math
import os
import sys
from dataclasses import fields
from pathlib import Path

from server_stub import RoundConfig
from server_stub.cli import (
    add_prune_arguments,
    add_server_arguments,
    log_interrupts_once,
    read_negative_numbers,
    run_prune,
    run_server,
    show_defaults,
)

from ..demo import DemoConfig, DemoConfigError, run_demo
from ..devices.attestation_authority import AttestationAuthority
from .fleet import (
    add_compare_parser,
    add_report_parser,
    add_simulate_parser,
    run_compare,
    run_report,
    run_simulate,
)
from .plan import add_toolchain_commands, run_toolchain_command
from .usage import FleetParser

#: ``fedfleet --help``'s description: plain text (the module docstring's markup would print as it is).
DESCRIPTION = (
    "Federated learning on an emulated fleet: demo trains over real HTTP, server runs the FL server, "
    "prune drops old rounds' models from a stopped server's database, authority makes an emulated attestation authority, simulate runs a fleet in virtual time, compare "
    "sets runs side by side, report draws a run's report again, plan and deploy build, test and ship FL plans, status and rounds show what a "
    "server runs, stop stops a task on it, model writes a task's trained model out of a server or a simulated run."
)


def version() -> str:
    """The installed distribution's version (pyproject.toml's); "unknown" when run from a tree
    that was never installed."""
    try:
        return importlib.metadata.version("fedfleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; pip install -e . in the checkout)"


#: The demo's options by the DemoConfig field each sets: a refused field is said by its option.
DEMO_OPTIONS = {
    "devices": "--devices",
    "rounds": "--rounds",
    "goal_count": "--goal",
    "dropout_prob": "--dropout",
    "late_prob": "--late",
    "secagg_group_size": "--secagg-group",
    "epochs": "--epochs",
    "seed": "--seed",
    "time_limit_s": "--time-limit",
}


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a digit classifier with an emulated fleet over real HTTP")
    defaults = DemoConfig()
    p.add_argument("--devices", type=int, default=defaults.devices, help="number of emulated devices")
    p.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds to commit")
    p.add_argument(
        "--goal", type=int, default=defaults.goal_count, dest="goal_count", help="devices that must report per round"
    )
    p.add_argument(
        "--dropout",
        type=float,
        default=defaults.dropout_prob,
        dest="dropout_prob",
        help="chance a session is interrupted",
    )
    p.add_argument(
        "--late",
        type=float,
        default=defaults.late_prob,
        dest="late_prob",
        help="chance a device reports after its deadline",
    )
    p.add_argument(
        "--secure", action="store_true", help="report through Secure Aggregation (the server sees only sums)"
    )
    p.add_argument(
        "--secagg-group",
        type=int,
        default=defaults.secagg_group_size,
        dest="secagg_group_size",
        help="smallest Secure Aggregation group (k)",
    )
    p.add_argument(
        "--epochs", type=int, default=defaults.epochs, help="passes over its examples a device makes per round"
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="the same seed gives the same fleet")
    p.add_argument(
        "--time-limit",
        type=float,
        default=defaults.time_limit_s,
        dest="time_limit_s",
        help="seconds the demo may run before it stops, saying how many rounds it committed",
    )


def _save_authority(authority: AttestationAuthority, key: Path, trust: Path) -> None:
    """Write the key and its trust anchor as a pair: both go to new files beside their places
    first and are renamed into them only once both are written, so a failure leaves the old pair
    (or nothing), never a new anchor beside an old key."""
    key_new, trust_new = key.with_name(key.name + ".new"), trust.with_name(trust.name + ".new")
    try:
        authority.save(key_new)
        authority.save_trust_anchor(trust_new)
        os.replace(key_new, key)
        os.replace(trust_new, trust)
    except OSError as exc:  # named by the file the user gave, not by its stand-in
        named = {str(key_new): key, str(trust_new): trust}.get(str(exc.filename), exc.filename)
        raise OSError(exc.errno, exc.strerror, str(named)) from exc
    finally:
        for leftover in (key_new, trust_new):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _authority_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("authority", help="create an emulated attestation authority and its trust anchor")
    p.add_argument("--key", required=True, help="where to write the authority's private key (mode 0600)")
    p.add_argument(
        "--trust", required=True, help="where to write the trust anchor for fedfleet server --attestation-trust"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing key file (its devices' certificates stop being trusted)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = FleetParser(prog="fedfleet", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    add_server_arguments(sub.add_parser("server", help="run the FL server (HTTP, SQLite by default)"))
    add_prune_arguments(
        sub.add_parser(
            "prune",
            help="drop old rounds' models from a stopped server's SQLite file (their records and every task's "
            "latest model stay)",
        )
    )
    _authority_parser(sub)
    add_simulate_parser(sub)
    add_compare_parser(sub)
    add_report_parser(sub)
    add_toolchain_commands(sub)
    args = read_negative_numbers(show_defaults(parser)).parse_args(argv)
    log_interrupts_once()  # the commands that set no logging up write with Python's own handler
    try:
        return _run(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while a command loads, builds or waits: one line, not a traceback
        print(f"\nfedfleet {args.command}: interrupted", file=sys.stderr)
        return 130


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command in ("plan", "deploy", "status", "rounds", "stop", "model"):
        return run_toolchain_command(args)
    if args.command == "server":
        return run_server(args)
    if args.command == "prune":
        return run_prune(args)
    if args.command == "simulate":
        return run_simulate(args)
    if args.command == "compare":
        return run_compare(args)
    if args.command == "report":
        return run_report(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log_interrupts_once()
    if args.command == "authority":
        for given, path in (("--key", args.key), ("--trust", args.trust)):
            # not "already exists ... --force" for a key, and before a write: a folder would take
            # the first file's rename and refuse the second's
            if Path(path).is_dir():
                print(f"fedfleet authority: {given} {path} is a folder; name a file", file=sys.stderr)
                return 2
        if Path(args.key).exists() and not args.force:
            print(
                f"fedfleet authority: {args.key} already exists; a server trusting that authority would stop "
                "trusting its devices: name a new file, or pass --force to replace it",
                file=sys.stderr,
            )
            return 2
        if Path(args.key).resolve() == Path(args.trust).resolve():
            print(
                "fedfleet authority: --key and --trust name the same file; the trust anchor would replace the key: "
                "name two files",
                file=sys.stderr,
            )
            return 2
        try:
            _save_authority(AttestationAuthority.generate(), Path(args.key), Path(args.trust))
        except OSError as exc:
            print(
                f"fedfleet authority: cannot write {exc.filename or args.key} ({exc.strerror or exc}); "
                "name files in a folder that exists and can be written",
                file=sys.stderr,
            )
            return 2
        print(
            f"authority key: {args.key}\ntrust anchor:  {args.trust} (give it to `fedfleet server --attestation-trust`)"
        )
        return 0
    if args.command == "demo":
        names = {f.name for f in fields(DemoConfig)}
        try:
            config = DemoConfig(**{k: v for k, v in vars(args).items() if k in names})
            floor = RoundConfig().min_reports
            if math.ceil(config.goal_count * config.min_fraction - 1e-9) < floor:
                raise DemoConfigError(
                    f"--goal {config.goal_count} lets a round commit with fewer than {floor} devices, so a published "
                    f"model could give back a few devices' updates; use --goal {math.ceil(floor / config.min_fraction)} or more"
                )
            seats = min(config.devices, math.ceil(config.goal_count * config.over_selection - 1e-9))
            if config.secure and seats <= config.secagg_group_size:  # every round abandoned until --time-limit
                raise DemoConfigError(
                    f"--secagg-group {config.secagg_group_size}: a Secure Aggregation group holds more than that many "
                    f"devices, and a round of --goal {config.goal_count} seats {seats}, so no round could commit; use a "
                    f"smaller --secagg-group (default {DemoConfig().secagg_group_size}) or a larger --goal"
                )
            summary = run_demo(config)
        except DemoConfigError as exc:  # one line, as every command's: not the top-level parser's usage
            # a field's refusal said by the option the user typed (--goal, not goal_count)
            said = f"{DEMO_OPTIONS[exc.field]} {exc.says}" if exc.field in DEMO_OPTIONS else str(exc)
            print(f"fedfleet demo: {said}", file=sys.stderr)
            return 2
        if summary["rounds_committed"] < config.rounds:  # the time limit ended it, which the table does not say
            print(
                f"fedfleet demo: stopped at --time-limit {config.time_limit_s:g} s with {summary['rounds_committed']} "
                f"of {config.rounds} rounds committed; give a longer --time-limit, or fewer --rounds",
                file=sys.stderr,
            )
        return 0 if summary["rounds_committed"] > 0 else 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
