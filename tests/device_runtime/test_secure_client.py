"""A hostile server's Secure Aggregation state is read as its wire model (``wire.SecAggState``)
before the device acts on it: whatever JSON object a poll answers, the device's part ends in a
``SecureResult`` (a field of the wrong type is a refusal naming the field) or the SDK's own
``ProtocolError``; never another exception, never a hot loop past its deadline."""

from __future__ import annotations

import json

import httpx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime.errors import ProtocolError
from device_runtime.protocol import ProtocolClient
from device_runtime.secagg_policy import SecAggPolicy
from device_runtime.secure_client import MAX_DEADLINE_S, REFUSED, SecureOutcome, SecureResult, run_secure_aggregation
from device_runtime.wire import CheckinAccepted

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


def test_a_server_that_keeps_moving_the_deadline_cannot_hold_the_device_past_an_hour():
    # every answer "waiting, an hour from now": the device times out an hour after it joined
    now = [0.0]
    polls = [0]

    def handle(request: httpx.Request) -> httpx.Response:
        polls[0] += 1
        if polls[0] > 2000:  # a device still polling after ~5 hours: end the test instead of hanging
            return httpx.Response(200, json={"status": "aborted", "reason": "still polling"})
        return httpx.Response(200, json={"status": "waiting", "deadline_in_s": 3600})

    client = ProtocolClient("http://server.test", transport=httpx.MockTransport(handle))
    try:
        result = run_secure_aggregation(
            client,
            SESSION,
            np.zeros(4, dtype=np.float32),
            deadline=5.0,
            sleep=lambda s: now.__setitem__(0, now[0] + max(s, 10.0)),
            clock=lambda: now[0],
            long_poll_s=0.0,
            policy=OPEN,
        )
    finally:
        client.close()
    assert result.outcome is SecureOutcome.TIMED_OUT
    assert 3600.0 <= now[0] <= 5.0 + MAX_DEADLINE_S + 11.0 and polls[0] <= 2000


def test_a_field_of_the_wrong_type_is_refused_naming_the_field():
    result = _run({"status": "active", "round": "ShareKeys", "seq": "3", "message": "AAAA"})
    assert result.refused and result.code == REFUSED
    assert "malformed" in result.detail and "seq" in result.detail
    result = _run({"status": "completed", "included": [1]})
    assert result.refused and "included" in result.detail
    result = _run({"status": "waiting", "deadline_in_s": "soon"})
    assert result.refused and "deadline_in_s" in result.detail
