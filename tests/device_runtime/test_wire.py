"""The wire models are one declaration for both ends: whatever answer the server's models emit
(as FastAPI serializes them, or as a direct route sends the service's dict), the device's
``ProtocolClient`` reads back as the same values; an answer with a required field missing or a
field of another type is the SDK's ``ProtocolError`` naming that field, never a value it uses."""

from __future__ import annotations

import base64
import contextlib
import json
import random
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import ProtocolError, RetryPolicy
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.protocol import ProtocolClient
from device_runtime.wire import (
    RESOURCE_ID_PATTERN,
    SESSION_ID_PATTERN,
    TOKEN_PATTERN,
    AttestationChallenge,
    CheckinAccepted,
    CheckinRejected,
    EligibilityInfo,
    ReportAnswer,
)

NO_RETRY = RetryPolicy(attempts=1)
names = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=128)
seconds = st.floats(0.0, 1e6, allow_nan=False)
counts = st.integers(0, 2**31)
windows = st.tuples(st.floats(0.0, 7 * 86_400.0), st.floats(0.0, 7 * 86_400.0)).map(lambda w: (min(w), max(w)))


@st.composite
def accepted(draw) -> CheckinAccepted:
    secure = draw(st.booleans())
    bounds = {}
    if secure or draw(st.booleans()):
        bounds = {
            "max_examples_per_report": draw(st.integers(1, 10**6)),
            "clip_update_norm": draw(st.none() | st.floats(1e-6, 1e6)),
        }
    return CheckinAccepted(
        status="accepted",
        session_id=draw(st.from_regex(SESSION_ID_PATTERN, fullmatch=True)),
        token=draw(st.from_regex(TOKEN_PATTERN, fullmatch=True)),
        task=draw(names),
        round=draw(counts),
        plan_id=draw(st.from_regex(RESOURCE_ID_PATTERN, fullmatch=True)),
        checkpoint_id=draw(st.from_regex(RESOURCE_ID_PATTERN, fullmatch=True)),
        aggregation="secure_sum" if secure else "simple",
        report_deadline_s=draw(seconds),
        max_report_bytes=draw(st.integers(1, 2**40)),
        **({"secagg_commitment": draw(st.text(max_size=64))} if secure else {}),
        **bounds,
    )


rejected = st.builds(CheckinRejected, status=st.just("rejected"), reason=st.text(max_size=64), retry_after_s=windows)
policies = st.builds(
    EligibilityPolicies,
    min_examples=st.integers(0, 10**9),
    min_separation_rounds=st.integers(0, 10**9),
    min_separation_s=st.floats(0, 1e8),
    sampling_period_s=st.floats(0, 1e8),
)
eligibility = st.one_of(
    st.just(EligibilityInfo(task=None)),
    st.builds(
        EligibilityInfo,
        task=names,
        round=counts,
        policies=policies,
        selector=st.just({"collection_uri": "app:/digits", "criteria": {}, "limit": None}),
    ),
)
reports = st.builds(
    ReportAnswer,
    status=st.just("accepted"),
    round=counts,
    round_status=st.sampled_from(["open", "committed", "abandoned"]),
    retry_after_s=st.none() | windows,
)
challenges = st.builds(
    AttestationChallenge,
    nonce=st.binary(min_size=32, max_size=32).map(lambda b: base64.b64encode(b).decode()),
    expires_at=st.floats(0, 2e9),
)


@contextlib.contextmanager
def _serving(body: bytes) -> Iterator[ProtocolClient]:
    """A device's client of a server that answers every request with ``body``."""
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "application/json"})
    )
    client = ProtocolClient("http://fl.test", transport=transport, retry=NO_RETRY, rng=random.Random(0))
    try:
        yield client
    finally:
        client.close()


def _ask(client: ProtocolClient, kind: str):
    """The client's call that reads an answer of ``kind``."""
    if kind == "checkin":
        return client.checkin("p", "1.31.1")
    if kind == "eligibility":
        return client.eligibility_info("p")
    if kind == "report":
        session = CheckinAccepted(
            session_id="s",
            token="t",
            task="t",
            round=0,
            plan_id="a" * 64,
            checkpoint_id="a" * 64,
            aggregation="simple",
            report_deadline_s=1.0,
        )
        return client.report(session, b"update")
    return client.attestation_nonce()


answers = st.one_of(
    accepted().map(lambda a: ("checkin", a)),
    rejected.map(lambda a: ("checkin", a)),
    eligibility.map(lambda a: ("eligibility", a)),
    reports.map(lambda a: ("report", a)),
    challenges.map(lambda a: ("nonce", a)),
)


#: Answers each property draws in the default run (300 took 4 CPU-s each), and in its slow twin.
EXAMPLES = 100
SLOW_EXAMPLES = 1000


@settings(max_examples=EXAMPLES, deadline=None)
@given(answer=answers, direct=st.booleans())
def test_every_answer_the_servers_models_emit_the_devices_models_accept(answer, direct):
    _the_device_accepts(answer, direct)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None)
@given(answer=answers, direct=st.booleans())
def test_every_answer_the_servers_models_emit_the_devices_models_accept_long_run(answer, direct):
    _the_device_accepts(answer, direct)


def _the_device_accepts(answer: tuple, direct: bool) -> None:
    """The device's models read back what the server's model (or its direct route's dict) sent."""
    kind, model = answer
    # FastAPI's route serializes the model (unset fields left out); a direct route sends the service's dict.
    body = model.model_dump_json(exclude_unset=True).encode()
    if direct:
        body = json.dumps(model.model_dump(mode="json", exclude_unset=True)).encode()
    with _serving(body) as client:
        got = _ask(client, kind)
    if kind == "nonce":
        assert got == base64.b64decode(model.nonce)
    else:
        assert got == model


REQUIRED = {
    "checkin": (
        "status",
        "session_id",
        "token",
        "task",
        "round",
        "plan_id",
        "checkpoint_id",
        "aggregation",
        "report_deadline_s",
    ),
    "eligibility": ("task",),
    "nonce": ("nonce",),
}
#: For each field a value of another JSON type than the one it declares.
WRONG_TYPE = {
    "status": 1,
    "session_id": 12,
    "token": ["t"],
    "task": 3,
    "round": "3",
    "plan_id": None,
    "checkpoint_id": 7,
    "aggregation": True,
    "report_deadline_s": "60",
    "max_examples_per_report": 1.5,
    "clip_update_norm": "1",
    "secagg_commitment": 5,
    "max_report_bytes": "big",
    "policies": [1],
    "selector": "all",
    "nonce": 5,
    "expires_at": "soon",
}


STRICT_ANSWERS = answers.filter(lambda a: not isinstance(a[1], (CheckinRejected, ReportAnswer)))


@settings(max_examples=EXAMPLES, deadline=None)
@given(answer=STRICT_ANSWERS, data=st.data())
def test_an_answer_missing_a_field_or_with_a_field_of_another_type_is_a_protocol_error_naming_it(answer, data):
    _a_broken_answer_is_refused_naming_its_field(answer, data)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None)
@given(answer=STRICT_ANSWERS, data=st.data())
def test_an_answer_missing_a_field_or_with_a_field_of_another_type_is_a_protocol_error_naming_it_long_run(answer, data):
    _a_broken_answer_is_refused_naming_its_field(answer, data)


def _a_broken_answer_is_refused_naming_its_field(answer: tuple, data: st.DataObject) -> None:
    """One required field dropped or one field of another JSON type: a ProtocolError naming the field."""
    kind, model = answer
    sent = model.model_dump(mode="json", exclude_unset=True)
    if data.draw(st.booleans(), label="drop?"):
        field = data.draw(st.sampled_from(REQUIRED[kind]), label="dropped")
        del sent[field]
    else:
        field = data.draw(st.sampled_from(sorted(set(sent) & set(WRONG_TYPE))), label="retyped")
        sent[field] = WRONG_TYPE[field]
    with _serving(json.dumps(sent).encode()) as client, pytest.raises(ProtocolError) as refused:
        _ask(client, kind)
    assert field in str(refused.value) or (field == "status" and kind == "checkin"), str(refused.value)


@pytest.mark.parametrize("window", [None, [5.0], ["x", 1], [9.0, 1.0], [-1.0, 2.0], [1.0, 1e309], [0.0, 10 * 86_400.0]])
def test_a_rejections_window_out_of_shape_is_no_window_and_a_long_one_is_cut_to_a_week(window):
    """The one lenient field: a turned-away device falls back to its own window (or a week),
    it is not an error; every other field of the rejection is still checked."""
    body = json.dumps({"status": "rejected", "reason": "ROUND_FULL", "retry_after_s": window}).encode()
    with _serving(body) as client:
        answer = client.checkin("p", "1.31.1")
    assert isinstance(answer, CheckinRejected) and answer.reason == "ROUND_FULL"
    assert answer.retry_after_s == ((0.0, 7 * 86_400.0) if window == [0.0, 10 * 86_400.0] else None)
    with (
        _serving(json.dumps({"status": "rejected", "reason": 5}).encode()) as client,
        pytest.raises(ProtocolError, match="reason"),
    ):
        client.checkin("p", "1.31.1")


def test_a_newer_servers_extra_fields_are_ignored():
    model = CheckinRejected(status="rejected", reason="NO_TASK", retry_after_s=(1.0, 2.0))
    body = json.dumps({**model.model_dump(mode="json"), "advice": {"from": "a newer server"}}).encode()
    with _serving(body) as client:
        assert client.checkin("p", "1.31.1") == model
