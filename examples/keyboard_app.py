"""A keyboard app that learns which key comes next from what its user types, the way Gboard takes
part in federated learning: each keystroke is logged as an example in the app's sealed store, and
the runtime trains only while the phone is idle, charging and on Wi-Fi.

Only names of the packages' roots are used, and ``./dev check`` type-checks this file with
``mypy --strict``: an app written against the SDK's signatures needs no ignores and no casts.
Version 2 of the app (``version=2``) keeps its features as float16 in a collection of its own: a
collection's tensors are fixed by its first example, so a changed type goes to a new collection,
and the examples of the old one are deleted at the upgrade (a plan's selector names one of them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from device_runtime import (
    DeviceConditions,
    FLRuntime,
    JobRun,
    OpStatsStore,
    ParticipationScheduler,
    Plan,
    SchedulerSettings,
    TrainingConstraints,
    TrainingInterval,
    build_softmax_regression_plan,
)
from example_store import ExampleSelector, FileKeyStore, SQLiteExampleStore

POPULATION = "keyboard"
#: Where each version keeps its keystrokes (version 2 stores its features as float16).
COLLECTIONS = {1: "app:/keystrokes", 2: "app:/keystrokes/v2"}
#: The features of a keystroke: the last keys typed, hashed into this many counts.
FEATURES = 16
#: The keys the model tells apart.
KEYS = 4


def context_features(context: str, dtype: type[np.floating] = np.float32) -> np.ndarray:
    """The last three characters typed, as counts of their hashes."""
    x = np.zeros(FEATURES, dtype=dtype)
    for ch in context[-3:]:
        x[ord(ch) % FEATURES] += 1
    return x


def keyboard_plan(version: int = 1) -> Plan:
    """The task author's plan for a version's collection (deployed with ``fedfleet`` or the admin API)."""
    return build_softmax_regression_plan(FEATURES, KEYS, selector=ExampleSelector(COLLECTIONS[version]))


class KeyboardApp:
    """Examples, opstats and scheduled jobs live in one database file of the app's."""

    def __init__(
        self,
        data_dir: Path,
        server_url: str,
        conditions: DeviceConditions,
        *,
        version: int = 1,
        settings: SchedulerSettings | None = None,
    ) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        db = data_dir / "app.db"
        self.version = version
        self.collection = COLLECTIONS[version]
        self.store = SQLiteExampleStore(db, key_store=FileKeyStore(data_dir / "keystore.json"))
        for older in (uri for v, uri in COLLECTIONS.items() if v < version):
            self.store.delete_collection(older)  # the upgrade: what an older version logged goes
        self.opstats = OpStatsStore(db)
        # the runtime serves this version's collection alone: a plan naming another reads nothing
        self.runtime = FLRuntime(
            POPULATION, server_url, {self.collection: self.store}, cache_dir=data_dir / "fl-cache", opstats=self.opstats
        )
        self.scheduler = ParticipationScheduler(
            db, conditions, app="keyboard", settings=settings or SchedulerSettings()
        )
        self.scheduler.register_runtime(POPULATION, self.runtime)  # at every start
        self.runs: list[JobRun] = []
        self.scheduler.queue.on_run = self.runs.append

    def on_key_typed(self, context: str, key: int) -> None:
        """What the keyboard does as its user types ``key`` after ``context``."""
        dtype = np.float16 if self.version >= 2 else np.float32
        self.store.add(self.collection, [{"x": context_features(context, dtype), "y": np.int64(key)}])

    def start(self, every_s: float = 4 * 3600) -> None:
        """Train at most every ``every_s`` seconds, when idle, charging and on an unmetered network."""
        self.scheduler.schedule(
            POPULATION,
            TrainingConstraints(requires_idle=True, requires_charging=True, requires_unmetered_network=True),
            TrainingInterval(recurrent=True, min_interval_s=every_s),
        )
        self.scheduler.queue.start()

    def close(self) -> None:
        self.scheduler.queue.stop()  # a session in progress is interrupted, the server told
        self.scheduler.close()
        self.runtime.close()
        self.opstats.close()
        self.store.close()
