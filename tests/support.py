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
