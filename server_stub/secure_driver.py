"""Driving a round's Secure Aggregation (``secure_rounds.SecureRound``, the ``secagg`` state
machines) from the service: forming the groups once selection is over, adding each finished group's
checked sum to the round (the Master Aggregator), and what a device asks of its group. Called under
the service's lock; the caller wakes long polls when ``SecureRound.version`` moved."""

from __future__ import annotations

import logging
from collections.abc import Callable

from secagg import DuplicateMessage, OutOfOrder, Round, SecAggError, UnexpectedClient

from . import ddp_rounds
from .admission import with_window
from .errors import BadRequest, Conflict, SessionClosed
from .influence import check_group_sum, hold_metric_sums
from .rounds import Phase, RoundCore, SessionState
from .secure_rounds import SecureRound
from .service_state import Population, Session, TaskRun

log = logging.getLogger(__name__)

#: Why a completed group's sum is left out of a round that closed before it came.
ROUND_CLOSED = "the round closed before its sum"


def advance_secure(
    run: TaskRun,
    core: RoundCore,
    secure: SecureRound,
    now: float,
    on_reported: Callable[[list[str]], None] | None = None,
) -> None:
    """Form the groups once selection is over; add each finished group's sum (the Master
    Aggregator), count its summed devices as reported (``on_reported`` is told which: a device
    interrupted after its masked input went in among them) and the rest of the group as dropped,
    so that the round need not wait for their deadlines. The groups that completed in this tick
    come first, so that another's aborts cannot close the round before their sums count; a sum
    that comes after its round closed all the same is dropped (``ROUND_CLOSED``), so that the
    round's statistics never count a sum it did not use. A sum outside the bounds honest
    devices keep (``check_group_sum``; under distributed DP ``ddp_rounds.sum_problem``) is
    dropped, its devices with it, and the reason kept for the round's metrics: one device's
    update is never seen, so its group answers for it.

    The groups are ticked before the round moves on: a group counts at the moment it ended (its
    last message, or the due time that closed it), so that a tick long after it (a server busy, or
    a process that was stopped) finds its round as it was then, not closed by the devices' deadlines
    that passed since. The round itself moves on afterwards (the caller's ``core.advance``)."""
    if not secure.formed:
        core.advance(now)
    if core.phase is Phase.REPORTING and not secure.formed:
        selected = [sid for sid, st in core.sessions.items() if st is SessionState.SELECTED]
        devices = {sid: device for device, sid in run.seats.get(run.seat_key, {}).items()}  # attested key hashes
        if not secure.form_groups(selected, now, core.deadlines, devices):
            log.info(
                "task %s round %d: %d devices, no SecAgg group of %d: %s",
                run.label,
                core.number,
                len(selected),
                secure.settings.min_group_size,
                secure.ddp_error or "too few",
            )
            for sid in selected:
                core.abort(sid, now)
    # the completed groups first: their devices count as reported before the others' aborts, which
    # may leave the round short of its threshold and close it
    finished = sorted(
        secure.tick(now),
        key=lambda g: (g.server.round is not Round.COMPLETED, g.ended_at if g.ended_at is not None else now),
    )
    for group in finished:
        summed: list[str] = []
        if group.server.round is Round.COMPLETED:
            total, summed = secure.group_sum(group)
            if secure.ddp_params is not None:  # distributed DP: every device weighs 1, the noise is in
                refused = ddp_rounds.sum_problem(total, run.plan.weight_names, secure.ddp_params, len(summed))
            else:
                refused = check_group_sum(
                    total,
                    run.plan.weight_names if run.is_training else (),
                    members=len(summed),
                    max_examples=run.config.max_examples_per_report,
                    clip_norm=run.config.clip_update_norm,
                    tolerance=secure.codec.sum_error(len(summed)),
                )
            if refused is not None:
                log.warning(
                    "task %s round %d: the sum of SecAgg group %d is dropped: %s",
                    run.label,
                    core.number,
                    group.index,
                    refused,
                )
                secure.drop(group, refused)
                summed = []
            elif core.confirm_group(summed, min(now, group.ended_at if group.ended_at is not None else now)):
                assert run.accumulator is not None
                run.accumulator = run.executor.accumulate(run.accumulator, hold_metric_sums(total, run.config.max_loss))
                if on_reported is not None:
                    on_reported(summed)
            else:  # the round closed first (its devices' deadlines, or another group reached its goal)
                secure.drop(group, ROUND_CLOSED)
                summed = []
        else:
            log.info(
                "task %s round %d: SecAgg group %d aborted: %s",
                run.label,
                core.number,
                group.index,
                group.server.abort_reason,
            )
        for sid in set(group.members) - set(summed):
            core.abort(sid, now)


def require_secure(run: TaskRun) -> None:
    """Refuse a Secure Aggregation call for a task without it, where its open round read as over."""
    if run.codec is None:
        raise Conflict(
            f"task {run.record.name!r} does not run Secure Aggregation, so this session is in no group: "
            "its update goes to /v1/sessions/{id}/report",
            code="NOT_IN_GROUP",
        )


def status(session: Session, pop: Population, run: TaskRun, now: float) -> dict:
    """The device's view of its group; after the round closed, its group's final state."""
    require_secure(run)
    if session.core is run.core and run.secure is not None:
        state = run.secure.status(session.session_id)
        state["deadline_in_s"] = round(max(0.0, session.core.deadline_of(session.session_id) - now), 3)
        return with_window(state, pop, run, now)
    for closed in run.closed:
        if closed.core is session.core and closed.secure is not None:
            state = closed.secure.status(session.session_id)
            # a group still running when its round closed will never finish
            return (
                with_window(state, pop, run, now)
                if state["status"] in ("completed", "aborted")
                else {"status": "closed"}
            )
    return {"status": "closed"}


def receive(session: Session, data: bytes, now: float) -> None:
    """Hand one Secure Aggregation message to the session's group (which may move on, taken or
    refused: ``SecureRound.version`` says so). Raises a 4xx ``ApiError`` for a message its group
    does not take; the same message again is taken again (``SecureGroup.receive``), another one
    for a round the device answered is ``SECAGG_ALREADY_ANSWERED``."""
    run = session.run
    require_secure(run)
    if run.secure is None or session.core is not run.core:
        raise SessionClosed("this session's round is over")
    if session.session_id not in run.secure.by_session:
        raise Conflict("this session is in no Secure Aggregation group (yet)", code="NOT_IN_GROUP")
    try:
        run.secure.receive(session.session_id, data, now)
    except DuplicateMessage as exc:  # another message for a round it answered: a device that restarted, say
        raise Conflict(
            f"this session already answered its group's round with another message: {exc}",
            code="SECAGG_ALREADY_ANSWERED",
        ) from None
    except (OutOfOrder, UnexpectedClient) as exc:
        raise Conflict(f"the group has moved past this message's round: {exc}", code="SECAGG_ROUND_CLOSED") from None
    except SecAggError as exc:
        raise BadRequest(f"the Secure Aggregation message was refused: {exc}", code="SECAGG_REJECTED") from None
