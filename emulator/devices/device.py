"""An emulated device: its own app database with an example store, the SDK's runtime, and a
behaviour profile that makes some sessions drop out or report too late."""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from device_runtime import DeviceAttestor, FLRuntime, RetryPolicy, RuntimeSdkError, SessionRejected
from example_store import FileKeyStore, KeyStore, SQLiteExampleStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceProfile:
    """How often a device misbehaves in a session, and how long it waits between sessions.

    ``dropout_prob``: interrupted as soon as training starts; ``late_dropout_prob``: interrupted
    at a random moment within ``late_dropout_within_s`` of starting to train (during training,
    or later while it reports, e.g. between Secure Aggregation rounds); ``late_prob``: reports
    after its deadline."""

    dropout_prob: float = 0.0
    late_dropout_prob: float = 0.0
    late_dropout_within_s: float = 0.5
    late_prob: float = 0.0
    late_delay_s: float = 5.0
    cooldown_s: tuple[float, float] = (0.5, 2.0)


class EmulatedDevice:
    def __init__(
        self,
        device_id: str,
        root: Path,
        server_url: str,
        population: str,
        *,
        profile: DeviceProfile = DeviceProfile(),
        collection_uri: str = "app:/examples",
        seed: int = 0,
        runtime_version: str | None = None,
        attestor: DeviceAttestor | None = None,
        trust_anchor: Mapping[bytes, bytes] | None = None,
        key_store: KeyStore | None = None,
    ) -> None:
        """The app's examples are sealed under its key from ``key_store``, by default the
        device's own keystore file (``root/keystore.json``). ``attestor`` and the authority's
        ``trust_anchor`` make its Secure Aggregation groups attested (the SDK's default policy
        refuses secure tasks without them)."""
        self.device_id = device_id
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.profile = profile
        self.collection_uri = collection_uri
        self.rng = random.Random(seed)
        self.key_store = key_store if key_store is not None else FileKeyStore(self.root / "keystore.json")
        self.store = SQLiteExampleStore(self.root / "app.db", key_store=self.key_store, key_alias="emulated-app")
        kwargs: dict[str, Any] = {"runtime_version": runtime_version} if runtime_version else {}
        self.runtime = FLRuntime(
            population,
            server_url,
            self.store,
            cache_dir=self.root / "cache",
            retry=RetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.5),
            rng=random.Random(seed + 1),
            attestor=attestor,
            trust_anchor=trust_anchor,
            **kwargs,
        )
        self.outcomes: Counter[str] = Counter()
        self.shapes: Counter[str] = Counter()

    def add_examples(self, x: np.ndarray, y: np.ndarray) -> None:
        self.store.add(self.collection_uri, ({"x": xi, "y": yi} for xi, yi in zip(x, y)))

    def step(self, stop: threading.Event | None = None) -> float:
        """One attempt at a session; returns how long to wait before the next one. ``stop`` (the
        fleet's) cuts short a late device's wait before its report: that session then ends
        interrupted, the server told, instead of holding the fleet's stop for the rest of the wait."""
        drop = self.rng.random() < self.profile.dropout_prob
        late_drop = not drop and self.rng.random() < self.profile.late_dropout_prob
        late = not drop and not late_drop and self.rng.random() < self.profile.late_prob
        should_abort = None
        before_report = None
        if drop:
            should_abort = lambda: True  # noqa: E731
        elif late_drop:
            should_abort = _after(self.rng.uniform(0.0, self.profile.late_dropout_within_s))
        elif late:
            # before reporting, wait past the deadline as a device whose upload is slow would, unless
            # the fleet stops first: the session is then aborted, not reported
            stopping, delay_s = stop or threading.Event(), self.profile.late_delay_s

            def wait_past_deadline() -> None:
                stopping.wait(delay_s)

            should_abort, before_report = stopping.is_set, wait_past_deadline
        try:
            result = self.runtime.run_session(should_abort=should_abort, before_report=before_report)
        except SessionRejected as rejected:
            self.outcomes[f"rejected:{rejected.reason}"] += 1
            return self.runtime.next_retry_delay()
        except RuntimeSdkError as exc:
            log.info("device %s: session failed: %s", self.device_id, exc)
            self.outcomes[f"error:{type(exc).__name__}"] += 1
            return self.rng.uniform(*self.profile.cooldown_s)
        except Exception as exc:  # a full disk, too many open files...: counted, and the device lives on
            log.warning("device %s: session failed unexpectedly: %r", self.device_id, exc)
            self.outcomes[f"error:{type(exc).__name__}"] += 1
            return self.rng.uniform(*self.profile.cooldown_s)
        self.outcomes[result.outcome.value] += 1
        self.shapes[result.shape] += 1
        return self.rng.uniform(*self.profile.cooldown_s)

    def run(self, stop: threading.Event) -> None:
        stop.wait(self.rng.uniform(0.0, 0.5))
        while not stop.is_set():
            delay = self.step(stop)
            stop.wait(delay)

    def close(self) -> None:
        self.runtime.close()
        self.store.close()


def _after(seconds: float):
    """A should_abort that turns true ``seconds`` after its first call."""
    start: list[float] = []

    def check() -> bool:
        if not start:
            start.append(time.monotonic())
        return time.monotonic() - start[0] >= seconds

    return check


#: Threads that close a stopped fleet's devices, or delete their folders.
CLOSERS = 8


class RealTimeFleet:
    """Runs every device's loop in its own thread until ``stop``."""

    def __init__(self, devices: list[EmulatedDevice]) -> None:
        self.devices = devices
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=d.run, args=(self._stop,), name=d.device_id, daemon=True) for d in devices
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops every device's loop: a session under way ends first (reported, or aborted with
        the server told: a late device's wait before its report is cut short); then the devices
        are closed, several at once (each closes its own SQLite databases, a few milliseconds each)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._each(EmulatedDevice.close)

    def remove_folders(self) -> None:
        """Deletes the stopped fleet's device folders (app databases, keystores, plan caches),
        several at once: deleting a file can take a millisecond or more, and a fleet's devices
        have hundreds."""
        self._each(lambda device: shutil.rmtree(device.root))

    def _each(self, do: Callable[[EmulatedDevice], object]) -> None:
        with ThreadPoolExecutor(max_workers=min(CLOSERS, max(len(self.devices), 1))) as pool:
            list(pool.map(do, self.devices))

    def outcomes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for device in self.devices:
            total.update(device.outcomes)
        return total

    def shapes(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for device in self.devices:
            total.update(device.shapes)
        return total
