"""The emulator's command line: ``fedfleet demo`` runs an emulated fleet against the embedded server."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from .demo import DemoConfig, run_demo


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a digit classifier with an emulated fleet over real HTTP")
    defaults = DemoConfig()
    p.add_argument("--devices", type=int, default=defaults.devices, help="number of emulated devices")
    p.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds to commit")
    p.add_argument("--goal", type=int, default=defaults.goal_count, dest="goal_count", help="devices that must report per round")
    p.add_argument("--dropout", type=float, default=defaults.dropout_prob, dest="dropout_prob", help="chance a session is interrupted")
    p.add_argument("--late", type=float, default=defaults.late_prob, dest="late_prob", help="chance a device reports after its deadline")
    p.add_argument("--secure", action="store_true", help="report through Secure Aggregation (the server sees only sums)")
    p.add_argument("--secagg-group", type=int, default=defaults.secagg_group_size, dest="secagg_group_size",
                   help="smallest Secure Aggregation group (k)")
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--time-limit", type=float, default=defaults.time_limit_s, dest="time_limit_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedfleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        names = {f.name for f in fields(DemoConfig)}
        config = DemoConfig(**{k: v for k, v in vars(args).items() if k in names})
        summary = run_demo(config)
        return 0 if summary["rounds_committed"] > 0 else 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
