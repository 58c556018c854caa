"""The answers to a check-in: who is turned away, when to come back (pace steering, paper section
2.3), which seat an admitted device takes and what it is told. The population's state and the
clock's reading in, an answer out; called under the service's lock."""

from __future__ import annotations

from collections.abc import Callable

from device_runtime.versions import version_tuple
from device_runtime.wire import CheckinAccepted, CheckinRejected

from .rounds import SessionState
from .service_state import Population, SessionTable, TaskRun

#: Retry window for devices of a population that has nothing to train, as it starts to be idle.
IDLE_RETRY_WINDOW_S = (60.0, 180.0)
#: Pace steering of an idle population (no task, or all of its tasks completed): devices are asked
#: back after about this share of the time it has been idle, so that a population idle for an hour
#: is checked on every quarter of an hour, not every two minutes ...
IDLE_SHARE = 0.25
#: ... and at the latest after this long: a task deployed into a population idle for long is learnt
#: of within the hour (each device comes back at the time it drew in the last window it was told).
IDLE_RETRY_MAX_S = 3600.0
#: Retry window for a device whose onnxruntime release the task's plan does not serve: nothing
#: changes for it until another task is deployed, so it comes back in half an hour to an hour
#: (pace steering: as often as it may be needed, no more). A fleet in which a third of the
#: devices run older releases otherwise sends most of its check-ins from them.
VERSION_RETRY_WINDOW_S = (1800.0, 3600.0)


def no_open_round(pop: Population | None, now: float, idle_since: float) -> CheckinRejected:
    """The answer while the population has no round open: it does not exist (answered as a
    population with no task, so devices cannot probe which names exist), it gathers for its next
    selection, a round is being committed, or it has had no task since ``idle_since``."""
    if pop is None or not pop.runs:
        return rejected(idle_window(now - idle_since), "NO_TASK")
    if pop.opens_at is not None:  # a small population gathers for the next selection
        return rejected(told(pop, pop.runs[0], now, pop.opens_at), "ROUND_NOT_OPEN")
    last = pop.runs[0]  # a round is being committed
    if small(pop, last, now):
        return rejected(told(pop, last, now, pop.rendezvous.aimed_at or now), "ROUND_FULL")
    return rejected(last.pace.retry_window(now, now, paced(pop, last, now), last.config.report_timeout_s), "ROUND_FULL")


def idle_window(idle_s: float) -> tuple[float, float]:
    """The retry window of a population that has had no task for ``idle_s`` seconds:
    ``IDLE_RETRY_WINDOW_S`` at first, stretched so that its end is ``IDLE_SHARE`` of the time idle,
    up to ``IDLE_RETRY_MAX_S``. A device then checks in about ``1 / IDLE_SHARE`` times per doubling of
    the idle time (logarithmically, not at a steady rate) until the longest window, then once in
    its span."""
    lo, hi = IDLE_RETRY_WINDOW_S
    stretch = min(IDLE_RETRY_MAX_S / hi, max(1.0, IDLE_SHARE * idle_s / hi))
    return (lo * stretch, hi * stretch)


def plan_for(run: TaskRun, device_version: tuple[int, ...], eligibility: dict | None) -> str | CheckinRejected:
    """The id of the plan the device is served, or the rejection of a device the open round does
    not take: a release its plan does not serve, or eligibility not shown."""
    meta = run.plan.metadata
    plan_id = run.record.plan_id
    if run.versions:  # served per minor release: only the releases the report covers
        plan_id = run.versions.get(f"{device_version[0]}.{device_version[1]}", "")
        if not plan_id:
            return rejected(VERSION_RETRY_WINDOW_S, "RUNTIME_VERSION_NOT_CLAIMED")
    elif device_version < version_tuple(meta.min_runtime_version) or (
        meta.max_runtime_version is not None and device_version > version_tuple(meta.max_runtime_version)
    ):
        return rejected(VERSION_RETRY_WINDOW_S, "RUNTIME_VERSION_UNSUPPORTED")
    if not run.eligibility.empty:
        if not eligibility or eligibility.get("task") != run.record.name:
            return rejected(run.config.retry_window_s, "ELIGIBILITY_REQUIRED")
        if not eligibility.get("eligible"):
            failed = ",".join(str(f) for f in eligibility.get("failed", []))[:200]
            return rejected(IDLE_RETRY_WINDOW_S, f"INELIGIBLE:{failed}" if failed else "INELIGIBLE")
    return plan_id


def seat(
    pop: Population, run: TaskRun, device: bytes | None, now: float, sessions: SessionTable, new_id: Callable[[], str]
) -> str | CheckinRejected:
    """The id of the device's session in the open round (a new one from ``new_id``), or the
    rejection of a device the round has no seat for. One seat per attested device (``device``,
    its key's hash) and round, so its reports count as one device's: a device whose answer was
    lost checks in again and gets its seat back, under a new token (``sessions`` forgets the old
    one), while the seat is still open."""
    assert run.core is not None
    seats = run.seats.setdefault(run.seat_key, {}) if device is not None else {}
    if device is not None and device in seats:
        session_id = seats[device]
        if run.core.sessions.get(session_id) is not SessionState.SELECTED:
            return rejected(turned_away(pop, run, now), "ALREADY_SELECTED")
        sessions.forget_token(session_id)
        return session_id
    session_id = new_id()
    if not run.core.try_select(session_id, now):
        return rejected(turned_away(pop, run, now), "ROUND_FULL")
    if device is not None:
        run.seats = {run.seat_key: {**seats, device: session_id}}
    return session_id


def accepted(run: TaskRun, session_id: str, token: str, plan_id: str) -> CheckinAccepted:
    """The answer of a device the open round took: its session and what it downloads and sends."""
    extra: dict[str, object] = {}
    if run.secure is not None:  # H(seed) of the round's Secure Aggregation groups, shown before selection ends
        extra["secagg_commitment"] = run.secure.commitment_b64
    if run.codec is not None:  # under Secure Aggregation the device bounds its own update: it must know the bounds
        extra["max_examples_per_report"] = run.config.max_examples_per_report
        extra["clip_update_norm"] = run.config.clip_update_norm
    return CheckinAccepted(
        status="accepted",
        session_id=session_id,
        token=token,
        task=run.record.name,
        round=run.round_number,
        plan_id=plan_id,
        checkpoint_id=run.broadcast_id,
        aggregation="secure_sum" if run.plan.server.secure_sum else "simple",
        report_deadline_s=run.config.report_timeout_s,
        max_report_bytes=run.report_limit,
        **extra,  # type: ignore[arg-type]
    )


def turned_away(pop: Population, run: TaskRun, now: float) -> tuple[float, float]:
    """The retry window of a device the open round has no seat for: in a small population, a
    rendezvous at the next round's expected opening (``Rendezvous``); otherwise the task's
    window stretched to the population and shifted to that opening (``CheckinPace``, ``RoundPace``)."""
    core = run.core
    assert core is not None
    if small(pop, run, now):
        if core.selection_ended_at is not None:
            opens_at = core.selection_ended_at + (run.pace.mean_reporting_s or run.config.report_timeout_s)
        else:
            opens_at = core.started_at + (run.pace.mean_duration_s or run.config.selection_timeout_s)
        return told(pop, run, now, opens_at)
    cap = run.config.selection_timeout_s + run.config.report_timeout_s
    return run.pace.retry_window(now, core.started_at, paced(pop, run, now), cap)


def paced(pop: Population, run: TaskRun, now: float) -> tuple[float, float]:
    """The task's retry window stretched to the population checking in (``CheckinPace``)."""
    cfg = run.config
    round_s = run.pace.mean_reporting_s or cfg.report_timeout_s
    return pop.checkins.window(now, cfg.retry_window_s, cfg.selection_target, round_s)


def small(pop: Population, run: TaskRun, now: float) -> bool:
    """Whether the population checks in too slowly of itself to fill ``run``'s rounds (``Rendezvous``)."""
    return pop.rendezvous.small(now, run.config.selection_target, run.config.selection_timeout_s)


def told(pop: Population, run: TaskRun, now: float, opens_at: float) -> tuple[float, float]:
    """The rendezvous window of a device turned away while the next selection opens at ``opens_at``."""
    return pop.rendezvous.tell(now, opens_at, run.config.selection_target, run.config.selection_timeout_s)


def participant_window(pop: Population, run: TaskRun, now: float) -> dict:
    """What a device whose update was taken is told: while pace steering spreads the population
    out, participants are spread too (told nothing, they would come back at their own cooldown
    and be turned away); otherwise nothing, and they keep their own pace."""
    window = paced(pop, run, now)
    return {"retry_after_s": retry_after(window)} if window[1] > run.config.retry_window_s[1] else {}


def with_window(state: dict, pop: Population, run: TaskRun, now: float) -> dict:
    """A Secure Aggregation state; a device its completed group summed gets its pace window."""
    if state.get("status") == "completed" and state.get("included"):
        state.update(participant_window(pop, run, now))
    return state


def retry_after(window: tuple[float, float]) -> tuple[float, float]:
    """A retry window as answers carry it (``retry_after_s``)."""
    return float(window[0]), float(window[1])


def rejected(window: tuple[float, float], reason: str) -> CheckinRejected:
    """A device turned away, with the window it comes back in and why (its stable code)."""
    return CheckinRejected(status="rejected", reason=reason, retry_after_s=retry_after(window))
