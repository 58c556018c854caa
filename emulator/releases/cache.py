"""``python -m emulator.releases.cache list|remove``: the cached onnxruntime envs, and deleting them.

Each release the release tests run on has its own env (:mod:`emulator.releases.envs`), 150-250 MB
each (3.5 GB for all 18 known releases), kept under ``$FEDFLEET_RUNTIME_CACHE`` or
``~/.cache/fedfleet/runtimes`` until removed::

    python -m emulator.releases.cache list              # release, size, Python, state; the total
    python -m emulator.releases.cache remove 1.17.3     # or --all; the next test that needs it installs it again

A command of its own (not imported by the package), as ``support`` and ``kernel_probe`` are.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .envs import CACHE_ENV_VAR, RuntimeEnvError, cache_root, cached_envs, remove_envs

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    """List or remove the envs; 2 with one line on stderr for a release string that is not one."""
    parser = argparse.ArgumentParser(prog="python -m emulator.releases.cache", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", default=None, help=f"the env cache (default: ${CACHE_ENV_VAR} or ~/.cache/fedfleet/runtimes)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="each env: release, size on disk, the Python that made it, state; the total")
    remove = sub.add_parser("remove", help="delete envs (a release test that needs one installs it again)")
    remove.add_argument("releases", nargs="*", help="onnxruntime releases such as 1.17.3")
    remove.add_argument("--all", action="store_true", help="every env in the cache")
    args = parser.parse_args(argv)
    root = Path(args.cache).expanduser() if args.cache is not None else cache_root()
    if args.command == "list":
        envs = cached_envs(root)
        for e in envs:
            state = "ready" if e["valid"] else "incomplete (made again on next use)"
            out(f"{e['release']:>8}  {e['bytes'] / 2**20:6.0f} MB  Python {e['python'] or '?':<8}  {state}")
        out(f"{len(envs)} envs, {sum(e['bytes'] for e in envs) / 2**20:.0f} MB in {root}")
        return 0
    if bool(args.releases) == bool(args.all):
        print("python -m emulator.releases.cache remove: name releases (1.17.3 ...) or --all", file=sys.stderr)
        return 2
    try:
        removed = remove_envs(None if args.all else args.releases, cache=root)
    except (ValueError, RuntimeEnvError) as exc:
        print(f"python -m emulator.releases.cache remove: {exc}", file=sys.stderr)
        return 2
    out(f"removed {len(removed)} envs from {root}" + (f": {', '.join(removed)}" if removed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
