"""A hostile server's Secure Aggregation state is read as its wire model (``wire.SecAggState``)
before the device acts on it: whatever JSON object a poll answers, the device's part ends in a
``SecureResult`` (a field of the wrong type is a refusal naming the field) or the SDK's own
``ProtocolError``; never another exception, never a hot loop past its deadline."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.errors import ProtocolError
from device_runtime.protocol import ProtocolClient
from device_runtime.secagg_policy import SecAggPolicy
from device_runtime.secure_client import (
    IDLE_POLL_MAX_S,
    MAX_DEADLINE_S,
    REFUSED,
    SecureAggregation,
    SecureOutcome,
    SecureResult,
    run_secure_aggregation,
)
from device_runtime.secure_sum import config_to_json
from device_runtime.wire import CheckinAccepted
from secagg import Round, SecAggClient, SecAggConfig

SESSION = CheckinAccepted(
    session_id="s1",
    token="t1",
    task="train",
    round=1,
    plan_id="0" * 64,
    checkpoint_id="1" * 64,
    aggregation="secure_sum",
    report_deadline_s=60.0,
    max_examples_per_report=100,
    clip_update_norm=1.0,
)
#: A policy that lets the device poll without an attested identity or a seed commitment, so
#: that the state's own fields are what decides.
OPEN = SecAggPolicy(require_attested_cohort=False, require_graph_commitment=False)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=5,
)
states = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["waiting", "excluded", "closed", "active", "completed", "aborted", "other"])
        | json_values
    },
    optional={
        key: json_values
        for key in ("seq", "message", "round", "included", "reason", "deadline_in_s", "commitment", "retry_after_s")
    },
)


def _serving(state: dict) -> ProtocolClient:
    """A client whose server answers every Secure Aggregation poll with ``state``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/secagg") and request.method == "GET":
            return httpx.Response(200, content=json.dumps(state).encode(), headers={"content-type": "application/json"})
        return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "nothing here"}})

    return ProtocolClient("http://server.test", transport=httpx.MockTransport(handle))


def _run(state: dict) -> SecureResult:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 0.01)

    client = _serving(state)
    try:
        return run_secure_aggregation(
            client,
            SESSION,
            np.zeros(4, dtype=np.float32),
            deadline=5.0,
            sleep=sleep,
            clock=lambda: now[0],
            long_poll_s=0.0,
            policy=OPEN,
        )
    finally:
        client.close()


@settings(max_examples=150, deadline=None)
@given(state=states)
def test_any_state_a_server_answers_ends_the_devices_part_in_a_result_or_a_protocol_error(state):
    try:
        result = _run(state)
    except ProtocolError:
        return
    assert isinstance(result, SecureResult)
    if result.refused:
        assert result.outcome is SecureOutcome.ABORTED and result.code == REFUSED


def _run_against(
    handle: Callable[[httpx.Request], httpx.Response],
    now: list[float],
    *,
    deadline: float,
    poll_s: float = 0.02,
    least_sleep_s: float = 0.0,
) -> SecureResult:
    """A device on a clock of its own (``now[0]``, moved by its sleeps, each at least
    ``least_sleep_s``) against a server that answers with ``handle``."""
    client = ProtocolClient("http://server.test", transport=httpx.MockTransport(handle))
    try:
        return run_secure_aggregation(
            client,
            SESSION,
            np.zeros(4, dtype=np.float32),
            deadline=deadline,
            poll_s=poll_s,
            sleep=lambda s: now.__setitem__(0, now[0] + max(s, least_sleep_s)),
            clock=lambda: now[0],
            long_poll_s=0.0,
            policy=OPEN,
        )
    finally:
        client.close()


def test_a_server_that_keeps_moving_the_deadline_cannot_hold_the_device_past_an_hour():
    # every answer "waiting, an hour from now": the device times out an hour after it joined
    now = [0.0]
    polls = [0]

    def handle(request: httpx.Request) -> httpx.Response:
        polls[0] += 1
        if polls[0] > 2000:  # a device still polling after ~5 hours: end the test instead of hanging
            return httpx.Response(200, json={"status": "aborted", "reason": "still polling"})
        return httpx.Response(200, json={"status": "waiting", "deadline_in_s": 3600})

    result = _run_against(handle, now, deadline=5.0, least_sleep_s=10.0)
    assert result.outcome is SecureOutcome.TIMED_OUT
    assert 3600.0 <= now[0] <= 5.0 + MAX_DEADLINE_S + 11.0 and polls[0] <= 2000


def _polls_in_round(round_name: str, *, after_input: bool, poll_s: float, until: float) -> list[float]:
    """When a device on a clock of its own polls a group that stays in ``round_name`` with
    nothing new for it until ``until`` (then aborts): after its masked input (``finish``) or
    before (``prepare``). The device's protocol client is a real one, joined as if it had
    answered the rounds before."""
    now, polls = [0.0], []

    def handle(request: httpx.Request) -> httpx.Response:
        polls.append(now[0])
        if now[0] >= until:
            return httpx.Response(200, json={"status": "aborted", "reason": "the test ends"})
        return httpx.Response(200, json={"status": "active", "round": round_name, "seq": 3, "message": "AAAA"})

    client = ProtocolClient("http://server.test", transport=httpx.MockTransport(handle))
    secure = SecureAggregation(
        client,
        SESSION,
        deadline=until + 60.0,
        poll_s=poll_s,
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        clock=lambda: now[0],
        long_poll_s=0.0,
        policy=OPEN,
    )
    secure._secagg = SecAggClient(1, SecAggConfig(vector_length=4, modulus=2**16, threshold=3), None)
    secure._seen_seq = 3
    try:
        result = secure.finish(np.zeros(4, dtype=np.int64)) if after_input else secure.prepare()
    finally:
        client.close()
    assert result is not None and result.outcome is SecureOutcome.ABORTED
    return polls


@settings(max_examples=40, deadline=None)
@given(poll_s=st.floats(0.01, 2.0), until=st.floats(0.5, 300.0))
def test_after_its_masked_input_a_device_waits_longer_between_empty_polls_up_to_a_cap(poll_s, until):
    polls = _polls_in_round(Round.MASKED_INPUT_COLLECTION.value, after_input=True, poll_s=poll_s, until=until)
    gaps = [b - a for a, b in zip(polls, polls[1:], strict=False)]
    cap = max(poll_s, IDLE_POLL_MAX_S)
    assert polls[0] == 0.0 and polls[-2] < until <= polls[-1] and gaps[-1] <= cap + 1e-9
    assert math.isclose(gaps[0], poll_s)
    for before, after in zip(gaps, gaps[1:], strict=False):
        assert math.isclose(after, min(2 * before, cap))  # doubling until the cap


def test_a_group_waiting_three_minutes_for_masked_inputs_costs_a_fraction_of_the_polls():
    polls = _polls_in_round(Round.MASKED_INPUT_COLLECTION.value, after_input=True, poll_s=1.0, until=180.0)
    assert len(polls) <= 180.0 / IDLE_POLL_MAX_S + 3


@pytest.mark.parametrize("round_name", [Round.SHARE_KEYS.value, Round.UNMASKING.value])
def test_in_the_other_rounds_a_device_polls_every_poll_s(round_name):
    # the key rounds and those after the masked inputs close within seconds: no wait grows there
    polls = _polls_in_round(round_name, after_input=round_name == Round.UNMASKING.value, poll_s=1.0, until=30.0)
    assert [b - a for a, b in zip(polls, polls[1:], strict=False)] == [1.0] * 30


def test_a_field_of_the_wrong_type_is_refused_naming_the_field():
    result = _run({"status": "active", "round": "ShareKeys", "seq": "3", "message": "AAAA"})
    assert result.refused and result.code == REFUSED
    assert "malformed" in result.detail and "seq" in result.detail
    result = _run({"status": "completed", "included": [1]})
    assert result.refused and "included" in result.detail
    result = _run({"status": "waiting", "deadline_in_s": "soon"})
    assert result.refused and "deadline_in_s" in result.detail


#: A group's configuration above the default floor (``OPEN`` asks no attested cohort and no seed)
GROUP_CONFIG = SecAggConfig.for_cohort(6, 4, session_label=b"group", min_summed=5, consistency_check=True)


def _joining(error: tuple[int, str], *, on: str) -> SecureResult | None:
    """The key rounds of a device whose group is in AdvertiseKeys, against a server that answers
    its polls (``on="GET"``) or its message (``on="POST"``) with the 4xx ``error`` (status, code)."""
    state = {"status": "active", "round": "AdvertiseKeys", "seq": 0, "client_id": 1, "group_size": 6}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == on:
            status, code = error
            return httpx.Response(status, json={"error": {"code": code, "message": "the server says no"}})
        return httpx.Response(200, json={**state, "config": config_to_json(GROUP_CONFIG)})

    now = [0.0]
    client = ProtocolClient("http://server.test", transport=httpx.MockTransport(handle))
    secure = SecureAggregation(
        client,
        SESSION,
        deadline=5.0,
        sleep=lambda s: now.__setitem__(0, now[0] + max(s, 0.01)),
        clock=lambda: now[0],
        long_poll_s=0.0,
        policy=OPEN,
    )
    try:
        return secure.prepare()
    finally:
        client.close()


def test_a_device_started_again_whose_session_answered_the_round_is_left_out_of_its_group():
    # the app was killed after its keys went in, and started again: its group goes on with those keys
    result = _joining((409, "SECAGG_ALREADY_ANSWERED"), on="POST")
    assert result is not None and result.outcome is SecureOutcome.EXCLUDED and not result.refused


@pytest.mark.parametrize(
    ("error", "on"),
    [((401, "BAD_SESSION_TOKEN"), "GET"), ((401, "BAD_SESSION_TOKEN"), "POST"), ((400, "SECAGG_REJECTED"), "POST")],
)
def test_a_server_that_ends_the_session_with_a_4xx_ends_the_devices_part_with_its_code(error, on):
    # a server restarted mid-round no longer knows the session: the device is told why, it raises nothing
    result = _joining(error, on=on)
    assert result is not None and result.outcome is SecureOutcome.ABORTED and not result.refused
    assert result.code == error[1] and "the server says no" in result.detail
