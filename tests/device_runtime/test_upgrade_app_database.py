"""An app's database written by an earlier release (``fixtures/app_database``: its examples, opstats,
resumption token and scheduled job, and its key store) opens with this release with nothing lost:
the examples read as they were added, the session's shape and the saved token are as recorded, the
token resumes after the examples it was read to, and the job is due when it was scheduled."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from device_runtime import OpStatsStore
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.scheduling import ParticipationScheduler
from example_store import ExampleSelector, FileKeyStore, SQLiteExampleStore

FIXTURES = Path(__file__).parent / "fixtures" / "app_database"
GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)


@pytest.mark.parametrize("release", ["f207517", "43f2aad"])
def test_an_app_database_of_an_earlier_release_opens_with_nothing_lost(tmp_path, release):
    db = tmp_path / "app.db"
    shutil.copy(FIXTURES / f"{release}.sqlite", db)
    options = {}
    if (FIXTURES / f"{release}.keystore.json").exists():
        keys = tmp_path / "keystore.json"
        shutil.copy(FIXTURES / f"{release}.keystore.json", keys)
        keys.chmod(0o600)  # (git keeps no permissions)
        options["key_store"] = FileKeyStore(keys)
    with SQLiteExampleStore(db, **options) as store:
        assert store.sealed == bool(options)
        read = list(store.query(ExampleSelector("app:/digits")))
        assert [int(e["y"]) for e in read] == [0, 1, 2, 3, 4]
        assert all(np.array_equal(e["x"], np.arange(4, dtype=np.float32) + i) for i, e in enumerate(read))
        opstats = OpStatsStore(db)
        try:
            assert [s.shape for s in opstats.sessions()] == ["-v[]+^"]
            token = opstats.resumption_token("digits", "train", "app:/digits")
            assert (token is None) == (release == "f207517")  # tokens came with sealing
            if token is not None:
                after = store.query(ExampleSelector("app:/digits", resume_after=token))
                assert [int(e["y"]) for e in after] == [2, 3, 4]
        finally:
            opstats.close()
        store.add("app:/digits", [{"x": np.zeros(4, np.float32), "y": np.int64(9)}])
        assert store.stats("app:/digits").count == 6
    scheduler = ParticipationScheduler(db, StaticConditions(GOOD), app="app")
    try:
        [job] = scheduler.jobs()
        assert (job.population, job.next_run_at) == ("digits", 1.8e9)
        assert job.constraints == TrainingConstraints(requires_charging=False)
        assert job.interval == TrainingInterval(recurrent=True, min_interval_s=3600.0)
    finally:
        scheduler.close()
