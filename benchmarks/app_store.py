"""A long-running app's database: CPU per session with deleted rows overwritten, against the same
app with ``PRAGMA secure_delete=OFF``, taking turns in one process.

Each app is one ``app.db`` holding a ``SQLiteExampleStore`` with retention (``max_bytes`` of about
2,000 examples, a TTL of a day) and an ``OpStatsStore`` at its cap of 1,000 sessions, as a device
reaches them after some weeks. A session: the app adds 20 examples (64 float32 features and a
label, in four calls; each evicts the oldest past ``max_bytes``), opstats records the session
before its upload (a durable commit, ``synchronous=FULL``), the session reads 640 examples
through ``query_batches``, opstats records it again (pruning the log back to its cap), and every
tenth session a scheduled ``apply_retention`` runs, which cuts the write-ahead log. The two apps
take turns of 20 sessions each on their own files; the clock is simulated (15 s between adds).

The baseline differs only in ``secure_delete``: what the store and opstats log cost to overwrite
the rows that retention and pruning delete. The log's cut is in both; its syncs are counted from
outside, e.g. ``strace -c -f -e trace=fsync,fdatasync python -m benchmarks.app_store``.

    cd /work/main && .venv/bin/python -m benchmarks.app_store [--quick]

Prints one JSON object per turn and the summary with the target (reported, not asserted):
secure_delete's CPU per session within 1.05 of the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
from sqlalchemy import event

from device_runtime.opstats import Event, OpStatsStore
from example_store import ExampleSelector, RetentionPolicy, SQLiteExampleStore

COLLECTION = "app:/keyboard"
SESSIONS_A_TURN = 20
GOAL = 1.05
KINDS = ("checkin", "plan_downloaded", "training_started", "training_completed", "upload_started")


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _events(at: float, took_part: bool) -> list[Event]:
    kinds = [*KINDS, "upload_completed"] if took_part else list(KINDS)
    return [Event(kind, at + i * 0.5, {"examples": 32}) for i, kind in enumerate(kinds)]


class _App:
    def __init__(self, folder: str, *, secure_delete: bool, seed: int) -> None:
        self.now = 1_700_000_000.0
        self.rng = np.random.default_rng(seed)
        database = os.path.join(folder, "app.db")
        self.store = SQLiteExampleStore(database, clock=lambda: self.now)
        self.opstats = OpStatsStore(database)
        if not secure_delete:
            for engine in (self.store._engine, self.opstats.engine):
                engine.dispose()  # the pool's connections were opened with the store's settings
                event.listen(engine, "connect", lambda conn, _record: conn.execute("PRAGMA secure_delete=OFF"))
        self.store.set_retention(COLLECTION, RetentionPolicy(ttl_seconds=86_400.0, max_bytes=600_000))
        self.store.add(COLLECTION, self._examples(2000), timestamps=[self.now - 3600 + i for i in range(2000)])
        for i in range(1000):
            self.now += 60
            self.opstats.record_session(f"earlier{i}", "keyboard", "next_word", _events(self.now, i % 3 == 0))
        self.sessions = 0
        with self.opstats.engine.connect() as conn:
            self.secure_delete = bool(conn.exec_driver_sql("PRAGMA secure_delete").scalar())

    def _examples(self, n: int) -> list[dict]:
        return [
            {"x": self.rng.standard_normal(64).astype(np.float32), "y": np.int64(self.rng.integers(10))}
            for _ in range(n)
        ]

    def session(self) -> None:
        self.sessions += 1
        for _ in range(4):
            self.now += 15
            self.store.add(COLLECTION, self._examples(5), timestamps=[self.now] * 5)
        events = _events(self.now, True)
        session_id = f"s{self.sessions}"
        self.opstats.record_session(session_id, "keyboard", "next_word", events[:-1])
        for _ in self.store.query_batches(ExampleSelector(COLLECTION, limit=640), 32):
            pass
        self.opstats.record_session(session_id, "keyboard", "next_word", events)
        if self.sessions % 10 == 0:
            self.store.apply_retention()

    def close(self) -> None:
        self.store.close()
        self.opstats.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 turns a side instead of 10")
    args = parser.parse_args(argv)
    turns = 4 if args.quick else 10
    with tempfile.TemporaryDirectory(prefix="app_store") as root:
        apps = {}
        for name, secure in (("secure_delete", True), ("baseline", False)):
            os.mkdir(folder := os.path.join(root, name))
            apps[name] = _App(folder, secure_delete=secure, seed=0)
        cpu_ms: dict[str, list[float]] = {name: [] for name in apps}
        for turn in range(turns):
            for name in ("secure_delete", "baseline") if turn % 2 else ("baseline", "secure_delete"):
                start = time.process_time()
                for _ in range(SESSIONS_A_TURN):
                    apps[name].session()
                cpu_ms[name].append((time.process_time() - start) * 1e3 / SESSIONS_A_TURN)
                _emit({"turn": turn, "app": name, "cpu_ms_per_session": round(cpu_ms[name][-1], 2)})
        settings = {name: app.secure_delete for name, app in apps.items()}
        for app in apps.values():
            app.close()
    median = {name: statistics.median(values) for name, values in cpu_ms.items()}
    ratio = median["secure_delete"] / median["baseline"]
    _emit(
        {
            "benchmark": "app_store",
            "summary": True,
            "turns": turns,
            "sessions_a_turn": SESSIONS_A_TURN,
            "secure_delete_set": settings,
            "median_cpu_ms_per_session": {name: round(v, 2) for name, v in median.items()},
            "targets": {
                "cpu_per_session_over_baseline": {"value": round(ratio, 3), "goal": GOAL, "met": ratio <= GOAL}
            },
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
