"""The keyboard sample app against a real server: it logs keystrokes while its user types, trains
once the phone is idle, and its version 2 (a feature's type changed, a collection of its own)
starts again over the same database."""

from __future__ import annotations

import time

import numpy as np
import pytest

from device_runtime import DeviceState, Outcome, RunOutcome, SchedulerSettings, encode_checkpoint, initial_weights
from example_store import SchemaMismatchError
from examples.keyboard_app import COLLECTIONS, KEYS, POPULATION, KeyboardApp, context_features, keyboard_plan
from server_stub import RoundConfig

TYPING = DeviceState(idle=False, charging=True, battery_level=0.8, unmetered_network=True)
#: a scheduler that looks again at once, so that the test does not wait out a real app's minutes
QUICK = SchedulerSettings(recheck_s=0.05, settle_s=0.0, poll_s=0.05)


class Phone:
    """The app's conditions: busy while the user types, idle once they stop."""

    def __init__(self) -> None:
        self.state = TYPING

    def current(self) -> DeviceState:
        return self.state


def _type(app: KeyboardApp, count: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        app.on_key_typed("the quick brown fox"[: 1 + i % 19], int(rng.integers(KEYS)))


def _until_a_session(app: KeyboardApp) -> None:
    deadline = time.monotonic() + 20
    while not any(run.session for run in app.runs) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_keyboard_trains_only_once_idle_and_its_upgrade_keeps_a_changed_feature_apart(tmp_path, server, admin):
    admin.create_population(POPULATION)
    phone = Phone()
    for version in (1, 2):
        plan = keyboard_plan(version)
        weights = encode_checkpoint(initial_weights(plan))
        admin.deploy_task(POPULATION, f"next-key-v{version}", plan, weights, RoundConfig(goal_count=1, min_reports=1))
        app = KeyboardApp(tmp_path / "app", server.url, phone, version=version, settings=QUICK)
        _type(app, 10 * (4 - version))
        if version == 1:
            with pytest.raises(SchemaMismatchError, match=r"x: float32\[16\]"):  # a collection's tensors are fixed
                app.store.add(COLLECTIONS[1], [{"x": context_features("ab", np.float16), "y": np.int64(0)}])
        app.start(every_s=3600)
        time.sleep(0.15)  # the job looks while the user types: it does not check in
        assert app.runs and {run.outcome for run in app.runs} == {RunOutcome.CONSTRAINTS_UNMET}
        phone.state = DeviceState(idle=True, charging=True, battery_level=0.8, unmetered_network=True)
        _until_a_session(app)
        app.close()
        phone.state = TYPING
        admin.stop_task(POPULATION, f"next-key-v{version}")
        (session,) = [run.session for run in app.runs if run.session is not None]
        assert (session.outcome, session.task) == (Outcome.COMPLETED, f"next-key-v{version}")
        assert session.num_examples == 10 * (4 - version)
    reopened = KeyboardApp(tmp_path / "app", server.url, phone, version=2)
    assert reopened.store.collections() == [COLLECTIONS[2]]  # version 1's keystrokes went with the upgrade
    assert reopened.store.schema(COLLECTIONS[2])["x"] == (np.dtype(np.float16), (16,))
    assert reopened.opstats.shape_counts(POPULATION) == {"-v[]+^": 2}
    reopened.close()
