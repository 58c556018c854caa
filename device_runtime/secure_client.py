"""The device's side of Secure Aggregation over HTTP: it polls its session's mailbox, feeds the
server's messages to its SecAggClient state machine and posts the replies.

As in the paper (section 6), the key rounds (AdvertiseKeys, ShareKeys) are a Prepare phase that
runs before training, so that the server's deadlines for them cover network round trips only; the
masked input (Commit) and Unmasking (Finalization) follow once the update exists."""

from __future__ import annotations

import base64
import enum
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from secagg import Round, SecAggClient

from .errors import ProtocolError
from .protocol import CheckinAccepted, ProtocolClient
from .secure_sum import config_from_json


MAX_DEADLINE_S = 3600.0
LONG_POLL_S = 0.5  # also bounds how long a should_abort can go unheard
DEADLINE_GRACE_S = 1.0


class SecureOutcome(enum.Enum):
    INCLUDED = "included"  # the group's sum holds this device's update
    EXCLUDED = "excluded"  # the group or round went on without it, or it was in no group
    ABORTED = "aborted"  # the group's protocol aborted, or this client refused the server
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class SecureResult:
    outcome: SecureOutcome
    detail: str = ""


class SecureAggregation:
    """One device's part in its group's protocol for one session.

    ``deadline`` is a ``time.monotonic()`` reading; each of the server's answers may move it
    (within an hour), as the group's deadlines start when it forms. ``on_round`` hears the name of each protocol
    round (``secagg.Round`` values) just before this device takes part in it, so an app can show
    progress; ``should_abort`` is asked again right after."""

    def __init__(
        self,
        client: ProtocolClient,
        session: CheckinAccepted,
        *,
        deadline: float,
        should_abort: Callable[[], bool] | None = None,
        on_round: Callable[[str], None] | None = None,
        poll_s: float = 0.02,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client = client
        self.session = session
        self.deadline = deadline
        self.should_abort = should_abort
        self.on_round = on_round
        self.poll_s = poll_s
        self.sleep = sleep
        self._secagg: SecAggClient | None = None
        self._vector: np.ndarray | None = None
        self._seen_seq = 0

    def prepare(self) -> SecureResult | None:
        """Run the key rounds; None once the group waits for this device's masked input,
        otherwise how the protocol ended for this device before it had to train."""
        return self._run(until_input=True)

    def finish(self, vector: np.ndarray) -> SecureResult:
        """Send the masked input of ``vector`` (after ``prepare``, or from the start) and answer
        Unmasking, until this device's group has completed or aborted."""
        self._vector = vector
        if self._secagg is not None:
            self._secagg.set_input(vector)
        result = self._run(until_input=False)
        assert result is not None
        return result

    def _entering(self, round_name: str) -> bool:
        if self.on_round is not None:
            self.on_round(round_name)
        return self.should_abort is not None and self.should_abort()

    def _run(self, *, until_input: bool) -> SecureResult | None:
        client, session = self.client, self.session
        while time.monotonic() < self.deadline:
            if self.should_abort is not None and self.should_abort():
                return SecureResult(SecureOutcome.INTERRUPTED)
            wait = max(0.0, min(LONG_POLL_S, self.deadline - time.monotonic()))
            after = self._seen_seq if self._secagg is not None else -1  # -1: AdvertiseKeys is due at once
            state = client.secagg_poll(session, after=after, wait_s=wait)
            status = state.get("status")
            remaining = state.get("deadline_in_s")
            if isinstance(remaining, (int, float)) and not isinstance(remaining, bool):
                # the server moves the deadline when its group forms later than the device thought
                self.deadline = time.monotonic() + min(float(remaining), MAX_DEADLINE_S) + DEADLINE_GRACE_S
            if status == "waiting":
                self.sleep(self.poll_s)
                continue
            if status in ("excluded", "closed"):
                return SecureResult(SecureOutcome.EXCLUDED, str(status))
            if self._secagg is None:
                if state.get("round") != Round.ADVERTISE_KEYS.value:
                    return SecureResult(SecureOutcome.EXCLUDED, "the group started without this device")
                try:
                    config = config_from_json(state["config"])
                    self._secagg = SecAggClient(int(state["client_id"]), config, self._vector)
                except (KeyError, TypeError, ValueError) as exc:
                    raise ProtocolError(f"the server's Secure Aggregation setup is malformed: {exc}") from None
                if self._entering(Round.ADVERTISE_KEYS.value):
                    return SecureResult(SecureOutcome.INTERRUPTED)
                if not _send(client, session, self._secagg.start()):
                    return SecureResult(SecureOutcome.EXCLUDED, "the group moved on without this device")
                continue
            if status == "completed":
                included = bool(state.get("included"))
                return SecureResult(SecureOutcome.INCLUDED if included else SecureOutcome.EXCLUDED)
            if status == "aborted":
                return SecureResult(SecureOutcome.ABORTED, str(state.get("reason", "")))
            seq = int(state.get("seq", 0))
            message = state.get("message")
            if seq > self._seen_seq and message:
                round_name = str(state.get("round", ""))
                if until_input and round_name == Round.MASKED_INPUT_COLLECTION.value:
                    return None  # the reply is the masked input: it waits for training
                self._seen_seq = seq
                if self._entering(round_name):
                    return SecureResult(SecureOutcome.INTERRUPTED)
                reply = self._secagg.handle(base64.b64decode(message))
                if self._secagg.aborted:
                    return SecureResult(SecureOutcome.ABORTED, f"this device refused the server: {self._secagg.abort_reason}")
                if reply is not None and not _send(client, session, reply):
                    return SecureResult(SecureOutcome.EXCLUDED, "the group moved on without this device")
                continue
            self.sleep(self.poll_s)
        return SecureResult(SecureOutcome.TIMED_OUT)


def run_secure_aggregation(
    client: ProtocolClient,
    session: CheckinAccepted,
    vector: np.ndarray,
    *,
    deadline: float,
    should_abort: Callable[[], bool] | None = None,
    on_round: Callable[[str], None] | None = None,
    poll_s: float = 0.02,
) -> SecureResult:
    """All four rounds for an update that already exists."""
    secure = SecureAggregation(client, session, deadline=deadline, should_abort=should_abort, on_round=on_round, poll_s=poll_s)
    return secure.finish(vector)


def _send(client: ProtocolClient, session: CheckinAccepted, message: bytes) -> bool:
    """False when the server refused the message because its SecAgg round or FL round had closed."""
    try:
        client.secagg_send(session, message)
    except ProtocolError as exc:
        if exc.code in ("SECAGG_ROUND_CLOSED", "SESSION_CLOSED"):
            return False
        raise
    return True
