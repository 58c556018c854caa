"""Helpers shared by tests: plans over the digits data and deploying them to a server."""

from __future__ import annotations

import numpy as np

from device_runtime import build_mlp_plan, build_softmax_regression_plan, encode_checkpoint, initial_weights
from example_store import ExampleSelector
from server_stub import AdminClient, RoundConfig

COLLECTION = "app:/digits"


def digits_plan(kind: str = "softmax", **kwargs):
    args = dict(
        learning_rate=0.2, batch_size=8, epochs=2, selector=ExampleSelector(COLLECTION), inputs={"x": "x", "y": "y"}
    )
    args.update(kwargs)
    if kind == "softmax":
        return build_softmax_regression_plan(64, 10, **args)
    return build_mlp_plan(64, (16,), 10, **args)


def deploy(admin: AdminClient, population: str = "digits", *, plan=None, **config) -> tuple:
    plan = plan or digits_plan()
    weights = initial_weights(plan, seed=0)
    admin.create_population(population)
    config.setdefault("min_reports", 1)  # these tests run rounds of a few devices knowingly
    admin.deploy_task(population, "train", plan, encode_checkpoint(weights), RoundConfig(**config))
    return plan, weights


def as_float32(d: dict) -> dict:
    return {k: np.asarray(v, dtype=np.float32) for k, v in d.items()}


def checkout_with_stand_in_python(tmp_path, *, checks_fail: bool = False) -> tuple:
    """A copy of the checkout's ``dev`` with a stand-in Python (``$PYTHON``) that logs each call
    to stderr and does nothing else, so a test sees what ``./dev`` says and installs, in order,
    without installing anything; with ``checks_fail`` its ``python -c`` (``./dev``'s import
    checks) fails, as where a tool is missing. Returns (the checkout, the environment to run in)."""
    import os
    import stat
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "dev").write_bytes((root / "dev").read_bytes())
    (work / "dev").chmod(0o755)
    (work / "pyproject.toml").write_text("[project]\nname = 'x'\n", encoding="utf-8")
    log = tmp_path / "calls.log"
    fake = tmp_path / "python3"
    fail = 'if [ "$1" = "-c" ]; then exit 1; fi\n' if checks_fail else ""
    fake.write_text(
        f"""#!/usr/bin/env bash
echo "python $*" >> {log}
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
{fail}echo "python $*" >&2
""",
        encoding="utf-8",
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return work, {**os.environ, "PYTHON": str(fake)}
