"""What a broken or hostile server answers is checked before the device uses it.

- A retry window (text, negative or reversed bounds, NaN, infinity, a century): a turned-away
  session ends as rejected and the device waits inside a finite window of at most a week; never
  a crash, never a hot loop. A window that comes with a report's answer (pace steering of
  participants) moves the device's next session no sooner than its own interval.
- An accepted check-in whose fields are anything at all: the session ends in the SDK's own
  ``ProtocolError`` naming the field; no id reaches the plan cache's paths or a request's URL
  unless it is one the server could have issued.
- A download of the session's plan refused: a 401 (the server no longer knows the session) ends
  it as rejected with the server's code; any other refusal is a ``ProtocolError``.
- An answer larger than a device reads (endless, gzip-bombed, declared too large, or in an
  encoding the device did not ask for), or one that trickles in: a ``ProtocolError``, read no
  further than the bound."""

from __future__ import annotations

import json
import math
import random

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_runtime import FLRuntime, Outcome, ProtocolError, RetryPolicy, SessionRejected
from device_runtime.clock import VirtualClock
from device_runtime.conditions import DeviceState, StaticConditions, TrainingConstraints, TrainingInterval
from device_runtime.errors import RuntimeSdkError
from device_runtime.protocol import MAX_RETRY_WINDOW_S
from device_runtime.runtime import DEFAULT_RETRY_WINDOW_S
from device_runtime.scheduling import ParticipationScheduler, RunOutcome, SchedulerSettings, WorkerQueue
from example_store import InMemoryExampleStore, SQLiteExampleStore
from tests.support import COLLECTION, deploy

GOOD = DeviceState(idle=True, charging=True, battery_level=0.9, unmetered_network=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=6,
)
windows = json_values | st.lists(st.floats() | st.integers(-(10**400), 10**400), min_size=0, max_size=3)


def _hostile_server(
    window: object = None, *, answer: dict | None = None, asked: list | None = None
) -> httpx.MockTransport:
    """A server that answers every check-in with ``answer`` (by default: turned away with
    ``window`` as its retry window) and nothing else; ``asked`` collects the paths requested."""
    checkin = answer if answer is not None else {"status": "rejected", "reason": "ROUND_FULL", "retry_after_s": window}

    def handle(request: httpx.Request) -> httpx.Response:
        if asked is not None:
            asked.append(request.url.path)
        if request.url.path.endswith("/eligibility"):
            return httpx.Response(200, json={"task": "train", "policies": {}})
        if request.url.path.endswith("/checkin"):
            body = json.dumps(checkin)
            return httpx.Response(200, content=body.encode(), headers={"content-type": "application/json"})
        return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "nothing here"}})

    return httpx.MockTransport(handle)


FIELDS = ("session_id", "token", "task", "round", "plan_id", "checkpoint_id", "aggregation", "report_deadline_s")
GOOD_ANSWER = {
    "status": "accepted",
    "session_id": "s1",
    "token": "t0k3n",
    "task": "train",
    "round": 3,
    "plan_id": "a" * 64,
    "checkpoint_id": "b" * 64,
    "aggregation": "simple",
    "report_deadline_s": 60.0,
}
hostile_values = json_values | st.sampled_from(
    ["../../../etc/passwd", "a" * 64 + "/../x", "A" * 64, "bad token\r\nX: 1", "", -1, 1e309]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.dictionaries(st.sampled_from(FIELDS), hostile_values, min_size=1),
    dropped=st.sets(st.sampled_from(FIELDS), max_size=2),
)
def test_an_accepted_check_in_with_any_fields_ends_in_a_protocol_error_before_they_are_used(changes, dropped, tmp_path):
    answer = {k: v for k, v in {**GOOD_ANSWER, **changes}.items() if k not in dropped}
    asked: list[str] = []
    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}])
    runtime = FLRuntime(
        "p",
        "http://fl.test",
        store,
        transport=_hostile_server(answer=answer, asked=asked),
        cache_dir=tmp_path / "cache",
    )
    with runtime, pytest.raises(ProtocolError):
        runtime.run_session()
    cache = tmp_path / "cache"
    assert not cache.exists() or all(p.resolve().is_relative_to(cache.resolve()) for p in cache.rglob("*"))
    for path in asked:  # only the server's own endpoints, with ids it could have issued
        assert path.startswith("/v1/") and ".." not in path


@pytest.mark.parametrize(
    ("status", "code"), [(401, "BAD_SESSION_TOKEN"), (404, "UNKNOWN_RESOURCE"), (409, "SESSION_CLOSED")]
)
def test_a_download_the_server_refuses_ends_the_session_only_for_a_session_it_no_longer_knows(tmp_path, status, code):
    """A 401 to the plan's download (a server that restarted since the check-in) ends the session as
    rejected with its code, an opstats session that sent nothing; any other refusal of a resource the
    server itself named is a broken server's: a ``ProtocolError``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/checkin"):
            return httpx.Response(200, json=GOOD_ANSWER)
        return httpx.Response(status, json={"error": {"code": code, "message": "refused"}})

    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}])
    runtime = FLRuntime("p", "http://fl.test", store, transport=httpx.MockTransport(handle), cache_dir=tmp_path / "c")
    with runtime:
        if status != 401:
            with pytest.raises(ProtocolError, match=code):
                runtime.run_session()
            return
        result = runtime.run_session()
    assert (result.outcome, result.rejection_code) == (Outcome.REPORT_REJECTED, code)
    assert [e.kind for e in result.events] == ["checkin", "upload_rejected"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(window=windows, seed=st.integers(0, 2**32 - 1))
def test_whatever_window_a_server_names_the_device_is_rejected_and_waits_a_sane_while(window, seed, tmp_path):
    runtime = FLRuntime(
        "p",
        "http://fl.test",
        InMemoryExampleStore(),
        transport=_hostile_server(window),
        rng=random.Random(seed),
        cache_dir=tmp_path / "cache",
    )
    with runtime, pytest.raises(SessionRejected):
        runtime.run_session()
    lo, hi = runtime.last_retry_window
    assert 0.0 <= lo <= hi <= MAX_RETRY_WINDOW_S and math.isfinite(hi)
    assert lo <= runtime.next_retry_delay() <= hi
    bounds = _bounds(window)
    if bounds is None:  # not two numbers: the default window
        assert (lo, hi) == DEFAULT_RETRY_WINDOW_S
    elif 0.0 <= bounds[0] <= bounds[1] < math.inf:  # a window that makes sense is followed, cut to a week
        assert (lo, hi) == (min(bounds[0], MAX_RETRY_WINDOW_S), min(bounds[1], MAX_RETRY_WINDOW_S))
    else:  # negative, reversed or not finite
        assert (lo, hi) == DEFAULT_RETRY_WINDOW_S


def _bounds(window: object) -> tuple[float, float] | None:
    if not isinstance(window, list) or len(window) < 2:
        return None
    try:
        return float(window[0]), float(window[1])
    except (TypeError, ValueError, OverflowError):
        return None


class PacedReports(httpx.BaseTransport):
    """The real server, whose answers to reports also name ``window`` (as a server does while
    pace steering spreads a large population out)."""

    def __init__(self, window: list[float]) -> None:
        self.inner = httpx.HTTPTransport()
        self.window = window

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if not request.url.path.endswith("/report") or response.status_code != 200:
            return response
        answer = json.loads(response.read())
        return httpx.Response(200, json={**answer, "retry_after_s": self.window})

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("window, min_interval", [([7200.0, 7300.0], 3600.0), ([60.0, 90.0], 3600.0)])
def test_a_report_answers_window_delays_the_next_session_no_sooner_than_the_interval(
    tmp_path, server, admin, digits, window, min_interval
):
    deploy(admin, goal_count=1, over_selection=1.0)
    clock = VirtualClock()
    store = SQLiteExampleStore(tmp_path / "ex.db")
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:32], digits.y_train[:32])))
    scheduler = ParticipationScheduler(
        tmp_path / "app.db", StaticConditions(GOOD), clock=clock, settings=SchedulerSettings(jitter=0.0)
    )
    runtime = FLRuntime("digits", server.url, store, transport=PacedReports(window), cache_dir=tmp_path / "cache")
    scheduler.register_runtime("digits", runtime)
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=min_interval))
    [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.COMPLETED and run.session.retry_after_s == tuple(window)
    wait = run.next_run_at - run.ended_at
    assert max(min_interval, window[0]) <= wait <= max(min_interval, window[1])
    scheduler.close()
    runtime.close()
    store.close()


bodies = (
    json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=24)
    | st.fixed_dictionaries({"task": json_values, "policies": json_values}).map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=bodies,
    status=st.sampled_from([200, 201, 204, 301, 400, 404, 409, 429, 500]),
    which=st.sampled_from(["/eligibility", "/checkin"]),
)
def test_any_answer_to_eligibility_or_check_in_ends_in_the_sdks_own_errors(body, status, which, tmp_path):
    """Not JSON, not UTF-8, not an object, an odd status: a session ends in a ``RuntimeSdkError``
    (which the scheduler records) or a rejection, never in an exception it would not catch."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith(which):
            return httpx.Response(status, content=body)
        if request.url.path.endswith("/eligibility"):
            return httpx.Response(200, json={"task": "train", "policies": {}})
        return httpx.Response(404, json={"error": {"code": "NOT_FOUND", "message": "nothing here"}})

    runtime = FLRuntime(
        "p",
        "http://fl.test",
        InMemoryExampleStore(),
        transport=httpx.MockTransport(handle),
        retry=RetryPolicy(attempts=2, base_delay_s=0.0, max_delay_s=0.0),
        cache_dir=tmp_path / "cache",
    )
    with runtime, pytest.raises((RuntimeSdkError, SessionRejected)):
        runtime.run_session()


def _serving(plan_bytes: bytes, checkpoint_bytes: bytes) -> httpx.MockTransport:
    """A server whose plan and checkpoint are whatever it likes, under ids that match them."""
    import hashlib

    pid, cid = hashlib.sha256(plan_bytes).hexdigest(), hashlib.sha256(checkpoint_bytes).hexdigest()
    answer = {**GOOD_ANSWER, "plan_id": pid, "checkpoint_id": cid}

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/eligibility"):
            return httpx.Response(200, json={"task": "train", "policies": {}})
        if path.endswith("/checkin"):
            return httpx.Response(200, json=answer)
        if path.endswith(pid):
            return httpx.Response(200, content=plan_bytes)
        if path.endswith(cid):
            return httpx.Response(200, content=checkpoint_bytes)
        return httpx.Response(200, json={"status": "accepted"})

    return httpx.MockTransport(handle)


def test_a_checkpoint_that_is_not_the_plans_or_not_a_checkpoint_is_refused_as_corrupt(tmp_path):
    from device_runtime import CorruptResource, build_mlp_plan, encode_checkpoint, initial_weights
    from device_runtime.plan import serialize_plan
    from example_store import ExampleSelector

    def mlp(hidden: int):
        return build_mlp_plan(64, (hidden,), 10, selector=ExampleSelector("app:/digits"), inputs={"x": "x", "y": "y"})

    plan, other = mlp(8), mlp(4)
    store = InMemoryExampleStore()
    store.add("app:/digits", [{"x": [0.0] * 64, "y": 1}] * 8)
    good = encode_checkpoint(initial_weights(plan, seed=0))
    first = plan.weight_names[0]
    # NaN or infinite weights trained to a NaN update, which the device sent (its work for nothing)
    nan, inf = (
        {**initial_weights(plan, seed=0), first: np.full_like(initial_weights(plan)[first], x)}
        for x in (np.nan, -np.inf)
    )
    # a float64 of 1e300 is finite, and infinite as the float32 the plan trains: it trained too
    past = {**initial_weights(plan, seed=0), first: np.full(initial_weights(plan)[first].shape, 1e300)}
    for checkpoint, says in [
        (encode_checkpoint(initial_weights(other, seed=0)), "has shape"),
        (good[:-5], "refused"),
        (b"\x00" * 40, "refused"),
        (encode_checkpoint(nan), f"weight {first!r} holds NaN or infinite values"),
        (encode_checkpoint(inf), f"weight {first!r} holds NaN or infinite values"),
        (encode_checkpoint(past), f"weight {first!r} holds NaN or infinite values as float32"),
    ]:
        with FLRuntime(
            "p",
            "http://fl.test",
            store,
            transport=_serving(serialize_plan(plan), checkpoint),
            cache_dir=tmp_path / "cache",
        ) as runtime:
            with pytest.raises(CorruptResource, match=says):
                runtime.run_session()
    with FLRuntime(
        "p", "http://fl.test", store, transport=_serving(serialize_plan(plan), good), cache_dir=tmp_path / "cache"
    ) as runtime:
        assert runtime.run_session().outcome.value == "completed"  # the same server, honest: it trains


class BrokenStore(InMemoryExampleStore):
    """An app's store whose disk went away: its reads fail with an error that is not the SDK's."""

    def query(self, selector):
        raise RuntimeError("the app's storage is gone")

    def query_batches(self, selector, batch_size):
        raise RuntimeError("the app's storage is gone")


def test_a_session_that_fails_with_an_error_not_the_sdks_is_an_error_run_and_the_job_comes_back(
    tmp_path, server, admin, digits
):
    deploy(admin, goal_count=2)
    clock = VirtualClock()
    store = BrokenStore()
    store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:16], digits.y_train[:16])])
    scheduler = ParticipationScheduler(
        tmp_path / "app.db", StaticConditions(GOOD), clock=clock, settings=SchedulerSettings(recheck_s=600, jitter=0.0)
    )
    runtime = FLRuntime("digits", server.url, store, cache_dir=tmp_path / "cache")
    scheduler.register_runtime("digits", runtime)
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=3600))
    [run] = scheduler.queue.run_pending()
    assert run.outcome is RunOutcome.ERROR and run.detail.startswith("RuntimeError")
    assert run.next_run_at == pytest.approx(run.ended_at + 600)  # not due again at once: no hot loop
    assert scheduler.queue.run_pending() == []
    assert admin.status("digits")["current_round"]["selected"] == 1  # the server saw the session, and its abort
    scheduler.close()
    runtime.close()


class RendezvousCheckins(httpx.BaseTransport):
    """The real server, whose check-ins are all turned away with ``window`` (as a server gathering
    a small population's devices for its next selection answers)."""

    def __init__(self, window: list[float]) -> None:
        self.inner = httpx.HTTPTransport()
        self.window = window

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if not request.url.path.endswith("/checkin"):
            return response
        response.read()
        return httpx.Response(
            200, json={"status": "rejected", "reason": "ROUND_NOT_OPEN", "retry_after_s": self.window}
        )

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("window", [[1200.0, 1350.0], [30.0, 30.0], [0.0, 150.0]])
def test_a_rejections_window_is_kept_as_the_server_named_it_not_jittered_past_it(tmp_path, server, admin, window):
    """The scheduler jitters its own delays by up to a fifth (the default); a delay drawn in the
    server's window is not stretched: aimed at a selection's opening, it would miss it."""
    deploy(admin, goal_count=1, over_selection=1.0)
    clock = VirtualClock()
    scheduler = ParticipationScheduler(tmp_path / "app.db", StaticConditions(GOOD), clock=clock)
    runtime = FLRuntime(
        "digits",
        server.url,
        SQLiteExampleStore(tmp_path / "ex.db"),
        transport=RendezvousCheckins(window),
        cache_dir=tmp_path / "cache",
    )
    scheduler.register_runtime("digits", runtime)
    scheduler.schedule("digits", TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=3600.0))
    waits = []
    for _ in range(8):
        [run] = scheduler.queue.run_pending()
        assert run.outcome is RunOutcome.NOT_SELECTED
        waits.append(run.next_run_at - run.ended_at)
        clock.advance(waits[-1])
    assert all(window[0] - 1e-6 <= w <= window[1] + 1e-6 for w in waits), waits
    scheduler.close()
    runtime.close()


def _endless(counted: list[int], chunk: bytes = b"{" * (1 << 16)):
    """An answer that never ends, counting the bytes handed to the device."""
    while True:
        counted.append(len(chunk))
        yield chunk


class _Stream(httpx.SyncByteStream):
    def __init__(self, chunks) -> None:
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks


@pytest.mark.parametrize("hostile", ["endless", "gzip bomb", "declared too large", "unasked encoding"])
@pytest.mark.parametrize("path", ["/checkin", "/v1/resources/"])
def test_an_answer_past_the_devices_bound_is_a_protocol_error_read_no_further(monkeypatch, tmp_path, hostile, path):
    """httpx reads a whole answer into memory: an endless or gzip-bombed check-in answer or plan ran
    the device out of memory. Past its bound (decoded), the answer is dropped as a ProtocolError."""
    import gzip

    from device_runtime import protocol

    limit = 1 << 20
    monkeypatch.setattr(protocol, "MAX_ANSWER_BYTES", limit)
    monkeypatch.setattr(protocol, "MAX_RESOURCE_BYTES", 2 * limit)
    bound = 2 * limit if path == "/v1/resources/" else limit
    counted: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if path not in request.url.path:
            return httpx.Response(200, json={**GOOD_ANSWER, "plan_id": "c" * 64})
        if hostile == "endless":
            return httpx.Response(200, stream=_Stream(_endless(counted)))
        if hostile == "gzip bomb":
            bomb = gzip.compress(b"\0" * (8 * bound))
            counted.append(len(bomb))
            return httpx.Response(
                200, stream=_Stream([bomb]), headers={"content-encoding": "gzip"}
            )  # as sockets give it
        if hostile == "declared too large":
            return httpx.Response(200, stream=_Stream(_endless(counted)), headers={"content-length": str(bound + 1)})
        return httpx.Response(200, content=b"{}", headers={"content-encoding": "br"})

    client = protocol.ProtocolClient("http://fl.test", transport=httpx.MockTransport(handle), retry=RetryPolicy(1))
    with pytest.raises(ProtocolError) as refused:
        if path == "/checkin":
            client.checkin("p", "1.31.1")
        else:
            client.fetch_resource("c" * 64, "t0k3n")
    expected = {
        "endless": f"larger than {bound} bytes",
        "gzip bomb": f"larger than {bound} bytes",
        "declared too large": f"is {bound + 1} bytes, more than the {bound}",
        "unasked encoding": "encoded as 'br'",
    }[hostile]
    assert expected in str(refused.value) and path in str(refused.value)
    assert sum(counted) <= bound + (1 << 16) if hostile == "endless" else sum(counted) < bound
    client.close()


def test_a_gzipped_answer_within_the_bound_is_read_as_any_other():
    import gzip

    def handle(request: httpx.Request) -> httpx.Response:
        body = gzip.compress(
            json.dumps({"status": "rejected", "reason": "ROUND_FULL", "retry_after_s": [1, 2]}).encode()
        )
        return httpx.Response(200, stream=_Stream([body[:9], body[9:]]), headers={"content-encoding": "gzip"})

    from device_runtime.protocol import ProtocolClient

    with_gzip = ProtocolClient("http://fl.test", transport=httpx.MockTransport(handle))
    answer = with_gzip.checkin("p", "1.31.1")
    assert answer.status == "rejected" and answer.retry_after_s == (1.0, 2.0)
    with_gzip.close()


@pytest.mark.parametrize("path", ["/checkin", "/v1/resources/"])
def test_an_answer_that_trickles_in_is_dropped_once_it_falls_behind_the_devices_pace(path):
    """A byte every 9 s, each within httpx's 10 s per-read timeout, held a device's session for ever.
    After the request's timeout an answer must keep up MIN_ANSWER_BYTES_PER_S."""
    from device_runtime.protocol import MIN_ANSWER_BYTES_PER_S, ProtocolClient

    now = [0.0]
    sent: list[int] = []

    def trickle():
        while True:
            now[0] += 9.0  # what the socket's wait would take
            sent.append(1)
            yield b"{"

    def steady():  # a slow but steady answer at twice the pace: read whole
        body = json.dumps({"status": "rejected", "reason": "ROUND_FULL", "retry_after_s": [1, 2], "pad": "x" * 40_000})
        for i in range(0, len(body), 2048):
            now[0] += 1.0
            yield body[i : i + 2048].encode()

    def handle(request: httpx.Request) -> httpx.Response:
        chunks = steady() if request.url.path.endswith("/steady/checkin") else trickle()
        return httpx.Response(200, stream=_Stream(chunks))

    client = ProtocolClient(
        "http://fl.test", transport=httpx.MockTransport(handle), retry=RetryPolicy(1), clock=lambda: now[0]
    )
    with pytest.raises(ProtocolError, match=rf"came slower than {MIN_ANSWER_BYTES_PER_S} bytes/s after 10 s"):
        client.checkin("p", "1.31.1") if path == "/checkin" else client.fetch_resource("c" * 64, "t0k3n")
    assert len(sent) == 2  # cut off at the second byte, 18 s in
    assert client.checkin("steady", "1.31.1").status == "rejected"
    client.close()


@pytest.mark.parametrize("window", [[0.0, 0.0], [0.0, 0.5], [0.25, 0.75]])
def test_a_window_of_nothing_does_not_make_the_device_check_in_again_at_once(tmp_path, window):
    """A server that named (0, 0) had the scheduler run the job again at once, for ever (on a
    virtual clock, ``run_until`` never returned): a turned-away job waits ``min_retry_s`` at least."""
    clock = VirtualClock()
    scheduler = ParticipationScheduler(
        tmp_path / "app.db", StaticConditions(GOOD), clock=clock, settings=SchedulerSettings(jitter=0.0)
    )
    runtime = FLRuntime(
        "p", "http://fl.test", InMemoryExampleStore(), transport=_hostile_server(window), cache_dir=tmp_path / "c"
    )
    scheduler.register_runtime("p", runtime)
    scheduler.schedule("p", TrainingConstraints(), TrainingInterval(recurrent=True, min_interval_s=3600.0))
    runs = scheduler.queue.run_until(clock.now() + 5.5)
    assert [run.outcome for run in runs] == [RunOutcome.NOT_SELECTED] * 6  # at 0, 1, ..., 5 s
    assert all(run.next_run_at - run.ended_at == SchedulerSettings().min_retry_s for run in runs)
    # an app's worker runs for months, every run held with its session: the last ones only
    assert scheduler.queue.history.maxlen == WorkerQueue.HISTORY == 1000
    scheduler.close()
    runtime.close()


error_fields = json_values | st.text(min_size=100, max_size=3000) | st.just("\x1b[2J\r\nX-Forged: 1")


@settings(max_examples=100, deadline=None)
@given(code=error_fields, message=error_fields, status=st.sampled_from([400, 403, 404, 409, 413, 429]))
def test_a_refusals_code_and_message_reach_the_app_as_a_short_line(code, message, status):
    """What a server says of a refusal goes to the app's logs and opstats (a report's rejection
    code): any JSON there was passed on as it came, of any type and length."""
    from device_runtime.protocol import ProtocolClient

    body = {"error": {"code": code, "message": message}}
    response = httpx.Response(status, content=json.dumps(body).encode(), request=httpx.Request("POST", "http://x/v1"))
    with pytest.raises(ProtocolError) as refused:
        ProtocolClient._raise_for_error(response)
    said = str(refused.value)
    assert refused.value.code is None or (isinstance(refused.value.code, str) and len(refused.value.code) <= 64)
    assert refused.value.code is None or refused.value.code == code
    assert len(said) <= 300 and said.isprintable() and refused.value.status == status


def test_a_secure_session_whose_server_names_a_report_window_of_years_waits_an_hour_at_most(tmp_path):
    """The Secure Aggregation wait ran to the check-in's ``report_deadline_s``, which the server
    names: 10^9 s and a group that never forms held the session for 30 years. The device waits
    at most an hour (``MAX_DEADLINE_S``) for its group, and its reason for leaving is on record,
    cut short: the server's abort reason is any text it likes."""
    import hashlib

    from device_runtime import OpStatsStore, encode_checkpoint, initial_weights
    from device_runtime.environment import RuntimeEnvironment
    from device_runtime.plan import serialize_plan
    from device_runtime.secagg_policy import SecAggPolicy
    from device_runtime.secure_client import MAX_DEADLINE_S
    from tests.support import digits_plan

    plan = serialize_plan(digits_plan(secure_aggregation=True))
    checkpoint = encode_checkpoint(initial_weights(digits_plan(secure_aggregation=True), seed=0))
    ids = {hashlib.sha256(b).hexdigest(): b for b in (plan, checkpoint)}
    answer = {
        **GOOD_ANSWER,
        "plan_id": hashlib.sha256(plan).hexdigest(),
        "checkpoint_id": hashlib.sha256(checkpoint).hexdigest(),
        "aggregation": "secure_sum",
        "report_deadline_s": 1e9,
        "max_examples_per_report": 100,
        "clip_update_norm": None,
    }
    polls: list[float] = []
    clock = VirtualClock()

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/checkin"):
            return httpx.Response(200, json=answer)
        if path.startswith("/v1/resources/"):
            return httpx.Response(200, content=ids[path.rsplit("/", 1)[1]])
        if path.endswith("/secagg"):
            polls.append(clock.now())
            return httpx.Response(200, json={"status": "waiting"})
        return httpx.Response(200, json={"status": "aborted"})

    store = InMemoryExampleStore()
    store.add(COLLECTION, [{"x": [0.0] * 64, "y": 1}] * 8)
    opstats = OpStatsStore(tmp_path / "app.db")
    start = clock.now()
    with FLRuntime(
        "digits",
        "http://fl.test",
        store,
        transport=httpx.MockTransport(handle),
        opstats=opstats,
        secagg_policy=SecAggPolicy(require_attested_cohort=False),
        environment=RuntimeEnvironment(clock=clock.now, sleep=clock.advance, secagg_poll_s=30.0),
    ) as runtime:
        result = runtime.run_session()
    assert result.outcome is Outcome.REPORT_REJECTED and result.rejection_code == "SECAGG_TIMED_OUT"
    assert polls[-1] - start <= MAX_DEADLINE_S
    assert [s.shape for s in opstats.sessions()] == ["-v#"]


def test_an_event_keeps_no_more_than_a_short_text_of_what_the_server_said(tmp_path):
    """A Secure Aggregation group's abort reason is any string the server sends (up to the 64 MiB
    an answer may hold), and it went into the app's opstats database as it came."""
    from device_runtime.runtime import _Recorder

    with FLRuntime("p", "http://fl.test", InMemoryExampleStore(), cache_dir=tmp_path / "c") as runtime:
        recorder = _Recorder(runtime)
        recorder.record("upload_rejected", code="SECAGG_ABORTED", detail="x" * 100_000, count=3)
    [event] = recorder.events
    assert event.detail == {"code": "SECAGG_ABORTED", "detail": "x" * _Recorder.MAX_TEXT, "count": 3}


DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 KB, far below the answers' bound


@pytest.mark.parametrize(
    "status, body",
    [(400, b'{"error":' + DEEP + b"}"), (409, DEEP), (200, DEEP), (200, b'{"status":' + DEEP + b"}")],
    ids=["refusal's error", "refusal", "state", "state's field"],
)
def test_json_nested_deeper_than_a_parser_goes_is_a_protocol_error(status, body):
    """httpx's ``Response.json`` (``json.loads``) recursed once per bracket: a refusal or a Secure
    Aggregation state of 100,000 nested ``[`` raised ``RecursionError``, not an SDK error."""
    from device_runtime.protocol import ProtocolClient
    from device_runtime.wire import CheckinAccepted

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    session = CheckinAccepted.model_validate(GOOD_ANSWER)
    client = ProtocolClient("http://fl.test", transport=httpx.MockTransport(handle), retry=RetryPolicy(attempts=1))
    with pytest.raises(ProtocolError) as refused:
        client.secagg_poll(session, after=0, wait_s=0.0)
    client.close()
    if status >= 400:
        assert refused.value.status == status and refused.value.code is None
    else:
        assert "Secure Aggregation state is not JSON" in str(refused.value)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("route", ["/checkin", "/v1/resources/", "/report"])
def test_a_redirect_is_followed_nowhere_and_ends_in_a_protocol_error(status, route):
    """A server that sends the device elsewhere (another host, where its token and its update would
    go) is not followed; a redirected download was refused as corrupted, as if bytes had come."""
    from device_runtime.protocol import ProtocolClient
    from device_runtime.wire import CheckinAccepted

    hosts: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        if route in request.url.path:
            return httpx.Response(status, headers={"Location": "http://elsewhere.test/v1/take"})
        return httpx.Response(200, json=GOOD_ANSWER)

    client = ProtocolClient("http://fl.test", transport=httpx.MockTransport(handle), retry=RetryPolicy(attempts=1))
    session = CheckinAccepted.model_validate(GOOD_ANSWER)
    calls = {
        "/checkin": lambda: client.checkin("p", "1.31.1"),
        "/v1/resources/": lambda: client.fetch_resource("a" * 64, "t0k3n"),
        "/report": lambda: client.report(session, b"update"),
    }
    with pytest.raises(ProtocolError, match=f"HTTP {status}, not a success") as refused:
        calls[route]()
    client.close()
    assert refused.value.status == status and hosts == ["fl.test"]
