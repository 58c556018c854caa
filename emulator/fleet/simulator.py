"""A fleet on one virtual clock: the real FL server (``FLService`` behind its ASGI app, with its
SQLite store) and thousands of devices running the SDK's own code, driven by one discrete-event
loop with no thread per device and no sleeping.

The loop's events are: each device's fiber waking (its next job is due, or its conditions
change), the server's tick (deadlines pass even when no device talks to it), and the timeline's
samples. The server's clocks read the loop's time, so round deadlines, pace steering and the
round records are all in simulated time; a run with the same config and seed repeats event for
event, and its digest (the round history and every committed model's bytes) with it."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import greenlet
import numpy as np

from device_runtime import PlanExecutor, training_limit
from device_runtime.checkpoint import decode_checkpoint
from device_runtime.executor import NUM_EXAMPLES
from device_runtime.plan_cache import LoadedPlans
from server_stub.admin_auth import AdminKeys
from server_stub.app import create_app
from server_stub.errors import ApiError
from server_stub.persistence import ServerStore
from server_stub.serve import ServerThread
from server_stub.service import FLService, TaskSpec

from ..releases.workers import ReleasePlans, WorkerPool
from . import audit
from .config import FleetConfig
from .events import EventLoop, Fibers, SimulationError
from .federated_data import client_accuracy_percentiles
from .heap import long_lived_heap
from .plan_cost import MB, PlanCost, plan_cost
from .population import CANARY_PREFIX
from .releases import ReleasedPlans, release_tested_plans
from .secure_fleet import FleetAttestation
from .sim_device import MIN_INTERVAL_S, STATUS_CHECKING_IN, STATUS_IDLE, STATUS_PARTICIPATING, SimDevice
from .sim_transport import AsgiCaller, HttpCaller
from .summary import majority_share
from .tables import (
    FleetRun,
    RoundRow,
    SessionRow,
    TimelineRow,
    one_row_per_seat,
    unfinished_rounds,
    with_attempts,
    with_round_bytes,
)
from .workload import Workload, load_workload, task_round_config  # noqa: F401 - task_round_config: re-exported

#: Simulated time 0 is midnight UTC of this day plus the config's ``start_utc_hour``.
EPOCH_DAY = 1_767_225_600.0  # 2026-01-01T00:00:00Z
#: The server's own ticker in simulated seconds (uvicorn's runs every 50 ms of real time).
SERVER_TICK_S = 1.0
#: How often the ticker writes what late reports changed, in simulated seconds (a server writes
#: every 30 s of its time against a crash; a run's rounds are read, and so written, at its end).
SERVER_LATE_METRICS_EVERY_S = 3600.0
#: A task with more committed rounds than this has a sample of its models measured on the test
#: split (``MeasuredRounds``), about this many past the target accuracy.
MEASURED_ROUNDS = 400
#: Seconds between the timeline's samples.
TIMELINE_STEP_S = 300.0
#: Devices start their participation job spread over this many seconds after the start.
START_SPREAD_S = 600.0
#: Event orders at one instant: the server's tick, then the timeline, then devices; at the
#: horizon, after every event, the rows of the sessions the run's end cut (``end_sessions``).
ORDER_SERVER, ORDER_SAMPLE, ORDER_END = -2, -1, 3


class FleetSimulator:
    """One run: build with the fleet's devices (``specs``) and how to get each one's examples,
    then ``run()``. ``progress(t_s, rounds_committed, devices_active)`` is called every
    simulated few minutes and once at the end, ``rounds_committed`` the training tasks' committed
    rounds (a task that completed keeps its count; at the end, those on record)."""

    def __init__(
        self,
        config: FleetConfig,
        specs: Sequence[Any],
        examples: Callable[[Any], Any] | None = None,
        test_set: tuple[np.ndarray, np.ndarray] | Mapping[str, np.ndarray] | None = None,
        *,
        workdir: str | Path,
        progress: Callable[[float, int, int], None] | None = None,
        http: bool = False,
        serves: bool = True,
        workload: Workload | None = None,
    ) -> None:
        """``workload``: the tasks and data (``load_workload(config)`` when None: the task file of
        ``[task] file`` or the built-in digits MLP, on the data of ``[data]``). ``examples(spec)``
        and ``test_set`` replace the workload's device examples and test split when given
        (``examples`` may give ``(x, y)``, which go to the first training task's collection).

        ``http``: devices reach the server over real loopback HTTP (uvicorn in a thread of
        this process) instead of calling its ASGI app in process. The server's own ticker then
        runs beside the loop, the server draws its session ids, tokens, Secure Aggregation seeds and
        DP noise from ``secrets``, and uvicorn's ``date`` and ``server`` headers lengthen every
        response (more simulated transfer time), so such a run is not bit-identical from one time
        to the next, and its digest is not the in-process run's.
        ``serves=False``: another simulator's server answers these devices (a shard's), so the
        plans of ``real_runtimes`` are not release-tested here; the devices' workers still run.

        With a secure task an attestation authority certifies every device, the server admits
        attested devices only, and reports go through Secure Aggregation in attested groups: the
        devices' default privacy floor, all on the virtual clock (see ``secure_fleet``)."""
        self.config = config
        self.workload = workload = workload or load_workload(config)
        self.attestation: FleetAttestation | None = FleetAttestation(config.fleet.seed) if workload.secure else None
        self.specs = list(specs)
        self._examples = examples if examples is not None else workload.device_examples
        if test_set is None:
            self._test = workload.central_test()
        elif isinstance(test_set, tuple):
            self._test = {"x": test_set[0], "y": test_set[1]}
        else:
            self._test = dict(test_set)
        self.progress = progress
        self.loop = EventLoop()
        self.fibers = Fibers(self.loop)
        self.epoch = EPOCH_DAY + config.fleet.start_utc_hour * 3600.0
        self.horizon_s = config.horizon_s
        task = config.task
        self.population = task.population
        self.collection_uri = workload.collection
        self.server_url = "http://fl.sim"
        self.max_training_s = device_max_training_s(workload)
        self.plan_bytes: dict[str, bytes] = {}
        # fleet.real_runtimes: one worker process per release, shared by its devices (see ``releases``)
        self.runtime_pool: WorkerPool | None = WorkerPool() if config.fleet.real_runtimes else None
        self.loaded_plans = LoadedPlans() if self.runtime_pool is None else ReleasePlans(self.runtime_pool)
        self.sessions: list[SessionRow] = []
        self.errors: Counter[str] = Counter()
        self.status_counts: Counter[str] = Counter()
        self.timeline_rows: list[tuple[float, int, int, int]] = []
        self.committed_seen: dict[str, int] = {}  # the progress bar's: each training task's rounds at the last sample
        self.devices: list[SimDevice] = []
        self.extra: dict[str, Any] = {}

        self.plan = workload.training[0].plan
        self._cost_plan()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in self.workdir.glob("server.db*"):  # a run always starts from a fresh server
            stale.unlink()
        self.released: ReleasedPlans | None = None
        released: dict[str, ReleasedPlans] = {}
        if self.runtime_pool is not None and serves:
            try:
                released = self._release_test(workload)
            except BaseException:
                self.runtime_pool.close()
                raise
            self.released = released[workload.training[0].name]
        self.server_thread: ServerThread | None = None
        self.caller: AsgiCaller | HttpCaller
        if http:
            self.server_thread = ServerThread(
                self.workdir / "server.db",
                clock=lambda: self.loop.now,
                wall_clock=lambda: self.epoch + self.loop.now,
                verifier=self.attestation.verifier() if self.attestation is not None else None,
            ).start()
            self.store, self.service = self.server_thread.store, self.server_thread.service
            self.caller = HttpCaller(self.server_thread.url)
        else:
            self.store = ServerStore(self.workdir / "server.db")
            self.service = FLService(
                self.store,
                clock=lambda: self.loop.now,
                wall_clock=lambda: self.epoch + self.loop.now,
                rng=random.Random(config.fleet.seed),
                verifier=self.attestation.verifier() if self.attestation is not None else None,
                secagg_random_bytes=random.Random(config.fleet.seed ^ 0x5EC466).randbytes,
                token_bytes=random.Random(config.fleet.seed ^ 0x70CE45).randbytes,
                late_metrics_every_s=SERVER_LATE_METRICS_EVERY_S,
                dp_random=seeded_noise(config.fleet.seed),
            )
            keys, _ = AdminKeys.generate()
            self.caller = AsgiCaller(create_app(self.service, admin_keys=keys, offload=False, telemetry=False))
        # the attempt that seated each session, as the server knows it (a device is told the round's
        # number only): the session rows name their attempt with it (``with_attempts``)
        self.seated: dict[str, int] = {}
        self.service.on_seated = self._seated
        # the sessions whose reports the server counted (a masked input summed by a group whose
        # device was interrupted afterwards among them): their rows are ``summed``
        self.summed: set[str] = set()
        self.service.on_reported = self.summed.update
        self.service.create_population(self.population)
        specs_to_deploy = []
        for fleet_task in workload.tasks:  # what `fedfleet deploy` sends for each task of the bundle
            build, rel = fleet_task.build, released.get(fleet_task.name)
            specs_to_deploy.append(
                TaskSpec(
                    fleet_task.name,
                    rel.plan if rel is not None else build.plan_bytes,
                    None if fleet_task.evaluates else build.checkpoint,
                    fleet_task.rounds,
                    fleet_task.eligibility,
                    evaluates=fleet_task.evaluates,
                    versioned_plans=rel.versioned if rel is not None else {},
                    release_report=rel.report if rel is not None else None,
                )
            )
        try:
            self.service.deploy_tasks(self.population, specs_to_deploy, workload.strategy)
        except ApiError as exc:
            raise SimulationError(f"the server refuses the fleet's [task]: {exc.message}") from None

    def _release_test(self, workload: Workload) -> dict[str, ReleasedPlans]:
        """Each task release-tested on the fleet's releases, as ``fedfleet plan test`` tests it."""
        assert self.runtime_pool is not None
        releases = [v.version for v in self.config.runtime_versions]
        out: dict[str, ReleasedPlans] = {}
        by_name = {t.name: t for t in workload.tasks}
        for fleet_task in workload.tasks:
            build = fleet_task.build
            trained = None
            if fleet_task.evaluates is not None:
                source = by_name[fleet_task.evaluates].build
                trained = (source.plan, decode_checkpoint(source.checkpoint))
            out[fleet_task.name] = release_tested_plans(
                build.plan,
                decode_checkpoint(build.checkpoint),
                releases,
                self._test,
                self.runtime_pool,
                seed=self.config.fleet.seed,
                task=build.task,
                versioned=build.versioned,
                trained=trained,
            )
        return out

    def _cost_plan(self) -> None:
        """What ``self.plan`` costs a device (whatever plan the simulator holds): its simulated
        seconds per example and epoch on the reference phone, its peak memory, and the devices
        that cannot hold it or another plan the fleet serves (``served_costs``: a device refuses
        each at load; they do not take part, and the summary counts them). A fleet none of whose
        classes can hold them all is refused before it starts."""
        self.cost = plan_cost(self.plan)
        self.served = served_costs(self.workload, {self.plan.name: self.cost})
        self._seconds_per_example: dict[str, float] = {}
        self.compute_s_per_example = self._per_example(self.plan.name, self.cost)
        self.devices_short_of_memory = sum(1 for spec in self.specs if spec.takes_part and not self.takes_part(spec))
        try:
            refuse_a_plan_no_class_holds(self.config, self.served)
        except SimulationError:
            if self.runtime_pool is not None:
                self.runtime_pool.close()
            raise

    def _per_example(self, name: str, cost: PlanCost) -> float:
        """``[task] compute_s_per_example`` if set, else the plan's FLOPs per example over
        ``reference_flops_per_s``; kept by plan name."""
        task = self.config.task
        seconds = (
            task.compute_s_per_example
            if task.compute_s_per_example is not None
            else cost.compute_s_per_example(task.reference_flops_per_s)
        )
        self._seconds_per_example[name] = seconds
        return seconds

    def examples(self, spec: Any) -> Any:
        """The examples of the device ``spec`` (``Workload.device_examples`` unless given)."""
        return self._examples(spec)

    def seconds_per_example(self, plan: Any) -> float:
        """Simulated seconds of one example for one epoch of ``plan`` on the reference phone: the
        simulator's plan's (its versions for older releases keep its name and cost), or another
        plan's own count the first time a device trains it."""
        seconds = self._seconds_per_example.get(plan.name)
        return seconds if seconds is not None else self._per_example(plan.name, plan_cost(plan))

    def takes_part(self, spec: Any) -> bool:
        """The device runs the FL runtime (above the fleet's memory floor) and its memory holds
        every plan the fleet serves (``PlanCost.fits``: the runtime refuses a plan whose declared
        budget exceeds it or whose one batch exceeds its share for examples, and one whose peak
        exceeds it would not run), so that no device is seated for a task whose plan it refuses."""
        return bool(spec.takes_part) and all(cost.fits(spec.memory_mb) for cost in self.served.values())

    def plan_summary(self) -> dict[str, Any]:
        """The plan's cost as the run's summary shows it."""
        return {**self.cost.summary(), "compute_s_per_example": self.compute_s_per_example}

    # ----------------------------------------------------------------- bookkeeping from devices
    def canary_report(self, canary: int) -> Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """The audit's canary ``canary`` reports its direction (``audit.canary_direction`` of the
        fleet's seed) scaled to the task's clip, in place of the weights' part of its trained update
        (which holds (w_final - w_initial) x n, so the direction is multiplied by n too); its metric
        sums and example count stay what training gave, so the server sees an ordinary report."""
        dp = self.workload.training[0].rounds.dp
        clip = dp.clip if dp is not None else 1.0
        seed = self.config.fleet.seed

        def report(plan: Any, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            names = [w for w in plan.weight_names if w in update]
            if not names:  # an evaluation plan's update: nothing to replace
                return update
            shapes = {w: update[w].shape for w in names}
            dim = sum(int(np.prod(shape)) for shape in shapes.values())
            n = float(np.asarray(update.get(NUM_EXAMPLES, 1)).reshape(-1)[0])
            parts = audit.unflatten(audit.canary_direction(seed, canary, dim) * clip * n, shapes, names)
            return {**update, **{w: parts[w].astype(update[w].dtype) for w in names}}

        return report

    def set_status(self, device: SimDevice, status: str) -> None:
        if device.status != status:
            self.status_counts[device.status] -= 1
            self.status_counts[status] += 1
            device.status = status

    def add_session(self, row: SessionRow) -> None:
        self.sessions.append(row)

    def _seated(self, session_id: str, task: str, number: int, attempt: int) -> None:
        self.seated[session_id] = attempt

    def count_error(self, kind: str) -> None:
        self.errors[kind] += 1

    # ----------------------------------------------------------------- the run
    def start_devices(self, owns: Callable[[int], bool] | None = None) -> None:
        """Build and start the devices that take part; with ``owns`` only those whose position
        in ``specs`` it accepts (a shard's), each starting when it would in the whole fleet."""
        spread = random.Random(self.config.fleet.seed ^ 0x57A27)
        with long_lived_heap():  # the fleet is built to last: no full collections while it grows
            for position, spec in enumerate(self.specs):
                at = spread.uniform(0.0, min(START_SPREAD_S, self.horizon_s))
                if not self.takes_part(spec) or (owns is not None and not owns(position)):
                    continue
                device = SimDevice(self, spec)  # its examples are read when it first trains
                self.devices.append(device)
                self.status_counts[STATUS_IDLE] += 1
                device.start(at)

    def run(self) -> FleetRun:
        started = time.perf_counter()
        if self.fibers.hub is not greenlet.getcurrent():
            raise SimulationError("run() must be called from the thread and greenlet that built the simulator")
        try:
            try:
                with long_lived_heap():
                    self.start_devices()
                    self.loop.call_at(0.0, self._tick, order=ORDER_SERVER)
                    self.loop.call_at(0.0, self._sample, order=ORDER_SAMPLE)
                    self.loop.run_until(self.horizon_s)
                    self.end_sessions()
                self.service.tick()
                if self.progress is not None:  # the count on record: a task may have completed since the last sample
                    counts = self.status_counts
                    training = {t.name for t in self.workload.training}
                    committed = sum(
                        r["status"] == "committed" and r["task"] in training
                        for r in self.service.rounds(self.population)
                    )
                    self.progress(self.horizon_s, committed, counts[STATUS_CHECKING_IN] + counts[STATUS_PARTICIPATING])
            finally:
                self.fibers.close()
            wall = time.perf_counter() - started
            rounds, digest = self._rounds()
        finally:  # also when the run is interrupted (Ctrl-C)
            self.close()
        return FleetRun(
            sessions=self.sessions,
            rounds=rounds,
            timeline=self._timeline(),
            digest=digest,
            config=self.config,
            wall_s=wall,
            simulated_s=self.horizon_s,
            errors=dict(sorted(self.errors.items())),
            extra=self.extra,
            devices_short_of_memory=self.devices_short_of_memory,
            plan_cost=self.plan_summary(),
        )

    def end_sessions(self) -> None:
        """The rows of the sessions the run's end cuts (devices seated and not yet answered their
        report), one per device in the fleet's order, each as an event at the horizon after every
        other (what a sharded run merges its shards' rows by)."""
        loop = self.loop
        for device in self.devices:
            if device.status == STATUS_PARTICIPATING:
                loop.now, loop.order, loop.key = self.horizon_s, ORDER_END, device.key
                device.record_unfinished(self.horizon_s)

    def close(self) -> None:
        """Close the server's app loop, the release workers, the HTTP server and the database:
        nothing of the run is left open (safe to call more than once)."""
        self.caller.close()
        if self.runtime_pool is not None:
            self.runtime_pool.close()
        if self.server_thread is not None:
            self.server_thread.stop()
        else:
            self.store.close()

    def _tick(self) -> None:
        self.service.tick()
        nxt = self.loop.now + SERVER_TICK_S
        if nxt <= self.horizon_s:
            self.loop.call_at(nxt, self._tick, order=ORDER_SERVER)

    def _sample(self) -> None:
        now = self.loop.now
        status = self.service.population_status(self.population, published=False)
        current = status.get("current_round") or {}
        active = max(
            0, int(current.get("selected", 0)) - int(current.get("reported", 0)) - int(current.get("dropped", 0))
        )
        counts = self.status_counts
        self.timeline_rows.append((now, counts[STATUS_CHECKING_IN], counts[STATUS_PARTICIPATING], active))
        if self.progress is not None:
            for task in status.get("active_tasks", ()):  # a completed task keeps the count it was last seen at
                if task["kind"] == "train":
                    self.committed_seen[task["name"]] = task["committed_rounds"]
            committed = sum(self.committed_seen.values())
            self.progress(now, committed, counts[STATUS_CHECKING_IN] + counts[STATUS_PARTICIPATING])
        nxt = now + TIMELINE_STEP_S
        if nxt <= self.horizon_s:
            self.loop.call_at(nxt, self._sample, order=ORDER_SAMPLE)

    # ----------------------------------------------------------------- the tables
    def _timeline(self) -> list[TimelineRow]:
        times = [row[0] for row in self.timeline_rows]
        available = _count_available([d.spec.availability for d in self.devices], times)
        resting = self._resting(times)
        return [
            TimelineRow(t_s=t, available=int(a), checking_in=c, participating=p, active_sessions=s, resting=r)
            for (t, c, p, s), a, r in zip(self.timeline_rows, available, resting)
        ]

    def _resting(self, times: list[float]) -> list[int]:
        """At each time, the available devices waiting out their participation job's interval
        (``MIN_INTERVAL_S``) after a session that ended within it before: a completed one or one
        whose report was refused (after an interruption or an error a job comes back sooner).
        A floor: the scheduler jitters the interval longer."""
        availability = {d.spec.device_id: d.spec.availability for d in self.devices}
        ends = sorted((s.end_s, s.device_id) for s in self.sessions if s.accepted and s.outcome in WAITING_OUTCOMES)
        keys = [e for e, _ in ends]
        out = []
        for t in times:
            lo, hi = bisect.bisect_right(keys, t - MIN_INTERVAL_S), bisect.bisect_right(keys, t)
            waiting = {device for _, device in ends[lo:hi]}
            out.append(sum(1 for device in waiting if device in availability and _available(availability[device], t)))
        return out

    def _rounds(self) -> tuple[list[RoundRow], str]:
        """The round table, the committed models measured on the test split with their task's
        evaluation plan (all of them, or past ``MEASURED_ROUNDS`` a sample: ``MeasuredRounds``),
        and the digest; ``extra`` gets the last measured model's per-client accuracy on the test
        clients, and what ran (``Workload.info``). The session rows get the attempt that seated
        each of them first (``with_attempts``, which also marks those whose reports the server
        counted), and a seat's rows become one (``one_row_per_seat``: a device killed and checked
        in again to its seat), which the rounds' bytes and the audit read; the
        attempt still open at the end is a row of outcome unfinished (``unfinished_rounds``)."""
        self.sessions = one_row_per_seat(with_attempts(self.sessions, self.seated, self.summed))
        records = self.service.rounds(self.population, published=False)  # the fleet's own measure, counts and all
        evaluators = {t.name: PlanExecutor(t.eval_plan) for t in self.workload.training if t.eval_plan is not None}
        test = self._test
        n = len(next(iter(test.values()))) if test else 0
        batches = [{k: v[i : i + 256] for k, v in test.items()} for i in range(0, n, 256)]
        digest = hashlib.sha256()
        rows = []
        last: tuple[PlanExecutor, dict[str, np.ndarray]] | None = None
        trained = self.workload.training[0]
        final: bytes | None = None  # the training task's last committed model (the audit's)
        dp_metrics: dict[str, Any] | None = None  # its last committed round's privacy figures
        measuring = MeasuredRounds(
            Counter(r["task"] for r in records if r["status"] == "committed" and r.get("checkpoint_id")),
            self.config.task.target_accuracy,
        )
        for record in records:
            m = record["metrics"]
            digest.update(json.dumps(_digest_view(record), sort_keys=True, separators=(",", ":")).encode())
            if record["task"] == trained.name and "dp_rounds" in m:  # committed, or abandoned after a
                dp_metrics = m  # group's noisy sum was unmasked: the round spent privacy either way
            accuracy = loss = math.nan
            if record["status"] == "committed" and record.get("checkpoint_id"):
                model = self.store.get_resource(record["checkpoint_id"])
                assert model is not None
                digest.update(model)
                if record["task"] == trained.name:
                    final = model
                evaluator = evaluators.get(record["task"])
                if evaluator is not None and batches and measuring.due(record["task"]):
                    weights = decode_checkpoint(model)
                    measured = evaluator.evaluate(weights, batches)
                    accuracy, loss = float(measured.get("eval_accuracy", math.nan)), float(measured["eval_loss"])
                    measuring.measured(record["task"], accuracy)
                    last = (evaluator, weights)
            reported = int(m.get("reported", 0))
            rows.append(
                RoundRow(
                    round_id=f"{record['task']}/{record['round']}/{record['attempt']}",
                    task=record["task"],
                    start_s=round(record["started_at"] - self.epoch, 6),
                    end_s=round(record["ended_at"] - self.epoch, 6),
                    committed=record["status"] == "committed",
                    selected=int(m.get("selected", 0)),
                    reported=reported + int(m.get("rejected_late", 0)),
                    accepted=reported,
                    dropped=int(m.get("dropped", 0)),
                    duration_s=float(m.get("duration_s", record["ended_at"] - record["started_at"])),
                    accuracy=accuracy,
                    loss=loss,
                    epsilon=_number(m.get("epsilon")),
                    outcome=str(record["status"]),
                )
            )
        self.extra = {
            **self.workload.info(),
            "client_accuracy_percentiles": self._per_client(last),
            "round_config": trained.rounds,
            "device_min_interval_s": MIN_INTERVAL_S,
            "secure_rounds": {
                f"{r['task']}/{r['round']}/{r['attempt']}": r["metrics"]["secagg"]
                for r in records
                if "secagg" in r["metrics"]
            },
            "dp": privacy_figures(trained.rounds.dp, dp_metrics),
            "tasks_completed_s": self._completed_at(rows),
            "chance_accuracy": majority_share(self._test.get(getattr(self.workload.data, "label", "y"))),
            **self._audit(trained, final, rows),
        }  # what the server ran, for the notes
        rows += unfinished_rounds(rows, self.sessions, self.horizon_s)  # the attempt the run's end cut
        return with_round_bytes(rows, self.sessions), digest.hexdigest()

    def _completed_at(self, rounds: list[RoundRow]) -> float | None:
        """When the last of the fleet's tasks completed (its ``max_rounds``, or its privacy budget),
        the end of the last round; None while a task is still running at the end of the run."""
        states = self.service.task_states(self.population)
        if not states or any(state.get("status") != "completed" for state in states.values()):
            return None
        return max((r.end_s for r in rounds), default=0.0)

    def _audit(self, trained: Any, final: bytes | None, rounds: list[RoundRow]) -> dict[str, Any]:
        """The one-shot audit of the training task's final model (``audit_epsilon``, and the
        estimate's parts), when the fleet has canaries: None when no round committed or fewer than
        two canaries had a report summed. A canary's reports count where they were accepted in a
        round that committed (``audit.per_participation``)."""
        canaries = self.config.dp.audit_canaries
        if not canaries:
            return {}
        dp = trained.rounds.dp
        committed = {r.round_id for r in rounds if r.committed}
        counts = np.zeros(canaries)
        for session in self.sessions:
            if session.device_id.startswith(CANARY_PREFIX) and session.outcome == "completed":
                if session.round_attempt in committed:
                    counts[int(session.device_id.removeprefix(CANARY_PREFIX))] += 1
        estimate = None
        if final is not None and dp is not None and (counts > 0).sum() >= 2:
            names = list(trained.plan.weight_names)
            initial = audit.flatten(decode_checkpoint(trained.build.checkpoint), names)
            estimate = audit.audit(
                initial,
                audit.flatten(decode_checkpoint(final), names),
                seed=self.config.fleet.seed,
                canaries=canaries,
                delta=dp.delta,
                participations=counts,
            )
        return {
            "audit_canaries": canaries,
            "audit_reports": int(counts.sum()),
            "audit_epsilon": None if estimate is None else _finite_or_none(estimate.epsilon),
            "audit": None
            if estimate is None
            else {
                "mean_cosine": estimate.mean,
                "std_cosine": estimate.std,
                "noise_multiplier": _finite_or_none(estimate.noise_multiplier),
                "null_mean_cosine": estimate.null_mean,
                "null_std_cosine": estimate.null_std,
                "delta": estimate.delta,
            },
        }

    def _per_client(self, last: tuple[PlanExecutor, dict[str, np.ndarray]] | None) -> dict[str, Any] | None:
        """p10/p50/p90 of the model's accuracy over the test clients (LEAF's and FedScale's figure)."""
        if last is None:
            return None
        evaluator, weights = last
        correct: dict[str, int] = {}
        total: dict[str, int] = {}
        for client, examples in self.workload.test_clients().items():
            count = len(next(iter(examples.values())))
            measured = evaluator.evaluate(
                weights, [{k: v[i : i + 256] for k, v in examples.items()} for i in range(0, count, 256)]
            )
            if "eval_accuracy" not in measured:
                return None  # a regression task: no accuracy
            total[client] = count
            correct[client] = int(round(measured["eval_accuracy"] * count))
        if not total:
            return None
        return client_accuracy_percentiles(correct, total).as_dict()


class MeasuredRounds:
    """Which committed models of a run are measured on the test split, in the order the rounds
    ran. A task with at most ``MEASURED_ROUNDS`` committed rounds has every one measured. A task
    with more has every one measured until a model reaches the run's target accuracy (so the time
    to it stays exact; from the start without a target), then every k-th committed round, k being
    its committed rounds over ``MEASURED_ROUNDS`` rounded up, and always its last (the summary's
    ``accuracy``): a day of 10,000 devices commits some 6,000 models, and measuring each one
    (8.5 ms on the glyphs task's 1,974 test examples, 21 ms on Shakespeare's 21,991) cost a
    seventh and a quarter of what the fleet spent beyond its sessions' training. ``committed``:
    each task's committed rounds (with a model)."""

    def __init__(self, committed: Mapping[str, int], target: float | None) -> None:
        self.committed = dict(committed)
        self.every = {task: max(1, math.ceil(n / MEASURED_ROUNDS)) for task, n in self.committed.items()}
        self.target = target
        self.seen: Counter[str] = Counter()
        self.reached: set[str] = set()

    def due(self, task: str) -> bool:
        """Whether the next committed model of ``task`` is measured (call once per committed round)."""
        self.seen[task] += 1
        n, every = self.seen[task], self.every.get(task, 1)
        searching = self.target is not None and task not in self.reached
        return every == 1 or searching or n % every == 0 or n == self.committed.get(task, 0)

    def measured(self, task: str, accuracy: float) -> None:
        """The model just measured had ``accuracy`` (NaN without one)."""
        if self.target is not None and accuracy >= self.target:
            self.reached.add(task)


def _digest_view(record: dict) -> dict:
    """What the digest covers of a round record: all of it but the order-statistics sketches
    (DataSketches' KLL compaction draws its own random bits once a round has hundreds of reports)."""
    metrics = {k: v for k, v in record["metrics"].items() if k != "device_metrics"}
    return {**record, "metrics": metrics}


def served_costs(workload: Workload, known: Mapping[str, PlanCost] | None = None) -> dict[str, PlanCost]:
    """What each plan the fleet serves costs a device, by task name: every task's plan (training
    and evaluation tasks, every task of a group), each of which a device checks against its memory
    when it loads it. ``known``: costs already counted, by plan name."""
    by_plan = dict(known or {})
    out = {}
    for fleet_task in workload.tasks:
        plan = fleet_task.plan
        if plan.name not in by_plan:
            by_plan[plan.name] = plan_cost(plan)
        out[fleet_task.name] = by_plan[plan.name]
    return out


def refuse_a_plan_no_class_holds(config: FleetConfig, costs: Mapping[str, PlanCost]) -> None:
    """:class:`SimulationError` when no device class above ``fleet.min_memory_mb`` can hold every
    plan of these ``costs`` (by task name, ``served_costs``): no device would take part. A class
    that holds a plan holds it with more memory too, so the class of the most memory is the one
    to ask."""
    floor = config.fleet.min_memory_mb
    most = max((c.memory_mb for c in config.device_classes if c.memory_mb >= floor), default=0)
    for name, cost in costs.items():
        if not cost.fits(most):
            _refuse(cost, most, f" of task {name!r}" if len(costs) > 1 else "")


def _refuse(cost: PlanCost, most: int, which: str) -> None:
    """The refusal of a plan of ``cost`` (``which``: the task it is of) that ``most`` MB cannot hold."""
    batch = (
        f" (one batch of {cost.batch_size:,} examples takes {cost.fed_batch_bytes / MB:.4g} MB, and a device "
        "gives a batch an eighth of its memory)"
        if cost.least_memory_mb > cost.memory_mb
        else ""
    )
    raise SimulationError(
        f"no device class can hold the plan{which}: it needs {cost.least_memory_mb:.4g} MB{batch} and the classes above "
        f"fleet.min_memory_mb give at most {most} MB; add a class with more memory_mb or make the model "
        f"{'or the batch ' if batch else ''}smaller"
    )


def peak_available(specs: Sequence[Any], horizon_s: float) -> int:
    """The most devices of ``specs`` that take part available at once, at the timeline's samples
    (the figure the run's summary reads from its timeline)."""
    times = [k * TIMELINE_STEP_S for k in range(int(horizon_s // TIMELINE_STEP_S) + 1)]
    return max(_count_available([s.availability for s in specs if s.takes_part], times), default=0)


#: A device's ``DeviceClass.max_training_s`` in a fleet whose report windows are all shorter.
MAX_TRAINING_S = 600.0


def device_max_training_s(workload: Workload) -> float:
    """How long the fleet's devices train before they are stopped by force (their
    ``DeviceClass.max_training_s``, for a plan that declares no time budget): ``MAX_TRAINING_S``,
    or the longest report window of the workload's tasks if longer."""
    return max(MAX_TRAINING_S, *(t.rounds.report_timeout_s for t in workload.tasks))


#: Devices sampled for :func:`session_compute`'s median.
COMPUTE_SAMPLE = 101


def session_compute(workload: Workload, specs: Sequence[Any], config: FleetConfig) -> tuple[float, float, int, float]:
    """(the median training time of a session in simulated seconds, the median device's examples,
    the plan's epochs, seconds per example on the reference phone) of the first training task, over
    up to ``COMPUTE_SAMPLE`` of the devices that take part, evenly spaced: what a device's
    ``trained`` will charge, estimated before the run."""
    plan = workload.training[0].plan
    task = config.task
    per_example = (
        task.compute_s_per_example
        if task.compute_s_per_example is not None
        else plan_cost(plan).compute_s_per_example(task.reference_flops_per_s)
    )
    taking_part = [s for s in specs if s.takes_part]
    sample = taking_part[:: max(1, len(taking_part) // COMPUTE_SAMPLE)][:COMPUTE_SAMPLE]
    if not sample:
        return 0.0, 0.0, plan.device.epochs, per_example
    sizes = [len(next(iter(raw.values()), ())) for raw in (workload.data.train(s) for s in sample)]
    times = [n * plan.device.epochs * per_example * s.speed for n, s in zip(sizes, sample)]
    return float(np.median(times)), float(np.median(sizes)), plan.device.epochs, per_example


#: Session outcomes after which a device's participation job waits ``MIN_INTERVAL_S`` to run again.
WAITING_OUTCOMES = ("completed", "report_rejected")


def _available(availability: Any, t: float) -> bool:
    """Idle, charging and unmetered at ``t`` (the paper's training conditions)."""
    state = availability.state_at(t)
    return bool(state.idle and state.charging and state.unmetered_network)


def _count_available(availabilities: list[Any], times: list[float]) -> list[int]:
    """Devices whose availability (idle, charging, unmetered) holds at each time."""
    if not times:
        return []
    try:
        from .availability import count_available

        return [int(v) for v in count_available(availabilities, times)]
    except (AttributeError, TypeError):  # an availability without intervals (a replayed trace, say)
        out = []
        for t in times:
            n = 0
            for a in availabilities:
                n += _available(a, t)
            out.append(n)
        return out


def simulate(
    config: FleetConfig | None = None,
    out_dir: str | Path | None = None,
    progress: bool | Callable = True,
    *,
    http: bool = False,
    notice: Callable[[str], None] | None = None,
) -> FleetRun:
    """Run the fleet ``config`` describes (the paper-calibrated defaults when None). With
    ``out_dir`` the tables, summary, plots and report are written there. ``progress``: True for
    a progress bar in simulated time, or a callable ``(t_s, rounds_committed, devices_active)``.
    ``http``: the same fleet over real loopback HTTP (see ``FleetSimulator``). ``notice`` is told,
    before the run starts, when its fleet cannot fill a round at all (``report.cannot_fill``)."""
    from .federated_data._errors import physical_memory
    from .population import generate_population

    config = config or FleetConfig.default()
    workload = load_workload(config)
    line = fleet_memory_line(config.fleet.devices, physical_memory())  # before minutes spent on the devices
    if line is not None and line.startswith("a fleet of"):
        raise SimulationError(line)
    if line is not None and notice is not None:
        notice(line)
    specs = generate_population(config)
    bar, callback = progress_reporter(progress, config.horizon_s)
    from .report import clear_run, earlier_server

    left = earlier_server(out_dir)  # before the simulator replaces it
    with tempfile.TemporaryDirectory(prefix="fedfleet-sim-") as tmp:
        workdir = Path(out_dir) / "server" if out_dir is not None else Path(tmp)
        try:
            # the server takes the tasks first: a [task] it refuses is the one line, not after a notice
            sim = FleetSimulator(config, specs, workdir=workdir, progress=callback, http=http, workload=workload)
            if notice is not None:
                notify_before_run(config, workload, specs, notice)
            if out_dir is not None:  # the server took the tasks: the run replaces an earlier one's files
                replaced = clear_run(out_dir, server_left=left)
                if replaced is not None and notice is not None:
                    notice(replaced)
            run = sim.run()
        finally:
            if bar is not None:
                bar.close()
    if out_dir is not None:
        from . import report

        writer = getattr(report, "write_report", None)
        if writer is not None:
            writer(run, out_dir)
        else:
            run.write_tables(out_dir)
    return run


#: A fleet's memory before its first round, measured (`fedfleet simulate` of the default fleet, 0.05
#: hours, on 2 cores, Python 3.12): 20,000 devices 0.23 GB, 100,000 0.44 GB, 1,000,000 2.72 GB at
#: their peak: about 2.6 kB a device (its spec, its availability's arrays and its wake-up on the
#: loop) over a base of the process, its libraries and the task. A device that wakes carries about
#: 2.8 kB more (``sim_device.RELEASE_AFTER_JOBS``), and each session a row.
FLEET_BASE_BYTES = 180 * 2**20
DEVICE_BYTES = 2_600
#: Fleets from this size are told their memory before the run, which takes minutes to set up.
TOLD_DEVICES = 200_000


def fleet_memory_line(devices: int, memory: int | None) -> str | None:
    """A fleet's memory before its first round, in a line: a refusal (starting ``a fleet of``)
    when it exceeds ``memory`` (the machine's, None when unknown), a notice from
    ``TOLD_DEVICES`` devices, else None."""
    need = FLEET_BASE_BYTES + devices * DEVICE_BYTES
    if memory is not None and need > memory:
        most = max(0, (memory - FLEET_BASE_BYTES) // DEVICE_BYTES)
        return (
            f"a fleet of {devices:,} devices needs about {need / 1e9:.3g} GB of memory before its first round (about "
            f"{DEVICE_BYTES / 1000:g} kB a device), more than this machine's {memory / 1e9:.3g} GB; simulate at most "
            f"about {most // 1000 * 1000:,} --devices here"
        )
    if devices >= TOLD_DEVICES:
        return (
            f"{devices:,} devices take about {need / 1e9:.3g} GB of memory and minutes to set up before the run starts "
            f"(about {DEVICE_BYTES / 1000:g} kB a device, and 2.8 kB more for each that has taken part)"
        )
    return None


def notify_before_run(
    config: FleetConfig, workload: Workload, specs: Sequence[Any], notice: Callable[[str], None]
) -> None:
    """Tell ``notice``, before the run, what its fleet will meet: no round can fill
    (``summary.cannot_fill``), or the median session outlasts the report window
    (``summary.slow_sessions``: a session's training as long as a device trains before it is
    stopped, ``device_runtime.training_limit``). A fleet refused outright (no device class holds the plan) raises
    :class:`SimulationError` first, and is told nothing else."""
    from .summary import cannot_fill, slow_sessions

    refuse_a_plan_no_class_holds(config, served_costs(workload))
    rounds = workload.training[0].rounds
    unfillable = cannot_fill(config.fleet.devices, peak_available(specs, config.horizon_s), rounds)
    if unfillable is not None:
        notice(unfillable)
    plan = workload.training[0].plan
    slow = slow_sessions(
        *session_compute(workload, specs, config),
        config.task,
        rounds.report_timeout_s,
        training_limit(plan, device_max_training_s(workload))[0],
        plan.metadata.time_budget_s is not None,
    )
    if slow is not None:
        notice(slow)


def seeded_noise(seed: int) -> Callable[[], np.random.Generator]:
    """The simulated server's central DP noise: a new generator per round from the fleet's seed
    (children of one seed sequence), so a run repeats; a deployed server seeds each from ``secrets``."""
    sequence = np.random.SeedSequence([seed, 0xD9015E])
    return lambda: np.random.default_rng(sequence.spawn(1)[0])


def _number(value: Any) -> float:
    """A metric as a float: NaN when the round has none (JSON null), inf for an unbounded epsilon."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def privacy_figures(dp: Any, metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The run's privacy as the summary shows it: None without DP; else the task's mode, delta,
    noise multiplier and clip, and the epsilon and DP rounds its last round that spent privacy published
    (0 and 0 before any; epsilon null when unbounded, a noise multiplier of 0)."""
    if dp is None:
        return None
    m = metrics or {}
    eps = _number(m.get("epsilon", 0.0))
    return {
        "mode": m.get("dp_mode", dp.mode),
        "epsilon": _finite_or_none(eps),
        "delta": float(m.get("delta", dp.delta)),
        "dp_rounds": int(m.get("dp_rounds", 0)),
        "noise_multiplier": float(m.get("noise_multiplier", dp.noise_multiplier)),
        "clip": float(m.get("dp_clip", dp.clip)),
        "max_epsilon": dp.max_epsilon,
        "counts": getattr(dp, "counts", "public"),
    }


def progress_reporter(
    progress: bool | Callable[[float, int, int], None], horizon_s: float
) -> tuple[ProgressBar | None, Callable[[float, int, int], None] | None]:
    """``simulate``'s ``progress`` argument as (the bar to close, if one was made; the callback)."""
    if callable(progress):
        return None, progress
    if progress:
        bar = ProgressBar(horizon_s)
        return bar, bar
    return None, None


class ProgressBar:
    """A rich progress bar on stderr in simulated hours, with rounds committed and devices
    active; stdout stays free for the run's summary. Call it as ``simulate``'s ``progress``. It is
    drawn from the run's first tick: a fleet refused while it is set up (a trace that does not
    read, a [task] the server refuses) ends in its one line, not after an empty bar. On a stderr
    that is no terminal (a log file, a CI job), where rich draws nothing until the end, it writes
    one line each simulated hour instead (a day of 10,000 devices was minutes without a word)."""

    #: Simulated seconds between two lines on a stderr that is no terminal.
    LINE_EVERY_S = 3600.0

    def __init__(self, horizon_s: float) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self._lines = not console.is_terminal
        self._horizon_s = horizon_s
        self._next_line_s = 0.0  # a first line as the run starts
        self._progress = Progress(
            TextColumn("simulated {task.fields[hours]:>6.2f} h"),
            BarColumn(),
            TextColumn("rounds committed {task.fields[rounds]:>5d}  devices active {task.fields[active]:>6d}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._task = self._progress.add_task("simulate", total=horizon_s, hours=0.0, rounds=0, active=0)
        self.started = False
        self._began = time.monotonic()
        self._last: tuple[float, int, int] | None = None
        self._said_s = -1.0

    def __call__(self, t_s: float, rounds: int, active: int) -> None:
        if self._lines:
            self.started = True
            self._last = (t_s, rounds, active)
            if t_s >= self._next_line_s:
                self._line(t_s, rounds, active)
                while self._next_line_s <= t_s:
                    self._next_line_s += self.LINE_EVERY_S
            return
        if not self.started:
            self._progress.start()
            self.started = True
        self._progress.update(self._task, completed=t_s, hours=t_s / 3600.0, rounds=rounds, active=active)

    def _line(self, t_s: float, rounds: int, active: int) -> None:
        self._said_s = t_s
        print(
            f"simulated {t_s / 3600.0:.2f} h of {self._horizon_s / 3600.0:.2f}: rounds committed {rounds}, "
            f"devices active {active} ({time.monotonic() - self._began:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._lines and self._last is not None and self._last[0] > self._said_s:
            self._line(*self._last)  # where the run ended, between two hours' lines
        elif self.started and not self._lines:
            self._progress.stop()
