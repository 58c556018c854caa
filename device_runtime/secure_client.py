"""The device's side of Secure Aggregation over HTTP: it polls its session's mailbox, feeds the
server's messages to its SecAggClient state machine and posts the replies.

As in the paper (section 6), the key rounds (AdvertiseKeys, ShareKeys, and ShareCheck, where the
device opens the share pairs it holds) are a Prepare phase that runs before training, so that the
server's deadlines for them cover network round trips only; the masked input (Commit) and
Unmasking (Finalization) follow once the update exists.

Before it advertises a key the device checks what the server asks of it: the configuration
against its privacy floor (``SecAggPolicy``), and its group against the seed the server committed
to while the device waited (the group is recomputed from the revealed seed and the member list;
the group's graph seed must be the one derived from it). With an attested key and a trust anchor
it signs its keys with the device key and accepts only certified peers, each device once, from
its own group. Any refusal ends the device's part with ``refused`` set, the reason, and its code:
``SECAGG_REFUSED`` when the server's request failed a check, ``SECAGG_NEEDS_ATTESTATION`` when
the policy asks for an attested cohort and the device has no attested key or trust anchor (it
then refuses before it polls, so it never joins a cohort it cannot check).

In a distributed-DP round the group's state also carries the round's noise parameters: the
device checks them against its noise floor (``DPPolicy``, see ``dp_policy``) at the same point,
before it advertises a key, and refuses with ``DP_NOISE_BELOW_FLOOR`` or ``DP_PARAMS_INVALID``;
once they pass, ``ddp`` holds them and the update must be encoded with them.

A 4xx answer to a poll or a message is final, as for a plain report: the device's part ends with
the server's code (``BAD_SESSION_TOKEN`` from a server that restarted mid-round and lost the round
with its sessions), or as left out of its group when the group went on without it."""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from secagg import PeerVerifier, Round, SecAggClient, Signer, assign_groups, group_seed, seed_commitment

from .attestation import device_key_hash
from .dp_policy import DEFAULT_DP_POLICY, DDPRound, DPPolicy, DPRefusal, check_round
from .errors import ProtocolError
from .protocol import CheckinAccepted, ProtocolClient
from .secagg_policy import DEFAULT_SECAGG_POLICY, SecAggPolicy
from .secure_sum import config_from_json
from .wire import SecAggAssignment, SecAggState

MAX_DEADLINE_S = 3600.0
#: The largest SecAgg+ degree a device judges against its floor. Judging degree k sums binomial
#: tails over k + 1 terms, each list kept for later judgements: a server's degree of 2^24 in a
#: group it said was 2^64 devices held a device for minutes and took gigabytes. The bounds ask for
#: O(log n): 224 for 10^7 devices at the default assumptions, 412 at a corrupt fraction of 0.49.
MAX_SECAGG_PLUS_DEGREE = 4096
LONG_POLL_S = 0.5  # also bounds how long a should_abort can go unheard
DEADLINE_GRACE_S = 1.0
#: A device whose polls the server cannot hold (``long_poll_s=0``), once its masked input is in,
#: doubles its wait between polls that bring nothing new, from ``poll_s`` up to this: its group
#: may wait minutes, up to the report window, for its slowest members' masked inputs, and each
#: empty poll costs the server a request. The rounds after that close within a round timeout
#: (10 s in a simulated fleet), which a device that sees them this late still answers within;
#: in the other rounds, which close as soon as every member has answered, it polls every ``poll_s``.
IDLE_POLL_MAX_S = 4.0

#: The rounds of a device's client once its masked input has left: only then can its group's sum hold it.
_INPUT_SENT = frozenset({Round.MASKED_INPUT_COLLECTION, Round.CONSISTENCY_CHECK, Round.COMPLETED})

#: ``SecureResult.code`` of a refusal: the server's request fell below the floor or failed a check
REFUSED = "SECAGG_REFUSED"
#: ``SecureResult.code`` of a refusal: the policy requires an attested cohort that this device
#: cannot check (no attested key or no trust anchor); the app's configuration must change
NEEDS_ATTESTATION = "SECAGG_NEEDS_ATTESTATION"


class SecureOutcome(enum.Enum):
    INCLUDED = "included"  # the group's sum holds this device's update
    EXCLUDED = "excluded"  # the group or round went on without it, or it was in no group
    ABORTED = "aborted"  # the group's protocol aborted, this client refused the server, or the server ended the session
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class SecureResult:
    """``refused``: this device ended its part because the server's request fell below its
    privacy floor or failed a check, or because it cannot meet its own policy; ``detail`` says
    why (it goes to opstats and the server) and ``code`` which kind (``REFUSED``,
    ``NEEDS_ATTESTATION``, or ``dp_policy``'s ``DP_NOISE_BELOW_FLOOR`` and ``DP_PARAMS_INVALID``);
    without ``refused``, ``code`` is the server's error code when a 4xx answer ended the session
    (``BAD_SESSION_TOKEN``: the server restarted and no longer knows it). ``retry_after_s``: the
    pace-steering window the server named with this device's completed group, as a report's answer
    names it (see ``retry_window``)."""

    outcome: SecureOutcome
    detail: str = ""
    refused: bool = False
    code: str = ""
    retry_after_s: tuple[float, float] | None = None


def session_member_key(session_id: str) -> bytes:
    """A device's key in the group assignment when it has no attested key."""
    return hashlib.sha256(b"fedfleet/secagg-member\x00" + session_id.encode()).digest()


class _Refusal(Exception):
    """The server's request is below this device's floor or fails a check."""

    def __init__(self, message: str, code: str = REFUSED) -> None:
        super().__init__(message)
        self.code = code


def identity_problem(policy: SecAggPolicy, signer: object, verify_peer: object) -> str | None:
    """Why a device with ``signer`` (its attested key's signer, or None) and ``verify_peer`` (its
    check of peers' certificates, or None) cannot meet ``policy``'s attested cohort, or None: known
    at check-in, before the plan and checkpoint are downloaded."""
    if not policy.require_attested_cohort:
        return None
    missing = [
        what
        for what, have in (
            ("no attested device key (FLRuntime(attestor=...))", signer),
            ("no trust anchor of the attestation authority (FLRuntime(trust_anchor=...))", verify_peer),
        )
        if have is None
    ]
    if not missing:
        return None
    return (
        "its policy requires an attested cohort, but it has "
        + " and ".join(missing)
        + "; pass them, or choose SecAggPolicy(require_attested_cohort=False) explicitly to accept "
        "peers it cannot check"
    )


class SecureAggregation:
    """One device's part in its group's protocol for one session.

    ``deadline`` is a reading of ``clock`` (``time.monotonic`` on a phone, the runtime's virtual
    clock in a simulation); each of the server's answers may move it, as the group's deadlines
    start when it forms, but never past an hour after the device joined (``latest_deadline``). ``on_round`` hears the name of each protocol round
    (``secagg.Round`` values) just before this device takes part in it, so an app can show
    progress; ``should_abort`` is asked again right after.

    Between messages the device polls its mailbox: the server holds each poll up to
    ``long_poll_s`` (answering as soon as the device's state moves), and the device waits
    ``poll_s`` with ``sleep`` before the next. A device on a clock of its own sets
    ``long_poll_s=0``: the server cannot hold a request for a time it does not share, so the
    whole wait is spent through ``sleep``, on the device's clock; while it waits for the other
    masked inputs of its group it waits longer between polls that bring nothing new (doubling
    from ``poll_s`` up to ``IDLE_POLL_MAX_S``, never past its deadline)."""

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
        clock: Callable[[], float] = time.monotonic,
        long_poll_s: float = LONG_POLL_S,
        policy: SecAggPolicy = DEFAULT_SECAGG_POLICY,
        signer: Signer | None = None,
        verify_peer: PeerVerifier | None = None,
        dp_policy: DPPolicy = DEFAULT_DP_POLICY,
        update_dim: int | None = None,
        input_length: int | None = None,
    ) -> None:
        """``signer``: the attested device key (``DeviceAttestor.secagg_signer()``);
        ``verify_peer``: checks peers' certificates (``PeerCertificateVerifier``); ``dp_policy``:
        this device's noise floor; ``update_dim``: the length of its update's weight deltas, which
        a distributed-DP round's parameters must encode; ``input_length``: the length of its masked
        input in a round without distributed DP (its plan's secure-sum vector), which the group's
        configuration must name."""
        self.policy = policy
        self.dp_policy = dp_policy
        self.update_dim = update_dim
        self.input_length = input_length
        self.ddp: DDPRound | None = None
        self.signer = signer
        self.verify_peer = verify_peer
        # how the server names this device in the group assignment: by its attested key when the
        # server attests devices, else by its session
        self.member_keys = ([device_key_hash(signer.public_key)] if signer is not None else []) + [
            session_member_key(session.session_id)
        ]
        self._commitment: bytes | None = _b64(session.secagg_commitment)  # from the check-in answer
        self.client = client
        self.session = session
        self.deadline = deadline
        self.should_abort = should_abort
        self.on_round = on_round
        if poll_s < 0 or long_poll_s < 0:
            raise ValueError("poll_s and long_poll_s must be >= 0")
        self.poll_s = poll_s
        self.sleep = sleep
        self.clock = clock
        self.long_poll_s = long_poll_s
        # the server may move the deadline, never past an hour after this device joined: answers
        # that kept moving it would otherwise hold the device (and its session) forever
        self.latest_deadline = max(deadline, clock()) + MAX_DEADLINE_S + DEADLINE_GRACE_S
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

    def identity_problem(self) -> str | None:
        """Why this device cannot meet its policy's attested cohort, or None."""
        return identity_problem(self.policy, self.signer, self.verify_peer)

    def _run(self, *, until_input: bool) -> SecureResult | None:
        client, session = self.client, self.session
        if self._secagg is None:
            problem = self.identity_problem()
            if problem is not None:
                return SecureResult(
                    SecureOutcome.ABORTED,
                    f"this device cannot take part in Secure Aggregation: {problem}",
                    refused=True,
                    code=NEEDS_ATTESTATION,
                )
        idle_s = self.poll_s  # the wait after a poll that brings nothing new (see IDLE_POLL_MAX_S)
        while self.clock() < self.deadline:
            if self.should_abort is not None and self.should_abort():
                return SecureResult(SecureOutcome.INTERRUPTED)
            wait = max(0.0, min(self.long_poll_s, self.deadline - self.clock()))
            after = self._seen_seq if self._secagg is not None else -1  # -1: AdvertiseKeys is due at once
            try:
                answer = client.secagg_poll(session, after=after, wait_s=wait)
            except ProtocolError as exc:
                ended = _ended_by_server(exc)
                if ended is None:
                    raise
                return ended
            try:
                # the round's DP parameters are judged by the device's DP policy, with its own codes
                state = SecAggState.model_validate({**answer, "ddp": None})
            except ValidationError as exc:
                return self._refused(f"the server's Secure Aggregation state is malformed: {_first_error(exc)}")
            status = state.status
            if state.deadline_in_s is not None:
                # the server moves the deadline when its group forms later than the device thought
                moved = self.clock() + min(max(state.deadline_in_s, 0.0), MAX_DEADLINE_S) + DEADLINE_GRACE_S
                self.deadline = min(moved, self.latest_deadline)
            if status == "waiting":
                seen = _b64(state.commitment)
                if self._commitment is not None and seen != self._commitment:
                    return self._refused("the server changed its committed seed while this device waited")
                self._commitment = self._commitment or seen
                self.sleep(self.poll_s)
                continue
            if status in ("excluded", "closed"):
                return SecureResult(SecureOutcome.EXCLUDED, str(status))
            if self._secagg is None:
                if state.round != Round.ADVERTISE_KEYS.value:
                    return SecureResult(SecureOutcome.EXCLUDED, "the group started without this device")
                try:
                    self._secagg = self._join(state, answer.get("ddp"))
                except _Refusal as exc:
                    return self._refused(str(exc), exc.code)
                if self._entering(Round.ADVERTISE_KEYS.value):
                    return SecureResult(SecureOutcome.INTERRUPTED)
                ended = _send(client, session, self._secagg.start())
                if ended is not None:
                    return ended
                continue
            if status == "completed":
                if not state.included:
                    return SecureResult(SecureOutcome.EXCLUDED)
                if self._secagg.round not in _INPUT_SENT:
                    # a session recorded as taking part (its eligibility policies read it) with
                    # nothing trained or sent
                    return self._refused("the server says this device's input was summed, but it has sent none")
                return SecureResult(SecureOutcome.INCLUDED, retry_after_s=state.retry_after_s)
            if status == "aborted":
                return SecureResult(SecureOutcome.ABORTED, state.reason or "")
            seq, message = state.seq or 0, state.message
            if seq > self._seen_seq and message:
                round_name = state.round or ""
                if until_input and round_name == Round.MASKED_INPUT_COLLECTION.value:
                    if self._secagg.round is not Round.SHARE_CHECK:
                        # its client would refuse the request once the device had trained for it
                        return self._refused(
                            f"the server asked for its masked input during {self._secagg.round.value}, "
                            "before its key rounds ended"
                        )
                    return None  # the reply is the masked input: it waits for training
                self._seen_seq = seq
                if self._entering(round_name):
                    return SecureResult(SecureOutcome.INTERRUPTED)
                try:
                    received = base64.b64decode(message, validate=True)
                except ValueError:
                    return self._refused("the server's Secure Aggregation message is not base64")
                reply = self._secagg.handle(received)
                if self._secagg.aborted:
                    return self._refused(str(self._secagg.abort_reason))
                ended = _send(client, session, reply) if reply is not None else None
                if ended is not None:
                    return ended
                idle_s = self.poll_s
                continue
            if self.long_poll_s > 0 or until_input or state.round != Round.MASKED_INPUT_COLLECTION.value:
                self.sleep(self.poll_s)
                continue
            # its masked input is in: the group waits for its slowest members, up to the report window
            self.sleep(max(0.0, min(idle_s, self.deadline - self.clock())))
            idle_s = min(2.0 * idle_s, max(self.poll_s, IDLE_POLL_MAX_S))
        return SecureResult(SecureOutcome.TIMED_OUT)

    def _refused(self, reason: str, code: str = REFUSED) -> SecureResult:
        return SecureResult(SecureOutcome.ABORTED, f"this device refused the server: {reason}", refused=True, code=code)

    def _join(self, state: SecAggState, ddp: object) -> SecAggClient:
        """Check the server's configuration, this device's group and the round's DP parameters
        (``ddp``, as the server sent them), then make the client."""
        if state.config is None or state.client_id is None:
            raise ProtocolError("the server's Secure Aggregation setup is malformed: it names no config or client_id")
        try:
            config = config_from_json(state.config)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"the server's Secure Aggregation setup is malformed: {exc}") from None
        client_id = state.client_id
        assignment = state.assignment
        is_member = None
        if assignment is not None:
            group, attested, expected_commitment = self._check_assignment(assignment, client_id)
            if config.graph_commitment != expected_commitment:
                raise _Refusal("the group's graph seed is not the one the revealed seed gives (a forged graph)")
            n = len(group)
            if self.policy.require_attested_cohort and not attested:
                raise _Refusal("the group assignment does not name this device by its attested key")
            if attested:  # the members are named by their device keys: the roster must hold them only
                members = frozenset(group)
                is_member = lambda public_key: device_key_hash(public_key) in members  # noqa: E731
        elif self.policy.require_graph_commitment:
            raise _Refusal("the server revealed no seed for the group assignment")
        else:
            n = state.group_size or 0
        k = config.degree
        if k is not None and MAX_SECAGG_PLUS_DEGREE < k < n - 1:
            raise _Refusal(
                f"SecAgg+ degree {k} is above the {MAX_SECAGG_PLUS_DEGREE} this device judges "
                "(the bounds ask for a degree of O(log n): 224 for 10^7 devices)"
            )
        problem = self.policy.violation(config, n)
        if problem is not None:
            raise _Refusal(f"below this device's privacy floor: {problem}")
        try:
            self.ddp = check_round(
                ddp,
                config=config,
                group_size=n,
                dim=self.update_dim,
                commitment=self._commitment,
                policy=self.dp_policy,
            )
        except DPRefusal as exc:
            raise _Refusal(f"distributed DP: {exc}", exc.code) from None
        if self.ddp is None and self.input_length is not None and config.vector_length != self.input_length:
            # found only at the masked input, after training: the device trained for nothing
            # (and a length of 2^40 asked for that much mask)
            raise _Refusal(
                f"the group's vector_length {config.vector_length} is not the {self.input_length} of this plan's "
                "secure-sum outputs"
            )
        try:
            return SecAggClient(
                client_id,
                dataclasses.replace(config, allow_unsafe=False),
                self._vector,
                signer=self.signer,
                verify_peer=self.verify_peer,
                is_member=is_member,
            )
        except ValueError as exc:
            raise _Refusal(str(exc)) from None

    def _check_assignment(self, assignment: SecAggAssignment, client_id: int) -> tuple[list[bytes], bool, bytes]:
        """This device's group as the revealed seed gives it, whether its members are named by
        their attested keys, and the commitment of the group's graph seed."""
        k, index = assignment.min_group_size, assignment.group
        try:
            seed = base64.b64decode(assignment.seed, validate=True)
            members = [base64.b64decode(m, validate=True) for m in assignment.members]
            groups = assign_groups(seed, members, k, assignment.spare)
        except ValueError as exc:
            raise ProtocolError(f"the server's group assignment is malformed: {exc}") from None
        if self._commitment is None and self.policy.require_graph_commitment:
            raise _Refusal("the server showed no commitment to its seed before selection ended")
        if self._commitment is not None and seed_commitment(seed) != self._commitment:
            raise _Refusal("the revealed seed does not open the commitment the server showed before selection")
        if k < self.policy.min_group_size:
            raise _Refusal(f"groups of at least {k}, below this device's minimum of {self.policy.min_group_size}")
        placed = [(i, key) for key in self.member_keys for i, g in enumerate(groups) if key in g]
        if not placed:
            raise _Refusal("the revealed assignment puts this device in no group")
        mine, key = placed[0]
        if mine != index or groups[mine].index(key) + 1 != client_id:
            raise _Refusal(
                "the server placed this device in another group or seat than the revealed seed gives (a forged group)"
            )
        attested = self.signer is not None and key == self.member_keys[0]
        return groups[mine], attested, seed_commitment(group_seed(seed, mine))


def _first_error(exc: ValidationError) -> str:
    """The first thing wrong with a server's answer, in a few words: the field and why."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the answer"
    return f"{where}: {error['msg']}"[:200]


def _b64(value: object) -> bytes | None:
    try:
        return base64.b64decode(str(value), validate=True) if value is not None else None
    except ValueError:
        return None


def run_secure_aggregation(
    client: ProtocolClient,
    session: CheckinAccepted,
    vector: np.ndarray,
    *,
    deadline: float,
    should_abort: Callable[[], bool] | None = None,
    on_round: Callable[[str], None] | None = None,
    poll_s: float = 0.02,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    long_poll_s: float = LONG_POLL_S,
    policy: SecAggPolicy = DEFAULT_SECAGG_POLICY,
    signer: Signer | None = None,
    verify_peer: PeerVerifier | None = None,
) -> SecureResult:
    """All the rounds for an update that already exists."""
    secure = SecureAggregation(
        client,
        session,
        deadline=deadline,
        should_abort=should_abort,
        on_round=on_round,
        poll_s=poll_s,
        sleep=sleep,
        clock=clock,
        long_poll_s=long_poll_s,
        policy=policy,
        signer=signer,
        verify_peer=verify_peer,
    )
    return secure.finish(vector)


def _send(client: ProtocolClient, session: CheckinAccepted, message: bytes) -> SecureResult | None:
    """None once the server took the message; how this device's part ends when it refused it for
    good (``_ended_by_server``)."""
    try:
        client.secagg_send(session, message)
    except ProtocolError as exc:
        ended = _ended_by_server(exc)
        if ended is None:
            raise
        return ended
    return None


#: The codes of a server that goes on without this device: its group's round or its FL round
#: closed, or (SECAGG_ALREADY_ANSWERED) it took another message of this round from this session,
#: sent before the app was killed and started again, and its group goes on with that one.
LEFT_OUT_CODES = frozenset({"SECAGG_ROUND_CLOSED", "SESSION_CLOSED", "SECAGG_ALREADY_ANSWERED"})


def _ended_by_server(exc: ProtocolError) -> SecureResult | None:
    """How this device's part ends when the server answered one of its Secure Aggregation requests
    with a 4xx (final, as a refused report is): left out of its group (``LEFT_OUT_CODES``), or
    aborted with the server's code, e.g. ``BAD_SESSION_TOKEN`` from a server that restarted and
    lost the round with its sessions. None for any other error, which the caller raises."""
    if exc.status is None or not 400 <= exc.status < 500:
        return None
    if exc.code in LEFT_OUT_CODES:
        return SecureResult(SecureOutcome.EXCLUDED, f"the group moved on without this device: {exc}")
    return SecureResult(
        SecureOutcome.ABORTED, f"the server ended this device's part: {exc}", code=exc.code or f"HTTP_{exc.status}"
    )
