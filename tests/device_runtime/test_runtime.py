"""The SDK's runtime against a real server, and against a real but faulty HTTP peer in front of it
(5xx bursts, corrupted downloads) to check retries and refusals."""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import random
import stat
import tempfile
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from device_runtime import (
    CacheUnavailable,
    CorruptResource,
    FLRuntime,
    NoExamples,
    OpStatsStore,
    Outcome,
    RetryPolicy,
    ServerUnreachable,
    SessionRejected,
)
from device_runtime.plan_cache import STALE_PARTIAL_S, DirectoryPlanCache
from device_runtime.protocol import ProtocolClient
from example_store import InMemoryExampleStore, SQLiteExampleStore
from server_stub import free_port
from tests.support import COLLECTION, LoopbackApp, deploy, digits_plan

FAST_RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


class FaultyProxy:
    """Forwards to the FL server, failing the first ``fail_first`` requests with 503 and, if asked,
    flipping a byte in every downloaded resource."""

    def __init__(self, upstream: str, *, fail_first: int = 0, corrupt_resources: bool = False) -> None:
        self.upstream = upstream
        self.fail_first = fail_first
        self.corrupt = corrupt_resources
        self.seen = 0
        self.http = httpx.Client(base_url=upstream, timeout=10)

        async def forward(request: Request) -> Response:
            self.seen += 1
            if self.seen <= self.fail_first:
                return Response(b'{"error":{"code":"UNAVAILABLE","message":"try later"}}', status_code=503)
            body = await request.body()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            upstream = self.http.request(request.method, request.url.path, content=body, headers=headers)
            content = upstream.content
            if self.corrupt and request.url.path.startswith("/v1/resources/") and content:
                content = bytes([content[0] ^ 1]) + content[1:]
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

        self.loopback = LoopbackApp(Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])]))

    def __enter__(self) -> str:
        return self.loopback.__enter__().url

    def __exit__(self, *exc: object) -> None:
        self.loopback.__exit__()
        self.http.close()


@pytest.fixture
def store(tmp_path, digits):
    with SQLiteExampleStore(tmp_path / "app.db") as s:
        s.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])))
        yield s


def test_session_completes_and_plan_is_cached(server, admin, store, tmp_path):
    deploy(admin, goal_count=5)
    runtime = FLRuntime("digits", server.url, store, cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    first = runtime.run_session()
    assert first.outcome is Outcome.COMPLETED and first.shape == "-v[]+^"
    assert first.num_examples == 40 and first.round == 1
    assert list((tmp_path / "cache" / "plans").iterdir())
    first_bytes = runtime.client.bytes_received
    second = runtime.run_session()
    assert second.outcome is Outcome.COMPLETED
    second_bytes = runtime.client.bytes_received - first_bytes
    plan_bytes = sum(p.stat().st_size for p in (tmp_path / "cache" / "plans").iterdir())
    assert second_bytes < first_bytes - plan_bytes + 1024  # the plan came from the cache


def test_a_cached_plan_changed_on_disk_is_downloaded_again_and_replaced(server, admin, store, tmp_path, caplog):
    """A copy that no longer matches its id (a storage fault) is never run: the next session, in a
    restarted app, downloads the plan, says why, and writes the good copy back, so the session
    after that reads it from the cache again instead of downloading it every time."""
    deploy(admin, goal_count=5)
    cache = tmp_path / "cache"
    with FLRuntime("digits", server.url, store, cache_dir=cache, retry=FAST_RETRY) as runtime:
        assert runtime.run_session().outcome is Outcome.COMPLETED
    (cached,) = (cache / "plans").iterdir()
    good = cached.read_bytes()
    cached.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    paths: list[str] = []

    def session() -> None:
        transport = httpx.HTTPTransport()
        original = transport.handle_request

        def handle(request: httpx.Request) -> httpx.Response:
            paths.append(request.url.path)
            return original(request)

        transport.handle_request = handle  # type: ignore[method-assign]
        with FLRuntime("digits", server.url, store, cache_dir=cache, retry=FAST_RETRY, transport=transport) as again:
            assert again.run_session().outcome is Outcome.COMPLETED

    session()
    assert f"/v1/resources/{cached.name}" in paths
    assert "does not match its id" in caplog.text
    assert cached.read_bytes() == good
    paths.clear()
    session()
    assert f"/v1/resources/{cached.name}" not in paths  # from the cache again


def test_the_plan_cache_folders_it_makes_are_its_owners_only(tmp_path):
    """Their names are the plans' ids, which say what tasks the device took part in."""
    data = b"plan"
    old = os.umask(0o022)  # the usual umask, under which the folders were 0755
    try:
        DirectoryPlanCache(tmp_path / "app" / "fl-cache").put(hashlib.sha256(data).hexdigest(), data)
    finally:
        os.umask(old)
    made = [tmp_path / "app", tmp_path / "app" / "fl-cache", tmp_path / "app" / "fl-cache" / "plans"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in made] == [0o700] * 3
    assert stat.S_IMODE(next((tmp_path / "app" / "fl-cache" / "plans").iterdir()).stat().st_mode) == 0o600


def test_a_plans_folder_an_earlier_version_made_listable_is_made_its_owners_only(tmp_path):
    """An updated app's cache keeps its ``plans`` folder: made 0755 before, it listed the ids of the
    plans the device downloaded to every user of the machine."""
    cache_dir = tmp_path / "fl-cache"
    (cache_dir / "plans").mkdir(parents=True)
    for folder in (cache_dir, cache_dir / "plans"):
        os.chmod(folder, 0o755)
    data = b"plan"
    DirectoryPlanCache(cache_dir).put(hashlib.sha256(data).hexdigest(), data)
    assert stat.S_IMODE((cache_dir / "plans").stat().st_mode) == 0o700
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o755  # the app's own folder: as it chose it


def test_a_plans_folder_an_earlier_version_made_listable_is_made_its_owners_only_when_its_plan_is_read(tmp_path):
    """An updated app whose task goes on runs the plan it cached before the update, for as long as the
    task runs: its ``plans`` folder, made 0755 then, listed the plan's id to every user until another
    plan came. It is made the owner's only at the first read of a plan in it."""
    data = b"plan"
    plan_id = hashlib.sha256(data).hexdigest()
    plans = tmp_path / "fl-cache" / "plans"
    plans.mkdir(parents=True)
    (plans / plan_id).write_bytes(data)
    os.chmod(plans, 0o755)
    assert DirectoryPlanCache(tmp_path / "fl-cache").get(plan_id) == data
    assert stat.S_IMODE(plans.stat().st_mode) == 0o700


def test_a_partial_plan_copy_left_by_a_killed_writer_is_removed(tmp_path):
    """A device killed while writing a plan leaves a partial copy under a temporary name: never
    read as a plan, and removed by a later write once its writer's lock is free (its process
    ended), or once it is older than any live write. By age alone, the partial copy of an app
    killed mid-download and started again within the hour stayed until another plan was written."""
    import fcntl

    cache = DirectoryPlanCache(tmp_path)
    plans = [bytes([i]) * 100 for i in range(2)]
    ids = [hashlib.sha256(p).hexdigest() for p in plans]
    cache.put(ids[0], plans[0])
    partial = tmp_path / "plans" / f".{ids[1]}.abc.tmp"
    partial.write_bytes(plans[1][:10])
    old_style = tmp_path / "plans" / f"{ids[1]}.tmp"
    old_style.write_bytes(plans[1][:10])
    assert cache.get(ids[1]) is None
    fresh = tmp_path / "plans" / f".{ids[1]}.def.tmp"  # a write still going on, its lock held
    fresh.write_bytes(b"")
    killed = tmp_path / "plans" / f".{ids[1]}.ghi.tmp"  # a writer killed a moment ago: its lock free
    killed.write_bytes(plans[1][:10])
    old = time.time() - STALE_PARTIAL_S - 10
    os.utime(partial, (old, old))
    os.utime(old_style, (old, old))
    with open(fresh, "rb") as writing:
        fcntl.flock(writing, fcntl.LOCK_EX)
        cache.put(ids[1], plans[1])
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == sorted([ids[0], ids[1], fresh.name])
    assert cache.get(ids[1]) == plans[1]


def test_rejection_carries_the_retry_window(server, admin, store, tmp_path):
    deploy(admin, goal_count=1, over_selection=1.0, retry_window_s=(7, 9))
    FLRuntime("digits", server.url, store, retry=FAST_RETRY).client.checkin("digits", "1.31.1")
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, rng=random.Random(3))
    with pytest.raises(SessionRejected) as rejected:
        runtime.run_session()
    assert rejected.value.retry_after_s == (7.0, 9.0)
    assert runtime.last_retry_window == (7.0, 9.0)
    assert_spread_over([runtime.next_retry_delay() for _ in range(1000)], 7.0, 9.0)


def test_a_runtime_without_a_cache_dir_leaves_no_folder_behind(server, admin, store):
    """Its plan cache is a temporary folder of its own: gone on close, or when it is dropped."""
    deploy(admin, goal_count=5)
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY)
    assert runtime.run_session().outcome is Outcome.COMPLETED
    cache = runtime.cache_dir
    assert list((cache / "plans").iterdir())
    runtime.close()
    assert not cache.exists()
    dropped = FLRuntime("digits", server.url, store).cache_dir
    gc.collect()
    assert dropped.exists() is False


def test_a_runtime_that_cannot_make_its_own_cache_folder_says_what_to_do(tmp_path, monkeypatch):
    """An unusable temp folder (here a file where a folder should be, refused whoever runs it) was
    a bare OSError out of FLRuntime(); now a typed error naming the folder and what to do."""
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_folder / "tmp"))
    store = InMemoryExampleStore()
    with pytest.raises(
        CacheUnavailable, match=r"cannot make the plan cache folder in .*a-file/tmp .*cache_dir="
    ) as err:
        FLRuntime("digits", "http://127.0.0.1:9", store)
    assert isinstance(err.value, OSError) and "Traceback" not in str(err.value)
    assert FLRuntime("digits", "http://127.0.0.1:9", store, cache_dir=tmp_path / "cache").cache_dir is not None


def test_a_given_cache_dir_outlives_its_runtime(server, admin, store, tmp_path):
    deploy(admin, goal_count=5)
    with FLRuntime("digits", server.url, store, retry=FAST_RETRY, cache_dir=tmp_path / "cache") as runtime:
        assert runtime.run_session().outcome is Outcome.COMPLETED
    assert list((tmp_path / "cache" / "plans").iterdir())


def test_unreachable_server_raises_after_retries(store):
    slept = []
    runtime = FLRuntime("digits", f"http://127.0.0.1:{free_port()}", store, retry=FAST_RETRY, timeout_s=1)
    runtime.client.sleep = slept.append
    with pytest.raises(ServerUnreachable):
        runtime.run_session()
    assert len(slept) == FAST_RETRY.attempts - 1
    assert all(0 <= s <= FAST_RETRY.max_delay_s for s in slept)


class LosingReports(httpx.HTTPTransport):
    """Real HTTP, but once the network goes (``lost``) a report never leaves (ConnectError), or,
    with ``first_arrives``, the first one reaches the server and its answer is lost (ReadError)."""

    def __init__(self, *, first_arrives: bool) -> None:
        super().__init__()
        self.first_arrives = first_arrives
        self.reports = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/report"):
            return super().handle_request(request)
        self.reports += 1
        if self.first_arrives and self.reports == 1:
            super().handle_request(request).close()  # the server took it
            raise httpx.ReadError("the network went before the answer arrived", request=request)
        raise httpx.ConnectError("the device has no network", request=request)


@pytest.mark.parametrize("first_arrives", [True, False], ids=["answer-lost", "never-sent"])
def test_a_report_whose_answer_was_lost_counts_as_taking_part(server, admin, store, tmp_path, first_arrives):
    """A report that reached the server and whose answer was lost, the server unreachable for its
    retries, ended ``-v[]+*`` as if it had never left: not taking part, its examples trained on
    and sent again in the next session (the server counting them twice). It now takes part as an
    app killed during its upload does; one whose every attempt failed to connect still does not."""
    deploy(admin, goal_count=2, over_selection=1.0, min_fraction=1.0)
    opstats = OpStatsStore(tmp_path / "opstats.db")
    transport = LosingReports(first_arrives=first_arrives)
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, opstats=opstats, transport=transport)
    with pytest.raises(ServerUnreachable):
        runtime.run_session()
    assert transport.reports == FAST_RETRY.attempts
    assert admin.status("digits")["current_round"]["reported"] == (1 if first_arrives else 0)
    [session] = opstats.sessions("digits")
    assert session.shape == "-v[]+*"
    assert session.events[-1].detail.get("may_be_held", False) is first_arrives
    took = opstats.last_participation("digits")
    assert (took.session_id if took else None) == (session.session_id if first_arrives else None)
    runtime.close()
    opstats.close()


def assert_spread_over(draws: list[float], lo: float, hi: float) -> None:
    """``draws`` look uniform on [lo, hi]: inside it, reaching both ends, half of them in each
    half. A constant (no jitter) or a draw from the wrong interval fails; with 1000 draws a
    uniform one fails by chance with probability below 1e-9."""
    width = hi - lo
    assert all(lo <= d <= hi for d in draws), (min(draws), max(draws), lo, hi)
    assert min(draws) < lo + 0.02 * width and max(draws) > hi - 0.02 * width
    assert 0.4 < sum(d < lo + width / 2 for d in draws) / len(draws) < 0.6
    assert len(set(draws)) > 0.9 * len(draws)


@settings(max_examples=30, deadline=None)
@given(
    base=st.floats(1e-3, 10.0),
    max_delay=st.floats(1e-3, 100.0),
    attempt=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_backoff_is_full_jitter_up_to_the_capped_exponential(base, max_delay, attempt, seed):
    policy = RetryPolicy(attempts=4, base_delay_s=base, max_delay_s=max_delay)
    rng = random.Random(seed)
    cap = min(max_delay, base * 2**attempt)
    assert_spread_over([policy.delay(attempt, rng) for _ in range(1000)], 0.0, cap)


def test_the_client_sleeps_a_fresh_jittered_backoff_before_each_retry():
    """The client's waits between attempts are draws of ``RetryPolicy.delay`` for that attempt,
    from the client's random source: attempt k waits uniformly in [0, min(max, base * 2**k)]."""
    policy = RetryPolicy(attempts=4, base_delay_s=0.1, max_delay_s=0.3)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    slept: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(refuse)) as http:
        client = ProtocolClient(
            "http://fl.invalid", retry=policy, rng=random.Random(5), sleep=slept.append, client=http
        )
        for _ in range(500):
            with pytest.raises(ServerUnreachable):
                client.eligibility_info("digits")
    assert len(slept) == 500 * (policy.attempts - 1)
    for k in range(1, policy.attempts):  # attempt k follows k failed ones
        assert_spread_over(slept[k - 1 :: policy.attempts - 1], 0.0, min(0.3, 0.1 * 2**k))


@settings(max_examples=20, deadline=None)
@given(lo=st.floats(0.0, 3600.0), width=st.floats(0.01, 3600.0), seed=st.integers(0, 2**32 - 1))
def test_next_retry_delay_is_jittered_over_the_servers_window(lo, width, seed, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "unused-cache"
    with FLRuntime(
        "digits", "http://fl.invalid", InMemoryExampleStore(), rng=random.Random(seed), cache_dir=cache
    ) as runtime:
        runtime.last_retry_window = (lo, lo + width)
        assert_spread_over([runtime.next_retry_delay() for _ in range(1000)], lo, lo + width)


def test_5xx_bursts_are_retried(server, admin, store):
    deploy(admin, goal_count=5)
    with FaultyProxy(server.url, fail_first=2) as url:
        result = FLRuntime("digits", url, store, retry=FAST_RETRY).run_session()
    assert result.outcome is Outcome.COMPLETED


def test_corrupted_download_is_refused_and_session_aborted(server, admin, store):
    deploy(admin, goal_count=5)
    with FaultyProxy(server.url, corrupt_resources=True) as url:
        runtime = FLRuntime("digits", url, store, retry=FAST_RETRY)
        with pytest.raises(CorruptResource):
            runtime.run_session()
    status = admin.status("digits")
    assert status["round"] == 1
    # the device told the server at once: its session counts as aborted, not as silent
    current = status["current_round"]
    assert (current["selected"], current["reported"], current["aborted"]) == (1, 0, 1)


def test_no_matching_examples_raises_and_aborts_the_session(server, admin, tmp_path, digits):
    """A store holding nothing the plan's selector matches (here: only another collection)."""
    deploy(admin, goal_count=5)
    with SQLiteExampleStore(tmp_path / "other.db") as other:
        other.add("app:/other", ({"x": x, "y": y} for x, y in zip(digits.x_train[:10], digits.y_train[:10])))
        runtime = FLRuntime("digits", server.url, other, retry=FAST_RETRY)
        with pytest.raises(NoExamples):
            runtime.run_session()
    current = admin.status("digits")["current_round"]
    assert (current["selected"], current["reported"], current["aborted"]) == (1, 0, 1)
    assert admin.rounds("digits") == []


def test_interrupted_session_sends_no_update(server, admin, store):
    deploy(admin, goal_count=1, over_selection=2.0, min_fraction=1.0)
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY)
    result = runtime.run_session(should_abort=lambda: True)
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
    assert admin.rounds("digits") == []
    ok = FLRuntime("digits", server.url, store, retry=FAST_RETRY).run_session()
    assert ok.outcome is Outcome.COMPLETED
    rounds = closed_rounds(admin, "digits")
    assert rounds[0]["status"] == "committed" and rounds[0]["metrics"]["aborted"] == 1


def test_an_error_of_a_session_closed_meanwhile_reaches_the_app_as_itself(server, admin, store, tmp_path):
    """Only what ``close`` cut short ends a session as interrupted: the app's hook that closed the
    runtime and then failed ended it as ``-v[!`` (a result, no error), and the app never saw its bug."""
    deploy(admin, goal_count=1, over_selection=2.0, min_fraction=1.0)
    opstats = OpStatsStore(tmp_path / "opstats.db")
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, opstats=opstats)

    def should_abort() -> bool:
        runtime.close()  # the app shutting down, from the session's own thread
        raise KeyError("the app's own bug")

    with pytest.raises(KeyError, match="the app's own bug"):
        runtime.run_session(should_abort=should_abort)
    [session] = opstats.sessions("digits")
    assert session.shape == "-v[*"
    opstats.close()


def test_an_update_that_diverged_to_nan_is_not_sent_and_the_session_aborted(server, admin, store):
    """A plain report as a secure one: the device does not send an update the server would refuse."""
    told: list[str] = []
    real_abort = server.service.abort

    def abort(session_id, token, reason, stats=None):  # the real service's abort, heard
        told.append(reason)
        return real_abort(session_id, token, reason, stats)

    server.service.abort = abort
    deploy(admin, plan=digits_plan("softmax", learning_rate=1e38), goal_count=1, over_selection=2.0)
    result = FLRuntime("digits", server.url, store, retry=FAST_RETRY).run_session()
    assert (result.outcome, result.rejection_code) == (Outcome.REPORT_REJECTED, "INVALID_UPDATE")
    kinds = [e.kind for e in result.events]
    assert "training_completed" in kinds and "upload_started" not in kinds
    (rejected,) = [e for e in result.events if e.kind == "upload_rejected"]
    assert "NaN or infinite" in rejected.detail["reason"]
    assert [r for r in told if r.startswith("the update is not valid")] == told and len(told) == 1


def test_opstats_that_cannot_be_written_leave_the_sessions_result_to_the_app(server, admin, store, tmp_path, caplog):
    """The session happened: the app sees its result, and a warning that its statistics were lost."""
    deploy(admin, goal_count=1, over_selection=2.0, min_fraction=1.0)
    opstats = OpStatsStore(tmp_path / "opstats.db")
    opstats.close()  # as a full disk or a damaged file would refuse the write
    runtime = FLRuntime("digits", server.url, store, retry=FAST_RETRY, opstats=opstats)
    with caplog.at_level(logging.WARNING, logger="device_runtime"):
        result = runtime.run_session(should_abort=lambda: True)
    assert result.outcome is Outcome.INTERRUPTED and result.shape == "-v[!"
    assert "this session's operational statistics were not kept" in caplog.text


def closed_rounds(admin, population: str, timeout_s: float = 5.0) -> list[dict]:
    """The population's closed rounds, once there is one. The commit is written outside the
    server's lock, by whichever thread gets there first (the report's or the ticker's), so the
    report's answer can arrive before the round is on record."""
    deadline = time.monotonic() + timeout_s
    while not (rounds := admin.rounds(population)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return rounds


def test_a_devices_dp_noise_is_seeded_from_the_os_unless_the_app_gave_a_seeded_stream(tmp_path):
    """The device's own stream also times its check-ins, which the server sees: an unseeded
    device does not draw its distributed-DP noise from it; a seeded one (a simulation) does, so
    its run repeats."""
    store = InMemoryExampleStore()
    unseeded = FLRuntime("digits", "http://127.0.0.1:9", store, cache_dir=tmp_path / "a")
    state = unseeded.rng.getstate()
    draws = [int(unseeded._noise_generator().integers(1 << 62)) for _ in range(2)]
    assert unseeded.rng.getstate() == state and draws[0] != draws[1]
    seeded = [
        FLRuntime("digits", "http://127.0.0.1:9", store, cache_dir=tmp_path / f"s{i}", rng=random.Random(5))
        for i in range(2)
    ]
    assert len({int(r._noise_generator().integers(1 << 62)) for r in seeded}) == 1
    for runtime in (unseeded, *seeded):
        runtime.close()
