"""A plan an earlier release wrote (``fixtures/plans``, made by ``make_plan.py`` with that release's
checkout) loads and takes the same step as the plan this release builds of the same model: a task
deployed before an upgrade goes on serving the bytes it was deployed with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_runtime import PlanExecutor, decode_checkpoint, load_plan
from device_runtime.plan import serialize_plan
from device_runtime.plan_builder import build_mlp_plan
from example_store import ExampleSelector

FIXTURES = Path(__file__).parent / "fixtures" / "plans"


@pytest.mark.parametrize("release", ["f207517"])
def test_a_plan_an_earlier_release_wrote_loads_and_takes_this_releases_step(release):
    """f207517's plans lack ``server.clip_range`` (added the same day): loading them said "the plan
    was not written by serialize_plan", and every device refused the task's plan."""
    old = load_plan((FIXTURES / f"{release}.plan").read_bytes())
    weights = decode_checkpoint((FIXTURES / f"{release}.checkpoint").read_bytes())
    new = build_mlp_plan(4, [3], 2, selector=ExampleSelector("app:/digits"), batch_size=2, name="old_mlp")
    assert old.weight_names == new.weight_names and old.server.clip_range is None
    assert load_plan(serialize_plan(old)).server.clip_range is None  # written again, with the field
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(2, 4)).astype(np.float32), "y": np.array([0, 1])} for _ in range(3)]
    steps = [PlanExecutor(plan).run_device(weights, lambda: iter(batches)) for plan in (old, new)]
    assert steps[0].num_examples == steps[1].num_examples == 6
    for name in new.weight_names:
        np.testing.assert_array_equal(steps[0].update[name], steps[1].update[name])
    assert steps[0].update["w0"].any()  # it trained
