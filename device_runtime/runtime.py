"""The FL runtime an app embeds: one call runs a whole session (check in, download, train,
report) and records its events, whose symbols give the session's shape (paper, Table 1)."""

from __future__ import annotations

import enum
import hashlib
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import onnxruntime

from example_store import ExampleStore, UnknownCollectionError

from .checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .errors import CorruptResource, NoExamples, ProtocolError, SessionRejected
from .executor import PlanExecutor, TrainingInterrupted
from .plan import Plan, PlanError, load_plan
from .protocol import CheckinAccepted, ProtocolClient, RetryPolicy

#: Event symbols of the paper's Table 1.
SHAPE_SYMBOLS = {
    "checkin": "-",
    "plan_downloaded": "v",
    "training_started": "[",
    "training_completed": "]",
    "upload_started": "+",
    "upload_completed": "^",
    "upload_rejected": "#",
    "interrupted": "!",
    "error": "*",
}


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REPORT_REJECTED = "report_rejected"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Event:
    kind: str
    at: float
    detail: dict = field(default_factory=dict)


@dataclass
class SessionResult:
    outcome: Outcome
    task: str
    round: int
    events: list[Event]
    metrics: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0
    rejection_code: str | None = None

    @property
    def shape(self) -> str:
        return "".join(SHAPE_SYMBOLS[e.kind] for e in self.events)


class FLRuntime:
    """What an app creates once per population it takes part in.

    ``example_stores`` maps a collection URI prefix (or "" for all) to the store that serves it.
    Plans are cached on disk by their content id, so a device downloads each plan once.
    """

    def __init__(
        self,
        population: str,
        server_url: str,
        example_stores: ExampleStore | Mapping[str, ExampleStore],
        *,
        cache_dir: str | os.PathLike | None = None,
        runtime_version: str = onnxruntime.__version__,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.population = population
        self.stores = {"": example_stores} if isinstance(example_stores, ExampleStore) else dict(example_stores)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="fl-plan-cache-"))
        self.runtime_version = runtime_version
        self.rng = rng or random.Random()
        self.clock = clock
        self.client = ProtocolClient(server_url, timeout_s=timeout_s, retry=retry, rng=self.rng)
        self._plans: dict[str, Plan] = {}
        self._executors: dict[str, PlanExecutor] = {}
        self._lock = threading.Lock()
        self.last_retry_window: tuple[float, float] | None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "FLRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_retry_delay(self) -> float:
        """A delay inside the server's last retry window, jittered so devices do not come back together."""
        lo, hi = self.last_retry_window or (0.0, 0.0)
        return self.rng.uniform(lo, hi)

    def store_for(self, collection_uri: str) -> ExampleStore:
        best = max((p for p in self.stores if collection_uri.startswith(p)), key=len, default=None)
        if best is None:
            raise NoExamples(f"no example store is registered for collection {collection_uri!r}")
        return self.stores[best]

    def run_session(
        self,
        *,
        should_abort: Callable[[], bool] | None = None,
        before_report: Callable[[], None] | None = None,
        eligibility: dict | None = None,
        run_options: onnxruntime.RunOptions | None = None,
    ) -> SessionResult:
        """Run one session; raises SessionRejected when not selected (see ``last_retry_window``)."""
        with self._lock:  # one training session at a time per runtime
            events: list[Event] = []

            def record(kind: str, **detail: object) -> None:
                events.append(Event(kind, self.clock(), dict(detail)))

            answer = self.client.checkin(self.population, self.runtime_version, eligibility)
            if not isinstance(answer, CheckinAccepted):
                window = tuple(float(x) for x in answer.get("retry_after_s", (60.0, 120.0)))[:2]
                self.last_retry_window = (window[0], window[1])
                raise SessionRejected(str(answer.get("reason", "unspecified")), self.last_retry_window)
            session = answer
            record("checkin", round=session.round)
            try:
                plan = self._plan(session.plan_id)
                weights = self._checkpoint(session.checkpoint_id)
                record("plan_downloaded", plan_id=session.plan_id)
                executor = self._executors[session.plan_id]
                store = self.store_for(plan.device.selector.collection_uri)
                try:
                    available = store.count(plan.device.selector)
                except UnknownCollectionError:
                    available = 0
                if available == 0:
                    raise NoExamples(f"the selector {plan.device.selector} matched no examples in this app's stores")
                record("training_started")
                selector, batch_size = plan.device.selector, plan.device.batch_size
                result = executor.run_device(
                    weights,
                    executor.batches_from_examples(lambda: store.query_batches(selector, batch_size)),
                    should_abort=should_abort,
                    run_options=run_options,
                )
                record("training_completed", examples=result.num_examples)
            except TrainingInterrupted:
                record("interrupted")
                self._abort_quietly(session, "interrupted")
                return SessionResult(Outcome.INTERRUPTED, session.task, session.round, events)
            except BaseException as exc:
                record("error", error=type(exc).__name__)
                self._abort_quietly(session, f"error: {type(exc).__name__}")
                raise
            if before_report is not None:
                before_report()
            if should_abort is not None and should_abort():
                record("interrupted")
                self._abort_quietly(session, "interrupted")
                return SessionResult(Outcome.INTERRUPTED, session.task, session.round, events)
            payload = encode_checkpoint(result.update)
            record("upload_started", bytes=len(payload))
            try:
                self.client.report(session, payload)
            except ProtocolError as exc:
                if exc.status is not None and 400 <= exc.status < 500:
                    record("upload_rejected", code=exc.code)
                    return SessionResult(
                        Outcome.REPORT_REJECTED, session.task, session.round, events, result.metrics, result.num_examples, exc.code
                    )
                raise
            record("upload_completed")
            return SessionResult(Outcome.COMPLETED, session.task, session.round, events, result.metrics, result.num_examples)

    def _abort_quietly(self, session: CheckinAccepted, reason: str) -> None:
        try:
            self.client.abort(session, reason)
        except Exception:  # the server drops silent sessions at their deadline anyway
            pass

    def _plan(self, plan_id: str) -> Plan:
        if plan_id in self._plans:
            return self._plans[plan_id]
        path = self.cache_dir / "plans" / plan_id
        data = None
        if path.exists():
            cached = path.read_bytes()
            if _sha256(cached) == plan_id:
                data = cached
        if data is None:
            data = self.client.fetch_resource(plan_id)
        try:
            plan = load_plan(data, runtime_version=self.runtime_version)
        except PlanError as exc:
            raise CorruptResource(f"plan {plan_id} was refused: {exc}") from exc
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self._plans[plan_id] = plan
        self._executors[plan_id] = PlanExecutor(plan)
        return plan

    def _checkpoint(self, checkpoint_id: str) -> dict:
        data = self.client.fetch_resource(checkpoint_id)
        try:
            return decode_checkpoint(data)
        except CheckpointError as exc:
            raise CorruptResource(f"checkpoint {checkpoint_id} was refused: {exc}") from exc


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
