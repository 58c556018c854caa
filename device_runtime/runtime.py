"""The FL runtime an app embeds: one call runs a whole session (check in, download, train,
report) and records its events, whose symbols give the session's shape (paper, Table 1)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import errno
import logging
import os
import random
import secrets
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import onnxruntime

from example_store import (
    ExampleSelector,
    ExampleStore,
    InvalidArgumentError,
    SQLiteExampleStore,
    UnknownCollectionError,
)

from .attestation import DeviceAttestor, PeerCertificateVerifier
from .batching import examples_share
from .checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from .clock import elapsed_clock, is_system_time
from .ddp import DDPError
from .dp_policy import DEFAULT_DP_POLICY, DP_PARAMS_INVALID, DPPolicy, encode_update, update_dim
from .eligibility import EligibilityPolicies, Participation, VerdictJSON, evaluate
from .environment import DEVICE_ENVIRONMENT, RuntimeEnvironment, WorkMeter
from .errors import (
    CacheUnavailable,
    CorruptResource,
    InvalidSetting,
    NoExamples,
    OverBudget,
    ProtocolError,
    SessionInProgress,
    SessionRejected,
    check_number,
    check_path,
)
from .executor import DeviceResult, PlanExecutor, TrainingInterrupted, all_finite, stoppable_run_options
from .influence import bound_update
from .memory import training_peak
from .opstats import MAY_BE_HELD, READ_TO, AppDatabaseError, Event, OpStatsStore, shape_of
from .plan import Plan, PlanError, largest_work_tensor, largest_work_tensor_at, nodes_bound
from .plan_cache import MAX_CACHED_PLANS, DirectoryPlanCache, LoadedPlans, PlanCache, own_cache_folder
from .protocol import (
    INTERRUPTED,
    MIN_ANSWER_BYTES_PER_S,
    CheckinAccepted,
    ClientTLS,
    ProtocolClient,
    RetryPolicy,
    checked_server_url,
    redacted_url,
    retry_window,
)
from .reading import ExampleReading, MemoryResumptionTokens, ResumptionTokenKeeper
from .secagg_policy import DEFAULT_SECAGG_POLICY, SecAggPolicy
from .secure_client import (
    DEADLINE_GRACE_S,
    MAX_DEADLINE_S,
    NEEDS_ATTESTATION,
    REFUSED,
    SecureAggregation,
    SecureOutcome,
    SecureResult,
    identity_problem,
)
from .secure_sum import SecureSumCodec
from .wire import NAME_RULE, is_name

log = logging.getLogger(__name__)

#: Where a device waits before trying again when the server named no retry window.
DEFAULT_RETRY_WINDOW_S = (60.0, 120.0)
#: How long a device on the system's clock gives a session's requests before the server has
#: accepted it (attestation nonce, eligibility, check-in and their retries), whatever the server
#: does; once accepted, the session's requests end with its report window (``_session_window_s``).
CHECKIN_WINDOW_S = 300.0
#: ``SessionResult.rejection_code`` of a secure session whose own update was not valid (the code
#: the server gives such a plain report): the device dropped out of its group instead of sending it.
INVALID_UPDATE = "INVALID_UPDATE"


class Outcome(enum.Enum):
    """How a session the server accepted ended: ``COMPLETED`` (the update was sent and taken),
    ``REPORT_REJECTED`` (the server refused it, or the device did not send an update that was not
    valid: ``SessionResult.rejection_code`` says why), ``INTERRUPTED`` (``should_abort``, the
    conditions or ``close`` stopped it: the server was told, nothing was sent)."""

    COMPLETED = "completed"
    REPORT_REJECTED = "report_rejected"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class DeviceClass:
    """What a device can give a plan; a plan whose declared budget exceeds it is refused, and so is
    one whose work graph makes a tensor larger than ``memory_mb`` where its size is known before it
    runs (``plan.largest_work_tensor``), and checked again before each step at the batch's shapes
    (``plan.largest_work_tensor_at``). A plan's examples take at most an eighth of ``memory_mb``
    at once (``batching.examples_share``): its shuffle buffer is cut to it, and a plan whose one
    batch cannot fit is refused. On the system's clock, training stops by force after
    ``max_training_s`` when the plan declares no time budget of its own, and once the process has
    grown by more than ``memory_mb`` since training began."""

    name: str = "default"
    memory_mb: float = 2048.0
    max_training_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidSetting(f"DeviceClass.name is a string such as 'default', not {self.name!r:.100}")
        check_number("DeviceClass.memory_mb", self.memory_mb, positive=True, unit="MB")
        check_number("DeviceClass.max_training_s", self.max_training_s, positive=True)


#: The share of its ``DeviceClass.memory_mb`` a device gives one plan and one checkpoint it
#: downloads (``resource_bound``). A plan takes about three times its bytes more while it loads
#: (measured: one carrying 64 MiB of weights peaks 200 MiB above its bytes, parsed, checked and made
#: into onnxruntime's session; 515 MiB, eight times, before ``load_plan`` checked its graphs without
#: their weights); a checkpoint's weights are held twice while they train (the
#: weights and their update, as the fleet's ``plan_cost`` counts them). The protocol's own bound is
#: 1 GiB (``MAX_RESOURCE_BYTES``): a server that declared a plan's memory budget small and sent
#: 1 GiB of it ran a 2 GB device out of memory before the budget was read.
RESOURCE_SHARE = {"plan": 8, "checkpoint": 2}
#: How often a training step's memory is sampled while it runs (s); see ``_training_watchdog``.
MEMORY_WATCH_S = 0.01
#: How a session stopped for the memory its training took begins its reason.
OVER_MEMORY = "over the device's memory"


def resource_bound(device: DeviceClass, what: str) -> tuple[int, str]:
    """The most bytes of one ``what`` ("plan" or "checkpoint") ``device`` downloads, and why."""
    share = RESOURCE_SHARE[what]
    most = int(device.memory_mb * (1 << 20)) // share
    return most, (
        f"a {device.name} device of {device.memory_mb:g} MB takes a {what} of at most "
        f"{most / (1 << 20):,.1f} MB (1/{share} of its memory, as it holds one {share} times over)"
    )


@dataclass
class SessionResult:
    """How one session that the server accepted ended (``run_session``'s result; a session the
    server turned away raises ``SessionRejected`` instead). ``metrics`` are the plan's (a training
    plan's ``loss`` and ``accuracy`` on this device's examples), ``num_examples`` the examples it
    trained on, ``events`` every phase as recorded in opstats; ``rejection_code`` is the server's
    code when it refused the report (``Outcome.REPORT_REJECTED``)."""

    outcome: Outcome
    task: str
    round: int
    events: list[Event]
    metrics: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0
    rejection_code: str | None = None
    #: The window the server named for this device's next check-in, with its answer to the report.
    retry_after_s: tuple[float, float] | None = None

    @property
    def shape(self) -> str:
        """The session's events as the symbols of the paper's Table 1 (``-v[]+^``: checked in,
        downloaded, trained, uploaded, accepted; ``device_runtime.opstats.SHAPE_SYMBOLS``)."""
        return shape_of(self.events)

    def __repr__(self) -> str:
        # the events, each with its detail, made a screen of text: their shape says where it ended
        said = [
            f"outcome=Outcome.{self.outcome.name}",
            f"task={self.task!r}",
            f"round={self.round}",
            f"shape={self.shape!r}",
            f"num_examples={self.num_examples}",
            "metrics={" + ", ".join(f"{k!r}: {v:.4g}" for k, v in self.metrics.items()) + "}",
        ]
        if self.rejection_code is not None:
            said.append(f"rejection_code={self.rejection_code!r}")
        if self.retry_after_s is not None:
            said.append(f"retry_after_s={self.retry_after_s!r}")
        return f"SessionResult({', '.join(said)})"


class FLRuntime:
    """What an app creates once per population it takes part in.

    ``example_stores`` maps a collection URI prefix (or "" for all) to the store that serves it.
    Plans are cached on disk by their content id, so a device downloads each plan once.
    Plans that resume reading (``DeviceConfig.resume``) keep their resumption tokens in
    ``opstats`` when given (they survive a restart), otherwise in memory (see ``reading``).
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
        opstats: OpStatsStore | None = None,
        device_class: DeviceClass = DeviceClass(),
        attestor: DeviceAttestor | None = None,
        trust_anchor: Mapping[bytes, bytes] | None = None,
        secagg_policy: SecAggPolicy = DEFAULT_SECAGG_POLICY,
        dp_policy: DPPolicy = DEFAULT_DP_POLICY,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        plan_cache: PlanCache | None = None,
        environment: RuntimeEnvironment = DEVICE_ENVIRONMENT,
        tls: ClientTLS | None = None,
    ) -> None:
        """``transport``: how the protocol's requests travel (real HTTP by default; an
        in-process transport in a simulation or a test), see ``ProtocolClient``; ``http_client``:
        an httpx client to send through instead (the runtime does not close it).
        ``plan_cache``: downloaded plans (by default files in ``cache_dir``). ``attestor`` (this
        device's attested key) and ``trust_anchor`` (the attestation authority's) are what Secure
        Aggregation needs under the default ``secagg_policy``, which accepts attested peers only:
        without them secure tasks are refused with ``SECAGG_NEEDS_ATTESTATION``. ``dp_policy``:
        the noise floor this device holds in distributed-DP rounds (``DPPolicy``; by default only
        the task's own noise, and no floor of the app's).
        ``environment``: where sessions read and spend time and memory (``RuntimeEnvironment``):
        the system's on a device, a model's in a simulation on virtual time. ``rng``: the device's
        random stream (jitter, fixed-point rounding); given one, a seeded run repeats, noise
        included; without one, a distributed-DP round's noise and rounding are seeded from the
        operating system's entropy, never from a stream whose draws the server sees as timings.
        A ``population`` that breaks ``NAME_RULE`` (it is a path segment of the device's requests)
        or a ``server_url`` that is not http(s) is refused here with ``InvalidSetting``, as are
        settings of the wrong kind (a path for ``opstats``, a number for ``device_class``, a
        ``timeout_s`` that is not a positive number of seconds, a ``transport``, ``http_client`` or
        ``plan_cache`` that is not one). ``tls``: this device's client certificate for a server
        that admits only clients with one, or the authority of the server's certificate
        (``ClientTLS``; a file it cannot use is refused here with ``InvalidSetting``)."""
        if not is_name(population):
            raise InvalidSetting(f"population {str(population)[:200]!r} refused: {NAME_RULE}")
        server_url = checked_server_url(server_url)  # before anything is made: a refusal leaves nothing
        stores = {"": example_stores} if isinstance(example_stores, ExampleStore) else example_stores
        if not isinstance(stores, Mapping) or not all(
            isinstance(k, str) and isinstance(v, ExampleStore) for k, v in stores.items()
        ):
            raise InvalidSetting(
                f"example_stores must be an example store (SQLiteExampleStore(path, key_store=...), "
                f"InMemoryExampleStore()) or a mapping from collection URI prefix to one, not "
                f"{type(example_stores).__name__} {str(example_stores)[:100]!r}"
            )
        _check_settings(
            cache_dir=cache_dir,
            runtime_version=runtime_version,
            timeout_s=timeout_s,
            retry=retry,
            rng=rng,
            opstats=opstats,
            device_class=device_class,
            environment=environment,
            attestor=attestor,
            trust_anchor=trust_anchor,
            secagg_policy=secagg_policy,
            dp_policy=dp_policy,
            transport=transport,
            http_client=http_client,
            plan_cache=plan_cache,
            tls=tls,
        )
        self.population = population
        self.stores = dict(stores)
        self._claims = _store_claims(population, self.stores.values())
        self._remove_own_cache: Callable[[], None] = lambda: None
        if cache_dir is None and plan_cache is None:
            # a cache of its own lives as long as the runtime: nothing is left in the temp folder
            # (a killed app's is removed by the next runtime that makes one)
            cache_dir, remove = _own_cache_folder()
            self._remove_own_cache = weakref.finalize(self, remove)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.runtime_version = runtime_version
        self.rng = rng or random.Random()
        self._seeded = rng is not None
        self.environment = environment
        clock = self.clock = environment.clock
        sleep = environment.sleep
        self.opstats = opstats
        self.resumption_tokens: ResumptionTokenKeeper = opstats if opstats is not None else MemoryResumptionTokens()
        self.device_class = device_class
        self.attestor = attestor
        # Secure Aggregation: the privacy floor this device holds (never the server), and the
        # attestation authorities whose certified devices it accepts as peers.
        self.secagg_policy = secagg_policy
        self.dp_policy = dp_policy
        self.peer_verifier = _peer_verifier(trust_anchor, clock) if trust_anchor is not None else None
        self.client = ProtocolClient(
            server_url,
            timeout_s=timeout_s,
            retry=retry,
            rng=self.rng,
            sleep=sleep,
            client=http_client,
            transport=transport,
            tls=tls,
        )
        self.plan_cache: PlanCache = (
            plan_cache if plan_cache is not None else DirectoryPlanCache(cast("str | os.PathLike", cache_dir))
        )  # made above
        self.loaded_plans = (
            environment.loaded_plans if environment.loaded_plans is not None else LoadedPlans(keep=MAX_CACHED_PLANS)
        )
        self.work_meter = environment.work_meter
        self.memory_probe = environment.memory_probe
        self.sleep = sleep
        self.secagg_poll_s = environment.secagg_poll_s
        # the plans of the last sessions, at most MAX_CACHED_PLANS (see LoadedPlans), used last at the end
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self._executors: dict[str, PlanExecutor] = {}
        self._codecs: dict[str, SecureSumCodec] = {}
        self._lock = threading.Lock()
        self.last_retry_window: tuple[float, float] | None = None
        self._verdict_needed = False  # from when a task with eligibility policies is seen
        self._closed = False
        self._session_thread: int | None = None  # the thread of the session in progress
        # the run options of the session's training in progress, and those whose step ``close``
        # stopped by force (cleared again as the session ends: an app's may serve another runtime)
        self._stopping = threading.Lock()
        self._training: onnxruntime.RunOptions | None = None
        self._terminated: onnxruntime.RunOptions | None = None

    def close(self) -> None:
        """Close the runtime. A session in progress on another thread is interrupted as by its
        ``should_abort`` (the server is told, nothing more is sent, opstats keep it as
        interrupted): a training step in flight is stopped by force through the session's run
        options (``run_options.terminate``: the runtime's own, or the app's given to
        ``run_session``, whose flag is cleared again as the session ends), and a request in flight
        is cut short at once (its socket shut, its retries and their waits dropped:
        ``ProtocolClient.interrupt``), the session ending interrupted, the server told where it had
        accepted the session; one still checking in raises ``InvalidSetting``. ``close`` returns
        once the session has ended, waiting at most ``timeout_s`` (the time the session's abort is
        given); past it, no request of the runtime is sent any more, and the session releases the
        HTTP client and the runtime's own plan cache itself as it ends. Called from the session's
        own thread (one of its hooks), the session closes the runtime as it ends. Called again
        (the session's hook closed it, then the app's shutdown), it cuts no request short: what
        was in flight the first time was cut then, and the session's last word (its abort) is
        waited for as above, where it was cut and the server not told."""
        first = not self._closed
        self._closed = True
        if self._session_thread == threading.get_ident():
            return
        with self._stopping:
            if self._training is not None and not self._training.terminate:
                self._training.terminate = True
                self._terminated = self._training
        if first:
            self.client.interrupt()
        if not self._lock.acquire(timeout=self.client.timeout_s):
            self.client.interrupt(for_good=True)  # its last word too; it releases what it holds as it ends
            return
        try:
            self._release()
        finally:
            self._lock.release()

    def _training_ended(self) -> None:
        """The session's training is over: ``close`` stops no step any more, and run options it
        stopped one through run again (an app's given to ``run_session`` serve its next runtime)."""
        with self._stopping:
            if self._terminated is not None:
                self._terminated.terminate = False
            self._training = self._terminated = None

    def _cut_short(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a request of this runtime's cut short by ``close``
        (``ProtocolClient.interrupt``). Any other error of a session closed meanwhile (an example
        the store cannot read, a hook of the app's that raised, a server's refusal) is raised as
        itself: read as the close's, it ended the session as interrupted and the app never saw it."""
        return self._closed and isinstance(exc, ProtocolError) and exc.status is None and INTERRUPTED in str(exc)

    def _release(self) -> None:
        self.client.close()
        self._remove_own_cache()

    def __repr__(self) -> str:
        stores = self.stores[""] if list(self.stores) == [""] else self.stores
        state = ", closed" if self._closed else ", in a session" if self._session_thread is not None else ""
        return f"FLRuntime({self.population!r}, {redacted_url(self.client.server_url)!r}, {stores!r}{state})"

    def __enter__(self) -> FLRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_retry_delay(self) -> float:
        """A delay inside the server's last retry window, jittered so devices do not come back
        together; before the server named one (it was unreachable, say), inside the default window."""
        lo, hi = self.last_retry_window or DEFAULT_RETRY_WINDOW_S
        return self.rng.uniform(lo, hi)

    def store_for(self, collection_uri: str) -> ExampleStore:
        """The example store registered for ``collection_uri``: under that URI, or under the longest
        registered URI it continues past a ``/`` (``app:/digits`` serves ``app:/digits/recent``, not
        ``app:/digits_heldout``: a scope is a folder, not the first letters of a name)."""
        if not isinstance(collection_uri, str):  # 5.startswith failed with an AttributeError
            raise InvalidSetting(
                f"store_for takes a collection URI such as 'app:/digits' (a str), not "
                f"{type(collection_uri).__name__} {collection_uri!r:.100}"
            )
        best = max((p for p in self.stores if _within(collection_uri, p)), key=len, default=None)
        if best is None:
            raise NoExamples(f"no example store is registered for collection {collection_uri!r}")
        return self.stores[best]

    def run_session(
        self,
        *,
        should_abort: Callable[[], bool] | None = None,
        before_report: Callable[[], None] | None = None,
        eligibility: VerdictJSON | None = None,
        run_options: onnxruntime.RunOptions | None = None,
    ) -> SessionResult:
        """Run one session; raises SessionRejected when not selected (see ``last_retry_window``).

        Every phase is recorded; the events go to ``opstats`` (if given) in one transaction when
        the session ends, whatever the way it ends. Setting ``run_options.terminate`` from another
        thread stops a training step in flight (``close`` sets it); make them with
        :func:`stoppable_run_options`.
        While this runtime runs a session (a call from another thread), or another runtime of this
        population runs one over one of this runtime's example stores in this process, raises
        ``SessionInProgress`` at once, having sent nothing: a second call that waited for the first
        checked in as it ended, and the device took part twice in one round."""
        if self._closed:  # its HTTP client is closed and its own plan cache removed
            raise InvalidSetting(f"this runtime of population {self.population!r} is closed; make a new FLRuntime")
        # said, not refused: a notebook's cells run on its kernel's loop; and not in a simulation on
        # virtual time, whose devices run their sessions as fibers of its own loop by design
        if is_system_time(self.clock) and _on_event_loop():
            warnings.warn(
                f"FLRuntime.run_session (population {self.population!r}) was called on a running asyncio event "
                "loop: it blocks until the session ends (seconds, minutes for a large plan), and the loop serves "
                "nothing meanwhile (a server on that loop never answers it); run it in a thread instead: "
                "await asyncio.to_thread(runtime.run_session)",
                RuntimeWarning,
                stacklevel=2,
            )
        for name, hook in (("should_abort", should_abort), ("before_report", before_report)):
            if hook is not None and not callable(hook):
                raise InvalidSetting(f"run_session's {name} is a function of no arguments or None, not {hook!r:.100}")
        if eligibility is not None and not isinstance(eligibility, dict):
            raise InvalidSetting(
                f"run_session's eligibility is a verdict dict (FLRuntime.evaluate_eligibility()) or None, "
                f"not {type(eligibility).__name__}"
            )
        with self._one_session():
            app_abort = should_abort

            def stop_asked() -> bool:  # the app's should_abort, or the runtime closed (``close``)
                return self._closed or (app_abort is not None and app_abort())

            self._claim()
            try:
                rec = _Recorder(self)
            except BaseException:
                self._unclaim()
                raise
            self._session_ends_in(CHECKIN_WINDOW_S)
            self._session_thread = threading.get_ident()
            try:
                result = self._session(rec, stop_asked, before_report, eligibility, run_options)
                if result.outcome is Outcome.COMPLETED and rec.reading is not None:
                    rec.position = rec.reading.position()  # only a completed session moves the saved position
                return result
            except Exception as exc:
                # its check-in cut short by ``close`` (a server's answer to it is no such thing)
                if rec.session is None and self._cut_short(exc):
                    raise InvalidSetting(
                        f"this runtime of population {self.population!r} was closed while it checked in "
                        f"({str(exc)[:200]}); make a new FLRuntime"
                    ) from exc
                raise
            finally:
                self._session_thread = None
                self._unclaim()
                self.client.ends_at = None
                if rec.reading is not None:
                    rec.reading.close()
                try:
                    rec.flush()
                except AppDatabaseError as exc:  # the session happened: its result (or error) is the app's to see
                    log.warning(
                        "population %s: this session's operational statistics were not kept: %s", self.population, exc
                    )
                if self._closed:  # closed by one of its own hooks
                    self._release()

    @contextlib.contextmanager
    def _one_session(self) -> Iterator[None]:
        """This runtime's session lock, or ``SessionInProgress`` at once while it is held (by a
        session of another thread; by ``close`` releasing the runtime: ``InvalidSetting``)."""
        if not self._lock.acquire(blocking=False):
            if self._closed:
                raise InvalidSetting(f"this runtime of population {self.population!r} is closed; make a new FLRuntime")
            raise SessionInProgress(
                f"this FLRuntime of population {self.population!r} is running a session (called from another "
                "thread or from one of its hooks); the device takes part once at a time, so this call sent nothing: "
                "skip it and try "
                "again when that session has ended"
            )
        try:
            if self._closed:  # closed since the check above
                raise InvalidSetting(f"this runtime of population {self.population!r} is closed; make a new FLRuntime")
            yield
        finally:
            self._lock.release()

    def _claim(self) -> None:
        """Claim this runtime's stores for its population's session in this process, or raise
        ``SessionInProgress`` having claimed nothing: two runtimes of one population over one store
        (an app that builds one per screen) each checked in from its own thread, and the server
        counted the device twice in one round. A claim is one ``dict.setdefault`` per store, atomic
        without a lock, so a fleet simulation's devices (a store of their own each, in greenlets of
        one thread) never wait on each other."""
        for i, key in enumerate(self._claims):
            holder = _RUNNING.setdefault(key, self)
            if holder is not self:
                for held in self._claims[:i]:
                    _RUNNING.pop(held, None)
                where = f" ({key[1][1]})" if key[1][0] == "file" else ""
                raise SessionInProgress(
                    f"another FLRuntime of population {self.population!r} is running a session over the same "
                    f"example store{where} in this process; the device takes part once at a time, so this "
                    "call sent nothing: skip it and try again when that session has ended (an app keeps one "
                    "FLRuntime per population)"
                )

    def _unclaim(self) -> None:
        for key in self._claims:
            if _RUNNING.get(key) is self:
                del _RUNNING[key]

    def _session_ends_in(self, seconds: float) -> None:
        """No request of this session goes on past ``seconds`` from now, however slowly a server
        answers (``ProtocolClient.ends_at``), on a device on the system's clock. A runtime on a
        simulation's clock leaves it to the simulation: its sessions interleave with others in
        real time, which says nothing of theirs."""
        if is_system_time(self.clock):
            self.client.ends_at = self.client.clock() + seconds

    @contextlib.contextmanager
    def _training_watchdog(self, plan: Plan, run_options: onnxruntime.RunOptions, rec: _Recorder) -> Iterator[None]:
        """On the system's clock, training that outlasts the plan's time budget, or the device's
        ``max_training_s`` when the plan declares none, or whose process grows by more than the
        device's ``memory_mb`` (sampled every ``MEMORY_WATCH_S``), is stopped by force even inside
        a step (``run_options.terminate``): the budget is otherwise checked between steps, and a
        plan's one step can run for ever (an ONNX Loop of 10^15 iterations) or take memory without
        end in a size only its data tells (a Loop whose every trip keeps a tensor); onnxruntime
        stops at the next node, so a device holds at most its memory and one node's tensors more.
        The plan's session, whose memory arena holds what its steps took, is not kept."""
        if not is_system_time(self.clock):  # a simulation's training takes its virtual time
            yield
            return
        limit, reason = training_limit(plan, self.device_class.max_training_s)
        memory_mb, probe = self.device_class.memory_mb, self.memory_probe
        done = threading.Event()

        def watch() -> None:
            base, ends = probe(), time.monotonic() + limit
            while not done.wait(max(0.0, min(MEMORY_WATCH_S, ends - time.monotonic()))):
                if time.monotonic() >= ends:
                    rec.over_budget = reason
                elif (grown := probe() - base) > memory_mb:
                    rec.over_budget = f"{OVER_MEMORY} ({memory_mb:g} MB, memory_mb): training took {grown:,.0f} MB"
                else:
                    continue
                run_options.terminate = True
                return

        watcher = threading.Thread(target=watch, name="fl-training-watchdog", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
            if rec.over_budget is not None and rec.over_budget.startswith(OVER_MEMORY) and rec.session is not None:
                plan_id = rec.session.plan_id
                for kept in (self._plans, self._executors, self._codecs):
                    kept.pop(plan_id, None)
                if self.environment.loaded_plans is None:
                    self.loaded_plans.forget(plan_id, self.runtime_version)

    def _session_window_s(self, session: CheckinAccepted) -> float:
        """How long an accepted session may take: the server's report window (at most an hour,
        ``MAX_DEADLINE_S``, whatever it names), the hour more a Secure Aggregation group may move
        it by, and one request's timeout for the last request in flight."""
        window = min(session.report_deadline_s, MAX_DEADLINE_S) + self.client.timeout_s
        if session.aggregation == "secure_sum":
            window += MAX_DEADLINE_S + DEADLINE_GRACE_S
        return window

    def _session(
        self,
        rec: _Recorder,
        should_abort: Callable[[], bool] | None,
        before_report: Callable[[], None] | None,
        eligibility: VerdictJSON | None,
        run_options: onnxruntime.RunOptions | None,
    ) -> SessionResult:
        # The task's policies are fetched only while the last ones seen were not empty (a fresh
        # runtime has seen none): a task without policies needs no verdict, and most check-ins
        # are rejected (pace steering), so this halves their requests, the first check-in of a
        # fleet's devices included. A server that needs a verdict says so (ELIGIBILITY_REQUIRED)
        # and is answered at once.
        skipped = eligibility is None and not self._verdict_needed
        if eligibility is None and not skipped:
            eligibility = self.evaluate_eligibility()
        attestation: Callable[[], dict] | None = None
        if self.attestor is not None:
            attestor = self.attestor

            def attest() -> dict:  # a fresh nonce for every attempt of the check-in
                return attestor.attest(self.client.attestation_nonce(), self.population, self.runtime_version)

            attestation = attest
        answer = self.client.checkin(self.population, self.runtime_version, eligibility, attestation)
        if skipped and not isinstance(answer, CheckinAccepted) and answer.reason == "ELIGIBILITY_REQUIRED":
            eligibility = self.evaluate_eligibility()
            answer = self.client.checkin(self.population, self.runtime_version, eligibility, attestation)
        if not isinstance(answer, CheckinAccepted):
            self.last_retry_window = retry_window(answer) or DEFAULT_RETRY_WINDOW_S
            raise SessionRejected(answer.reason, self.last_retry_window)
        session = rec.session = answer
        self._session_ends_in(self._session_window_s(session))
        rec.record("checkin", round=session.round)
        if session.aggregation == "secure_sum":  # said before the plan and checkpoint are downloaded for nothing
            problem = identity_problem(self.secagg_policy, self.attestor, self.peer_verifier)
            if problem is not None:
                refused = f"this device cannot take part in Secure Aggregation: {problem}"
                return self._secure_outcome(
                    rec, SecureResult(SecureOutcome.ABORTED, refused, refused=True, code=NEEDS_ATTESTATION), {}, 0
                )
        try:
            plan = self._plan(session.plan_id, session.token)
            executor = self._executors[session.plan_id]
            weights = self._checkpoint(session.checkpoint_id, session.token, executor)
            rec.record("plan_downloaded", plan_id=session.plan_id)
            store = self.store_for(plan.device.selector.collection_uri)
            reading = rec.reading = ExampleReading.start(
                store,
                plan.device,
                population=self.population,
                task=session.task,
                keeper=self.resumption_tokens,
                max_batch_bytes=examples_share(self.device_class.memory_mb),
            )
            available = reading.available
            if available == 0:
                raise NoExamples(
                    f"the selector {plan.device.selector} matched no examples in this app's stores"
                    f"{_why_none(store, plan.device.selector)}"
                )
            secure = None
            if session.aggregation == "secure_sum":
                secure, prepared = self._secure_prepare(session, plan, should_abort)
                if prepared is not None:
                    return self._secure_outcome(rec, prepared, {}, 0)
            resume = {"resume": reading.mode} if reading.resumes else {}
            rec.record("training_started", examples_available=available, **resume)
            batches: Callable[[], Iterator[Mapping[str, np.ndarray]]] = executor.batches_from_examples(
                reading.open_batches, max_held_bytes=examples_share(self.device_class.memory_mb)
            )
            batches = _within_memory(batches, plan, self.device_class)
            if self.work_meter is not None:
                batches = _metered(batches, plan, self.work_meter)
            run_options = run_options if run_options is not None else stoppable_run_options()
            self._training = run_options  # a step in flight stops at ``close``; closed before, at its first check
            try:
                with self._training_watchdog(plan, run_options, rec):
                    result = executor.run_device(
                        weights,
                        batches,
                        should_abort=rec.watch(plan, should_abort),
                        run_options=run_options,
                    )
            finally:
                self._training_ended()
                if self.work_meter is not None:
                    self.work_meter.settle()
            reading.training_completed()
            rec.record("training_completed", examples=result.num_examples)
        except TrainingInterrupted as stopped:
            return rec.interrupted(rec.over_budget or stopped.reason or "interrupted")
        except BaseException as exc:
            if self._cut_short(exc):  # a request cut short by ``close``; any other error is raised as itself
                return rec.interrupted("interrupted")
            if isinstance(exc, ProtocolError) and exc.status == 401:
                # the server no longer knows the session (BAD_SESSION_TOKEN: it restarted during
                # selection and lost the round): over, as when it refuses a report; any other
                # refusal of a download it named is a broken server's, raised
                code = exc.code or "HTTP_401"
                rec.record("upload_rejected", code=code, detail=str(exc)[:500])
                self._abort_quietly(session, str(exc)[:500], rec.stats())
                return rec.result(Outcome.REPORT_REJECTED, {}, 0, code)
            if isinstance(exc, OverBudget):  # the plan does not fit this device: said to the app and the server
                log.warning("population %s: session not run: %s", self.population, exc)
                rec.record("error", error=type(exc).__name__, reason=str(exc)[:500])
                self._abort_quietly(session, f"error: OverBudget: {exc}"[:500], rec.stats())
                raise
            rec.record("error", error=type(exc).__name__)
            self._abort_quietly(session, f"error: {type(exc).__name__}", rec.stats())
            raise
        if rec.over_budget:
            return rec.interrupted(rec.over_budget)
        if self.environment.report_update is not None:  # a simulated audit's canary (see RuntimeEnvironment)
            result = dataclasses.replace(result, update=self.environment.report_update(plan, result.update))
        try:  # the app's own code: a hook that raises ends the session as an error does, the server told
            if before_report is not None:
                before_report()
            aborted = should_abort is not None and should_abort()
        except BaseException as exc:
            rec.record("error", error=type(exc).__name__)
            self._abort_quietly(session, f"error: {type(exc).__name__}", rec.stats())
            raise
        if aborted:
            return rec.interrupted("interrupted")
        if secure is not None:
            return self._secure_report(rec, secure, session, plan, result)
        invalid = self._invalid_update(rec, session, result)
        if invalid is not None:
            return invalid
        payload = encode_checkpoint(result.update)
        rec.record("upload_started", bytes=len(payload))
        self._save_before_upload(rec, session)  # an app killed once the update has left still knows it took part
        delivery = _DeliveryWatch(self.client.http)
        try:
            with self._one_request_more(len(payload)), self._watching(delivery):
                reported = self.client.report(session, payload, rec.stats())
        except ProtocolError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                rec.record("upload_rejected", code=exc.code)
                return rec.result(Outcome.REPORT_REJECTED, result.metrics, result.num_examples, exc.code)
            if self._cut_short(exc):  # the upload cut short by ``close``
                return rec.interrupted("interrupted", **delivery.held(rec.events))
            rec.record("error", error=type(exc).__name__, **delivery.held(rec.events))
            raise
        except Exception as exc:  # the server unreachable at upload: the session's shape ends in an error
            rec.record("error", error=type(exc).__name__, **delivery.held(rec.events))
            raise
        rec.record("upload_completed")
        return self._paced(rec.result(Outcome.COMPLETED, result.metrics, result.num_examples), retry_window(reported))

    @contextlib.contextmanager
    def _watching(self, delivery: _DeliveryWatch) -> Iterator[None]:
        """The client's requests go through ``delivery`` (``ProtocolClient`` asks of its ``http``
        only ``request`` and ``close``), the app's or simulation's own client included."""
        self.client.http = cast(httpx.Client, delivery)
        try:
            yield
        finally:
            self.client.http = cast(httpx.Client, delivery.http)

    def _paced(self, completed: SessionResult, window: tuple[float, float] | None) -> SessionResult:
        """A completed session with the pace-steering window its server named, if it named one."""
        completed.retry_after_s = window
        if window is not None:
            self.last_retry_window = window
        return completed

    def evaluate_eligibility(self) -> VerdictJSON | None:
        """Evaluate the active task's policies here, on the device; only the verdict is sent."""
        info = self.client.eligibility_info(self.population)
        task, policies = info.task, info.policies or EligibilityPolicies()  # both checked by the wire model
        self._verdict_needed = task is None or not policies.empty
        if task is None or policies.empty:
            return None
        try:
            selector = ExampleSelector.from_dict(info.selector)  # type: ignore[arg-type]  # None is refused
            available = self.store_for(selector.collection_uri).count(selector)
        except (UnknownCollectionError, NoExamples):
            available = 0
        except InvalidArgumentError as exc:  # the selector's fields, or a resumption token the server sent
            raise ProtocolError(f"the server sent an example selector this runtime cannot use: {exc}") from None
        # any other error of the store is the app's (a store it closed, its database locked or
        # damaged), raised as the store said it, not blamed on the server's selector
        last = None
        if self.opstats is not None:
            summary = self.opstats.last_participation(self.population, task)
            if summary is not None:
                last = Participation(int(summary.events[0].detail.get("round", 0)), summary.started_at)
        verdict = evaluate(
            task, policies, examples_available=available, last=last, current_round=info.round or 0, now=self.clock()
        )
        return verdict.to_json()

    def _secure_prepare(
        self, session: CheckinAccepted, plan: Plan, should_abort: Callable[[], bool] | None
    ) -> tuple[SecureAggregation, SecureResult | None]:
        """The key rounds, before training (see ``secure_client``). Deadlines are measured on the
        runtime's clock, or on the monotonic one when that is the system's (which can jump). A plan
        that sends nothing to secure sum is refused here (``PlanError``), before a key is advertised
        or a step trained: its report could not be encoded."""
        codec = self._codec(session.plan_id, plan)
        clock = elapsed_clock(self.clock)
        polling: dict[str, Any] = (
            {} if self.secagg_poll_s is None else {"long_poll_s": 0.0, "poll_s": self.secagg_poll_s}
        )
        secure = SecureAggregation(
            self.client,
            session,
            deadline=clock() + min(session.report_deadline_s, MAX_DEADLINE_S),
            should_abort=should_abort,
            policy=self.secagg_policy,
            signer=self.attestor.secagg_signer() if self.attestor is not None else None,
            verify_peer=self.peer_verifier,
            dp_policy=self.dp_policy,
            update_dim=self._update_dim(session.plan_id, plan),
            input_length=codec.vector_length,
            sleep=self.sleep,
            clock=clock,
            **polling,
        )
        return secure, secure.prepare()

    def _codec(self, plan_id: str, plan: Plan) -> SecureSumCodec:
        codec = self._codecs.get(plan_id)
        if codec is None:
            codec = self._codecs[plan_id] = SecureSumCodec(plan, self._executors[plan_id])
        return codec

    def _update_dim(self, plan_id: str, plan: Plan) -> int:
        """The length of the weight deltas a distributed-DP round encodes (0 for an evaluation)."""
        if plan.kind != "train":
            return 0
        spec = self._executors[plan_id].client_update_spec()
        return update_dim({w: spec[w][0] for w in plan.weight_names}, plan.weight_names)

    def _secure_report(
        self, rec: _Recorder, secure: SecureAggregation, session: CheckinAccepted, plan: Plan, result: DeviceResult
    ) -> SessionResult:
        """Report through Secure Aggregation: the server sees only the group's sum, so this device
        bounds its own update first, as the server bounds a plain report (``bound_update``, with
        the round's bounds from the check-in; the count also within what one encoding carries).
        An update that is not valid (training diverged to NaN, say) is not sent: the device drops
        out of its group, which goes on without it, as the server refuses such a plain report."""
        codec = self._codec(session.plan_id, plan)
        invalid = self._invalid_update(rec, session, result)
        if invalid is not None:
            return invalid
        if secure.ddp is not None:
            return self._ddp_report(rec, secure, plan, result)
        cap = min(session.max_examples_per_report or codec.max_count, codec.max_count)
        bounded = bound_update(
            result.update,
            plan.weight_names if plan.kind == "train" else (),
            max_examples=cap,
            clip_norm=session.clip_update_norm,
        )
        vector = codec.encode(bounded.update, np.random.default_rng(self.rng.getrandbits(64)))
        rec.record(
            "upload_started", bytes=int(vector.nbytes), secure=True, capped=bounded.capped, clipped=bounded.clipped
        )
        return self._masked_report(rec, secure, vector, result)

    def _invalid_update(self, rec: _Recorder, session: CheckinAccepted, result: DeviceResult) -> SessionResult | None:
        """An update that is not valid (training diverged to NaN, say) is not sent: the session is
        aborted and ends as the server's refusal of it would (``INVALID_UPDATE``)."""
        try:
            self._executors[session.plan_id].validate_update(result.update)
        except PlanError as exc:
            rec.record("upload_rejected", code=INVALID_UPDATE, reason=str(exc)[:500])
            self._abort_quietly(session, f"the update is not valid: {exc}"[:500], rec.stats())
            return rec.result(Outcome.REPORT_REJECTED, result.metrics, result.num_examples, INVALID_UPDATE)
        return None

    def _noise_generator(self) -> np.random.Generator:
        """The generator of a distributed-DP round's rounding and noise: from the app's seeded
        stream when it gave one (a simulation that repeats), else from fresh OS entropy."""
        return np.random.default_rng(self.rng.getrandbits(128) if self._seeded else None)

    def _ddp_report(self, rec: _Recorder, secure: SecureAggregation, plan: Plan, result: DeviceResult) -> SessionResult:
        """A distributed-DP round's input: the mean delta, unweighted, clipped, rotated, rounded and
        noised with the parameters the device checked before it joined (``dp_policy``); the loss and
        accuracy sums are not sent (they would leave the group's sum without noise)."""
        assert secure.ddp is not None
        try:
            vector = encode_update(result.update, plan.weight_names, secure.ddp, self._noise_generator())
        except DDPError as exc:
            refused = SecureResult(
                SecureOutcome.ABORTED,
                f"this device refused the server: distributed DP: {exc}",
                refused=True,
                code=DP_PARAMS_INVALID,
            )
            return self._secure_outcome(rec, refused, result.metrics, result.num_examples)
        rec.record("upload_started", bytes=int(vector.nbytes), secure=True, dp="distributed")
        return self._masked_report(rec, secure, vector, result)

    def _masked_report(
        self, rec: _Recorder, secure: SecureAggregation, vector: np.ndarray, result: DeviceResult
    ) -> SessionResult:
        """Send the masked input of ``vector`` and answer the rounds after it. The session so far is
        kept first, as before a plain report: an app killed once its masked input has left still
        knows it took part (its peers' shares recover that input, and the group's sum holds it)."""
        assert rec.session is not None
        self._save_before_upload(rec, rec.session)
        try:
            outcome = secure.finish(vector)
        except Exception as exc:
            if self._cut_short(exc):  # a request of its rounds cut short by ``close``
                return rec.interrupted("interrupted")
            raise
        return self._secure_outcome(rec, outcome, result.metrics, result.num_examples)

    def _save_before_upload(self, rec: _Recorder, session: CheckinAccepted) -> None:
        """Keep the session so far before its update leaves. When it cannot be kept (a full disk),
        the update is not sent, since an app killed after sending it would not know the session
        took part and would train and report again: the server is told, as after any error, and
        the ``AppDatabaseError`` reaches the app. The server was told nothing, and held the
        device's seat in its round until the report window closed."""
        position = rec.reading.position() if rec.reading is not None else None
        if position is not None:  # where an app killed after the upload reads on from (OpStatsStore.resumption_token)
            rec.events[-1].detail[READ_TO] = [position[2], position[3]]
        try:
            rec.save_so_far()
        except AppDatabaseError as exc:
            rec.record("error", error=type(exc).__name__)
            self._abort_quietly(session, f"error: {type(exc).__name__}", rec.stats())
            raise

    def _secure_outcome(self, rec: _Recorder, outcome: SecureResult, metrics: dict, examples: int) -> SessionResult:
        if outcome.outcome is SecureOutcome.INTERRUPTED:
            return rec.interrupted("interrupted")
        if outcome.refused:  # below this device's privacy floor, a check failed, or no attested cohort: say why
            code = outcome.code or REFUSED
            if code == NEEDS_ATTESTATION:  # this app's configuration, not the server, must change
                log.warning("population %s: %s", self.population, outcome.detail)
            rec.record("upload_rejected", code=code, reason=outcome.detail)
            assert rec.session is not None
            self._abort_quietly(rec.session, outcome.detail[:500], rec.stats())
            return rec.result(Outcome.REPORT_REJECTED, metrics, examples, code)
        if outcome.outcome is SecureOutcome.INCLUDED:
            rec.record("upload_completed", secure=True)
            return self._paced(rec.result(Outcome.COMPLETED, metrics, examples), outcome.retry_after_s)
        code = outcome.code or f"SECAGG_{outcome.outcome.name}"
        rec.record("upload_rejected", code=code, detail=outcome.detail)
        if outcome.code:  # the server refused a request of the session (a 4xx): its group need not wait for it
            assert rec.session is not None
            self._abort_quietly(rec.session, outcome.detail[:500], rec.stats())
        return rec.result(Outcome.REPORT_REJECTED, metrics, examples, code)

    def _check_budget(self, plan: Plan, executor: PlanExecutor) -> None:
        meta, device = plan.metadata, self.device_class
        if meta.memory_budget_mb is not None and meta.memory_budget_mb > device.memory_mb:
            raise OverBudget(
                f"plan {plan.name!r} asks for {meta.memory_budget_mb} MB; a {device.name} device gives {device.memory_mb} MB"
            )
        # what the plan declares is the server's word; what its graph makes before a step is known
        largest = largest_work_tensor(plan)
        if largest is not None and largest[1] > device.memory_mb * (1 << 20):
            raise OverBudget(
                f"plan {plan.name!r} makes tensor {largest[0][:100]!r} of {largest[1] / (1 << 20):,.0f} MB before it "
                f"has run a step; a {device.name} device gives {device.memory_mb} MB"
            )
        # one batch is read, held and fed at once: its examples' share of the memory bounds it
        batch, share = plan.device.batch_size * executor.example_bytes(), examples_share(device.memory_mb)
        if batch > share:
            raise OverBudget(
                f"plan {plan.name!r} trains on batches of {plan.device.batch_size:,} examples, "
                f"{batch / (1 << 20):,.0f} MB at least; a {device.name} device holds "
                f"{share / (1 << 20):,.0f} MB of examples at once (an eighth of its {device.memory_mb} MB)"
            )
        # and what a whole step takes, read from its graph
        # (``memory.training_peak``: the fleet emulator seats a device by the same estimate)
        estimate = training_peak(plan)
        if estimate.peak_mb > device.memory_mb:
            raise OverBudget(
                f"plan {plan.name!r} takes about {estimate.describe()} to train a step; a {device.name} "
                f"device gives {device.memory_mb:g} MB (DeviceClass.memory_mb)"
            )
        if meta.time_budget_s is not None and meta.time_budget_s > device.max_training_s:
            raise OverBudget(
                f"plan {plan.name!r} asks for {meta.time_budget_s} s of training; a {device.name} device gives {device.max_training_s} s"
            )

    @contextlib.contextmanager
    def _one_request_more(self, sending: int = 0) -> Iterator[None]:
        """A session past its deadline still sends its last word (its report, late, which the
        server counts as such, or its abort) within one request's time: ``timeout_s`` and a
        second per ``MIN_ANSWER_BYTES_PER_S`` bytes of it."""
        ends_at = self.client.ends_at
        if ends_at is not None:
            own = self.client.timeout_s + sending / MIN_ANSWER_BYTES_PER_S
            self.client.ends_at = max(ends_at, self.client.clock() + own)
        try:
            yield
        finally:
            self.client.ends_at = ends_at

    def _abort_quietly(self, session: CheckinAccepted, reason: str, stats: dict | None = None) -> None:
        try:
            with self._one_request_more():
                self.client.abort(session, reason, stats)
        except Exception:  # the server drops silent sessions at their deadline anyway
            pass

    def _plan(self, plan_id: str, token: str) -> Plan:
        """The plan ``plan_id``, loaded and within this device's budgets (``_check_budget``). A plan
        refused leaves nothing of it: not cached, not loaded (in a runtime's own ``LoadedPlans``;
        a simulation's shared ones are its devices' own), a cached copy of it discarded."""
        if plan_id in self._plans:
            self._plans.move_to_end(plan_id)
            return self._plans[plan_id]
        data = self.plan_cache.get(plan_id)
        cached = data is not None
        bound = resource_bound(self.device_class, "plan")
        if data is None:
            data = self.client.fetch_resource(plan_id, token, bound)
        try:
            if len(data) > bound[0]:  # cached by a larger device's runtime, or read whole by the app's http_client
                raise OverBudget(f"plan {plan_id} is {len(data)} bytes: {bound[1]}")
            nodes = nodes_bound(self.device_class.memory_mb, self.device_class.name)
            plan, executor = self.loaded_plans.load(plan_id, data, self.runtime_version, max_nodes=nodes)
            try:
                self._check_budget(plan, executor)
            except OverBudget:
                if self.environment.loaded_plans is None:
                    self.loaded_plans.forget(plan_id, self.runtime_version)
                raise
        except (CorruptResource, OverBudget):
            discard = getattr(self.plan_cache, "discard", None)
            if cached and discard is not None:
                discard(plan_id)
            raise
        if not cached:
            self.plan_cache.put(plan_id, data)
        self._plans[plan_id] = plan
        self._executors[plan_id] = executor
        while len(self._plans) > MAX_CACHED_PLANS:
            oldest, _ = self._plans.popitem(last=False)
            self._executors.pop(oldest)
            self._codecs.pop(oldest, None)
        return plan

    def _checkpoint(self, checkpoint_id: str, token: str, executor: PlanExecutor) -> dict:
        bound = resource_bound(self.device_class, "checkpoint")
        data = self.client.fetch_resource(checkpoint_id, token, bound)
        if len(data) > bound[0]:  # read whole by the app's own http_client
            raise OverBudget(f"checkpoint {checkpoint_id} is {len(data)} bytes: {bound[1]}")
        try:
            weights = executor.check_weights(decode_checkpoint(data))
        except (CheckpointError, PlanError) as exc:
            raise CorruptResource(f"checkpoint {checkpoint_id} was refused: {exc}") from exc
        # a server commits only finite models: NaN or infinite weights would train to an update the
        # server refuses, the device's work for nothing. Checked as the float32 the plan trains: a
        # float64 of 1e300 is finite, and infinite once cast.
        broken = next((w for w in executor.plan.weight_names if not all_finite(weights[w])), None)
        if broken is not None:
            raise CorruptResource(
                f"checkpoint {checkpoint_id} was refused: weight {broken!r} holds NaN or infinite values as float32"
            )
        return weights


#: The runtimes running a session in this process, by (population, store): see ``FLRuntime._claim``.
_RUNNING: dict[tuple[str, tuple[str, object]], FLRuntime] = {}


def _on_event_loop() -> bool:
    """Whether this thread runs an asyncio event loop (the caller is one of its coroutines or callbacks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _store_claims(population: str, stores: Iterable[ExampleStore]) -> tuple[tuple[str, tuple[str, object]], ...]:
    """The keys a session of ``population`` over ``stores`` claims: an SQLite store by its file's
    real path (two objects opened on one database, or through a link, are one store), any other by
    the object itself (its id, which cannot be reused while a session holds the store)."""
    keys: dict[tuple[str, tuple[str, object]], None] = {}
    for store in stores:
        if isinstance(store, SQLiteExampleStore):
            keys[(population, ("file", os.path.realpath(store.path)))] = None
        else:
            keys[(population, ("object", id(store)))] = None
    return tuple(keys)


def _within(collection_uri: str, registered: str) -> bool:
    """``collection_uri`` is ``registered`` or lies under it (past a ``:``, ``/``, ``?`` or ``#``, or
    ``registered`` itself ends a folder or scheme: ``app:/`` and ``app:`` hold every ``app:`` URI;
    a store given alone is registered under ``""`` and holds every URI)."""
    if not collection_uri.startswith(registered):
        return False
    rest = collection_uri[len(registered) :]
    return not rest or not registered or registered.endswith(("/", ":")) or rest[0] in ":/?#"


def training_limit(plan: Plan, max_training_s: float) -> tuple[float, str]:
    """How long a device trains ``plan`` before it is stopped by force, and the reason its session
    records: the plan's time budget, or the device's ``max_training_s`` when it declares none (a
    device refuses a plan whose budget is longer)."""
    budget = plan.metadata.time_budget_s
    if budget is not None:
        return float(budget), f"over time budget ({budget} s)"
    return max_training_s, f"over the device's training time ({max_training_s} s, max_training_s)"


def _within_memory(
    open_batches: Callable[[], Iterator[Mapping[str, np.ndarray]]], plan: Plan, device: DeviceClass
) -> Callable[[], Iterator[Mapping[str, np.ndarray]]]:
    """Each batch is checked before its step: the largest tensor the work graph makes at the
    batch's shapes (``largest_work_tensor_at``: a smaller last batch, an example's dims the plan
    leaves open), where its size is known before the step, must fit the device's memory. A graph
    that sizes a tensor from the batch's shape (``ConstantOfShape(10^9 / Shape(x)[0])``, small at
    the plan's batch size that the load checked) was allocated by onnxruntime at the step."""
    limit = device.memory_mb * (1 << 20)
    fed = list(plan.device.inputs.items())
    examples = [example for _, example in fed]

    def open_checked() -> Iterator[Mapping[str, np.ndarray]]:
        checked: list | None = None  # the batches' shapes checked last: most have the shapes of the one before
        for batch in open_batches():
            dims: list[tuple[int, ...] | None]
            try:  # a list of the arrays' own shapes: this runs at every step
                dims = [batch[example].shape for example in examples]
            except (KeyError, AttributeError):  # an input the batch lacks, or a value not an array
                dims = [np.shape(batch[example]) if example in batch else None for example in examples]
            if dims != checked:
                shapes = {name: d for (name, _), d in zip(fed, dims, strict=True) if d is not None}
                largest = largest_work_tensor_at(plan, shapes)
                if largest is not None and largest[1] > limit:
                    raise OverBudget(
                        f"plan {plan.name!r} makes tensor {largest[0][:100]!r} of {largest[1] / (1 << 20):,.0f} MB "
                        f"at a batch of shapes {sorted(shapes.items())}; a {device.name} device gives "
                        f"{device.memory_mb} MB"
                    )
                checked = dims
            yield batch

    return open_checked


def _metered(
    open_batches: Callable[[], Iterable[Mapping[str, np.ndarray]]], plan: Plan, meter: WorkMeter
) -> Callable[[], Iterator[Mapping[str, np.ndarray]]]:
    """The executor asks for the next batch once it has run the last one: that is when its
    work is reported, so the next ``should_abort`` check sees the time it took."""

    def open_metered() -> Iterator[Mapping[str, np.ndarray]]:
        for batch in open_batches():
            yield batch
            meter.trained(plan, len(next(iter(batch.values()))) if batch else 0)

    return open_metered


def _why_none(store: ExampleStore, selector: ExampleSelector) -> str:
    """Why ``store`` holds nothing for ``selector`` when it holds no such collection (its error
    names the one it most likely meant: the app added to 'app:/digit' and the plan reads
    'app:/digits'), as a message's ending; "" otherwise."""
    try:
        store.count(selector)
    except UnknownCollectionError as exc:
        return f": {exc}"
    return ""


def _peer_verifier(trust_anchor: Mapping[bytes, bytes], clock: Callable[[], float]) -> PeerCertificateVerifier:
    """The verifier of the anchor's certificates, or ``InvalidSetting`` for an anchor that is not one."""
    try:
        return PeerCertificateVerifier(trust_anchor, clock)
    except (ValueError, TypeError) as exc:  # a key that is not one, a key id not its key's, a str for bytes
        raise InvalidSetting(
            f"trust_anchor is not the authority's {{key id: public key}} (AttestationAuthority.trust_anchor(), "
            f"or server_stub.read_trust_anchor(path)): {exc}"
        ) from None


#: A folder not made for want of space: a full disk or a quota.
_NO_SPACE = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))


def _own_cache_folder() -> tuple[str, Callable[[], None]]:
    """``own_cache_folder``, its ``OSError`` as a ``CacheUnavailable`` that says what to do: a full
    disk or an unwritable ``TMPDIR`` reached the app as a bare ``OSError`` from ``FLRuntime()``."""
    try:
        return own_cache_folder()
    except OSError as exc:
        where = getattr(tempfile, "tempdir", None) or os.environ.get("TMPDIR") or "the temp folder"
        if exc.errno in _NO_SPACE:
            advice = "the disk is full: free space and retry, or give FLRuntime a cache_dir= on another disk"
        else:
            advice = "give FLRuntime a cache_dir= this app may write, or set TMPDIR to a folder it may write"
        reason = exc.strerror or str(exc)
        raise CacheUnavailable(f"cannot make the plan cache folder in {where} ({reason}): {advice}") from exc


def _check_settings(**settings: Any) -> None:
    """``FLRuntime``'s settings of the wrong kind, refused with ``InvalidSetting`` before anything is
    made: each was taken as it came and failed deep in a session (a path as ``opstats`` once the
    session ended, its events lost), or never (a ``timeout_s`` of "10")."""
    cache_dir, timeout_s, opstats, rng = (settings[k] for k in ("cache_dir", "timeout_s", "opstats", "rng"))
    if cache_dir is not None:
        check_path("cache_dir", cache_dir, of="folder")
    if not isinstance(settings["runtime_version"], str) or not settings["runtime_version"]:
        raise InvalidSetting(
            f"runtime_version is a version string such as '1.17.3', not {settings['runtime_version']!r}"
        )
    check_number("timeout_s", timeout_s, positive=True)
    # the app's own keepers and random streams (the emulator's) are taken by what they do
    if opstats is not None and not all(
        callable(getattr(opstats, m, None)) for m in ("record_session", "last_participation", "resumption_token")
    ):
        raise InvalidSetting(
            f"opstats is an OpStatsStore (OpStatsStore(path) on the app's database) or None, "
            f"not {type(opstats).__name__} {opstats!r:.100}"
        )
    if rng is not None and not all(callable(getattr(rng, m, None)) for m in ("uniform", "getrandbits")):
        raise InvalidSetting(
            f"rng is a random.Random (random.Random(seed)) or None, not {type(rng).__name__} {rng!r:.100}"
        )
    attestor, anchor = settings["attestor"], settings["trust_anchor"]
    if attestor is not None and not all(callable(getattr(attestor, m, None)) for m in ("attest", "secagg_signer")):
        raise InvalidSetting(
            f"attestor is this device's DeviceAttestor (from the attestation authority) or None, "
            f"not {type(attestor).__name__} {attestor!r:.100}"
        )
    if anchor is not None and not isinstance(anchor, Mapping):  # failed with "has no attribute 'items'"
        raise InvalidSetting(
            f"trust_anchor is the authority's {{key id: public key}} (AttestationAuthority.trust_anchor()) or None, "
            f"not {type(anchor).__name__} {anchor!r:.100}"
        )
    # taken by what they do, as above: the emulator's lean client and in-memory cache are not httpx's or a file's
    for name, methods, what in (
        ("transport", ("handle_request",), "an httpx transport (httpx.BaseTransport)"),
        ("http_client", ("request", "close"), "an httpx.Client"),
        ("plan_cache", ("get", "put"), "a PlanCache (DirectoryPlanCache(path), MemoryPlanCache())"),
    ):
        value = settings[name]
        if value is not None and not all(callable(getattr(value, m, None)) for m in methods):
            raise InvalidSetting(f"{name} is {what} or None, not {type(value).__name__} {value!r:.100}")
    if settings["tls"] is not None and not isinstance(settings["tls"], ClientTLS):
        raise InvalidSetting(
            f"tls is a ClientTLS(cert_file, key_file, ca_file) or None, not {type(settings['tls']).__name__} "
            f"{settings['tls']!r:.100}"
        )
    for name, kind in (
        ("retry", RetryPolicy),
        ("device_class", DeviceClass),
        ("environment", RuntimeEnvironment),
        ("secagg_policy", SecAggPolicy),
        ("dp_policy", DPPolicy),
    ):
        if not isinstance(settings[name], kind):
            raise InvalidSetting(
                f"{name} is a {kind.__name__}, not {type(settings[name]).__name__} {settings[name]!r:.100}"
            )


class _DeliveryWatch:
    """A session's HTTP client as its report sees it: whether an attempt of the report may have
    reached the server. An attempt that failed before its connection was made (no network, a
    refused connection, a proxy that could not connect) sent nothing; one that failed after (the
    connection lost while sending or before the answer, an answer that never came) may have been
    taken, its answer lost. A report that failed so may be the server's: its session takes part
    (``opstats.MAY_BE_HELD``), as an app killed during the upload does, and its examples are not
    trained on and sent again (the server would count them twice)."""

    #: What fails before a byte of the request is sent.
    NOT_SENT = (
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.PoolTimeout,
        httpx.ProxyError,
        httpx.UnsupportedProtocol,
    )

    def __init__(self, http: Any) -> None:
        self.http = http
        self.may_have_arrived = False

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.http.request(method, url, **kwargs)
        except self.NOT_SENT:
            raise
        except BaseException:
            self.may_have_arrived = True
            raise

    def close(self) -> None:
        self.http.close()

    def held(self, events: list[Event]) -> dict[str, object]:
        """The detail of the failed report's last event: that the server may hold the update, and
        where its session stopped reading (``READ_TO`` of its ``upload_started``); none when no
        attempt can have reached the server."""
        if not self.may_have_arrived:
            return {}
        started = next(e for e in reversed(events) if e.kind == "upload_started")
        read_to = started.detail.get(READ_TO)
        return {MAY_BE_HELD: True, **({READ_TO: read_to} if read_to is not None else {})}


class _Recorder:
    """One session's events, its measured time and memory, and its budget watch."""

    #: How often (in steps) the resident memory is sampled while training.
    MEMORY_SAMPLE_EVERY = 8

    def __init__(self, runtime: FLRuntime) -> None:
        self.runtime = runtime
        self.events: list[Event] = []
        self.session: CheckinAccepted | None = None
        self.local_id = f"{runtime.rng.getrandbits(64):016x}"  # from the device's own stream: a seeded run repeats
        if isinstance(runtime.opstats, OpStatsStore):
            # the app's database outlives the process: an app that seeds its stream drew the same
            # ids after each start, and a new session's record replaced an earlier one's
            self.local_id += secrets.token_hex(8)
        #: Durations are measured on it (the system's wall clock can be set while a session runs).
        self.elapsed = elapsed_clock(runtime.clock)
        self._elapsed_at: dict[str, float] = {}
        self.base_memory_mb = runtime.memory_probe()
        self.peak_memory_mb = self.base_memory_mb
        self.over_budget: str | None = None
        self.reading: ExampleReading | None = None
        #: Where a completed session stopped reading, saved with its events by ``flush``.
        self.position: tuple[str, str, str, str] | None = None
        self.sent0 = runtime.client.bytes_sent
        self.received0 = runtime.client.bytes_received

    #: The longest text an event keeps: reasons come from the server too (a Secure Aggregation
    #: group's abort reason is any string it sends), and opstats is the app's database.
    MAX_TEXT = 500

    def record(self, kind: str, **detail: object) -> None:
        self.peak_memory_mb = max(self.peak_memory_mb, self.runtime.memory_probe())
        kept = {k: v[: self.MAX_TEXT] if isinstance(v, str) else v for k, v in detail.items()}
        self.events.append(Event(kind, self.runtime.clock(), kept))
        self._elapsed_at[kind] = self.elapsed()

    def watch(self, plan: Plan, should_abort: Callable[[], bool] | None) -> Callable[[], bool]:
        """The per-step check: the app's should_abort, and the plan's budgets, measured."""
        meta = plan.metadata
        clock, probe = self.elapsed, self.runtime.memory_probe
        started = clock()
        steps = 0

        def check() -> bool:
            nonlocal steps
            steps += 1
            if meta.time_budget_s is not None and clock() - started > meta.time_budget_s:
                self.over_budget = f"over time budget ({meta.time_budget_s} s)"
                return True
            if steps % self.MEMORY_SAMPLE_EVERY == 0:
                now = probe()
                self.peak_memory_mb = max(self.peak_memory_mb, now)
                if meta.memory_budget_mb is not None and now - self.base_memory_mb > meta.memory_budget_mb:
                    self.over_budget = f"over memory budget ({meta.memory_budget_mb} MB)"
                    return True
            return should_abort is not None and should_abort()

        return check

    def stats(self) -> dict:
        """Non-identifying statistics the server may see: the shape so far and the costs."""
        started, completed = (self._elapsed_at.get(k) for k in ("training_started", "training_completed"))
        return {
            "shape": shape_of(self.events),
            "training_s": round(completed - started, 3) if started is not None and completed is not None else None,
            "runtime_version": self.runtime.runtime_version,
        }

    def interrupted(self, reason: str, **detail: object) -> SessionResult:
        self.record("interrupted", reason=reason, **detail)
        assert self.session is not None
        self.runtime._abort_quietly(self.session, reason, self.stats())
        return self.result(Outcome.INTERRUPTED)

    def result(
        self, outcome: Outcome, metrics: dict | None = None, examples: int = 0, code: str | None = None
    ) -> SessionResult:
        assert self.session is not None
        return SessionResult(outcome, self.session.task, self.session.round, self.events, metrics or {}, examples, code)

    def save_so_far(self) -> None:
        """The session as it stands, in the app's database (``OpStatsStore``); ``flush`` replaces it
        with the whole session. Other keepers (the emulator's in memory) get it once, at its end."""
        if isinstance(self.runtime.opstats, OpStatsStore):
            task = self.session.task if self.session else None
            self.runtime.opstats.record_session(self.local_id, self.runtime.population, task, self.events)

    def flush(self) -> None:
        if self.events:
            client = self.runtime.client
            self.events[-1].detail.update(
                bytes_sent=client.bytes_sent - self.sent0,
                bytes_received=client.bytes_received - self.received0,
                peak_memory_mb=round(self.peak_memory_mb, 1),
                runtime_version=self.runtime.runtime_version,
            )
        runtime, task = self.runtime, self.session.task if self.session else None
        if isinstance(runtime.opstats, OpStatsStore) and self.events:
            # the app's database: the events and the position read to in one transaction
            runtime.opstats.record_session(
                self.local_id, runtime.population, task, self.events, resumption=self.position
            )
            return
        if self.position is not None:
            runtime.resumption_tokens.save_resumption_token(*self.position, runtime.clock())
        if runtime.opstats is not None and self.events:
            runtime.opstats.record_session(self.local_id, runtime.population, task, self.events)
