"""A sample app that embeds the SDK the way an Android app embeds federated compute.

It keeps what the user writes (here: handwritten digits) in its own example store, and asks the
runtime to take part in the "digits" population whenever the phone is idle, charging and on
Wi-Fi. Run it against a server (``fedfleet server``) whose population "digits" has a task that
reads ``app:/digits`` (``x``, 64 floats, and ``y``), such as the one the model engineer's tutorial
deploys (docs/tutorials/model-engineer.md); a server without one turns every check-in away
(NO_TASK). The app runs for ``--seconds`` (30) and prints its sessions' shapes:

    .venv/bin/python examples/digits_app.py --server http://127.0.0.1:8000 --data-dir /tmp/digits-app
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from device_runtime import (
    Clock,
    DeviceConditions,
    DeviceState,
    FLRuntime,
    OpStatsStore,
    ParticipationScheduler,
    RuntimeEnvironment,
    StaticConditions,
    SystemClock,
    TrainingConstraints,
    TrainingInterval,
    WorkerQueue,
)
from example_store import FileKeyStore, KeyStore, RetentionPolicy, SQLiteExampleStore

POPULATION = "digits"
COLLECTION = "app:/digits"


class DigitsApp:
    """Everything lives in one database file of the app's: examples, opstats and scheduled jobs."""

    def __init__(
        self,
        data_dir: str | Path,
        server_url: str,
        conditions: DeviceConditions,
        *,
        clock: Clock | None = None,
        queue: WorkerQueue | None = None,
        key_store: KeyStore | None = None,
    ) -> None:
        """Examples are sealed at rest under this app's key from ``key_store`` (the device's
        keystore; by default a key file beside the app's data)."""
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        db = self.data_dir / "app.db"
        clock = clock or SystemClock()
        key_store = key_store if key_store is not None else FileKeyStore(self.data_dir / "keystore.json")
        self.store = SQLiteExampleStore(
            db,
            retention=RetentionPolicy(ttl_seconds=30 * 86_400),
            clock=clock.now,
            key_store=key_store,
            key_alias="digits-app",
        )
        self.opstats = OpStatsStore(db)
        self.runtime = FLRuntime(
            POPULATION,
            server_url,
            self.store,
            cache_dir=self.data_dir / "fl-cache",
            opstats=self.opstats,
            environment=RuntimeEnvironment(clock=clock.now),
        )
        self.scheduler = ParticipationScheduler(db, conditions, app="digits-app", clock=clock, queue=queue)
        self.scheduler.register_runtime(POPULATION, self.runtime)

    def on_digit_written(self, pixels: np.ndarray, label: int) -> None:
        """What the app does when the user writes a digit and confirms what it was."""
        self.store.add(COLLECTION, [{"x": np.asarray(pixels, dtype=np.float32), "y": np.int64(label)}])

    def enable_federated_learning(self, every_s: float = 4 * 3600) -> None:
        self.scheduler.schedule(
            POPULATION,
            TrainingConstraints(requires_idle=True, requires_charging=True, requires_unmetered_network=True),
            TrainingInterval(recurrent=True, min_interval_s=every_s),
        )

    def disable_federated_learning(self) -> None:
        self.scheduler.cancel(POPULATION)

    def close(self) -> None:
        self.scheduler.close()
        self.runtime.close()
        self.opstats.close()
        self.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the app runs")
    args = parser.parse_args()
    from sklearn.datasets import load_digits

    digits = load_digits()
    ready = StaticConditions(DeviceState(idle=True, charging=True, battery_level=1.0, unmetered_network=True))
    app = DigitsApp(args.data_dir, args.server, ready)
    rng = np.random.default_rng()
    for i in rng.choice(len(digits.target), 40, replace=False):
        app.on_digit_written(digits.data[i] / 16.0, int(digits.target[i]))
    app.enable_federated_learning(every_s=5.0)
    app.scheduler.queue.start()
    time.sleep(args.seconds)
    app.scheduler.queue.stop()
    print(dict(app.opstats.shape_counts(POPULATION)))
    app.close()


if __name__ == "__main__":
    main()
