"""Plans that resume reading where this device's last completed session stopped: the plan field,
where the tokens are kept, and sessions against a real server (disjoint slices, no movement on an
interrupted or rejected session, survival across an app restart, wrap-around, refused tokens)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable

import numpy as np
import pytest

from device_runtime import (
    FLRuntime,
    OpStatsStore,
    Outcome,
    PlanError,
    RetryPolicy,
    SessionResult,
    build_softmax_regression_plan,
    load_plan,
    serialize_plan,
)
from device_runtime.clock import VirtualClock
from device_runtime.plan import _PREFIX, MAGIC
from device_runtime.reading import MemoryResumptionTokens, ResumptionTokenKeeper
from example_store import (
    Example,
    ExampleIterator,
    ExampleSelector,
    ExampleStore,
    InMemoryExampleStore,
    SQLiteExampleStore,
)
from server_stub import ServerThread
from tests.support import COLLECTION, deploy, digits_plan

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
N = 40
LIMIT = 15


# ----------------------------------------------------------------------------- the plan field


def _rewrite_device(data: bytes, **fields: object) -> bytes:
    """The plan with its header's device fields changed (a value of ... deletes the field),
    re-sealed as someone who writes plans by hand would."""
    _, version, header_len, total = _PREFIX.unpack_from(data, 0)
    header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
    for key, value in fields.items():
        if value is ...:
            header["device"].pop(key, None)
        else:
            header["device"][key] = value
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = data[_PREFIX.size + header_len : total - 32]
    new_total = _PREFIX.size + len(header_bytes) + len(body) + 32
    content = _PREFIX.pack(MAGIC, version, len(header_bytes), new_total) + header_bytes + body
    return content + hashlib.sha256(content).digest()


def test_resume_round_trips_and_is_absent_from_plans_that_do_not_resume():
    resuming = digits_plan(resume_examples=True)
    data = serialize_plan(resuming)
    loaded = load_plan(data)
    assert loaded.device.resume is True and serialize_plan(loaded) == data
    plain = serialize_plan(digits_plan())
    assert b'"resume"' not in plain  # plans that do not resume keep the bytes (and ids) they had
    assert load_plan(plain).device.resume is False
    # A plan written before the field existed is the resuming plan without it: it parses, not resuming.
    assert load_plan(_rewrite_device(data, resume=...)).device.resume is False
    assert load_plan(_rewrite_device(data, resume=False)).device.resume is False


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, [True]])
def test_resume_of_the_wrong_type_is_refused(bad):
    data = _rewrite_device(serialize_plan(digits_plan()), resume=bad)
    with pytest.raises(PlanError, match="device.resume must be true or false"):
        load_plan(data)


def test_builders_take_resume_examples():
    assert build_softmax_regression_plan(
        64, 10, selector=ExampleSelector(COLLECTION), resume_examples=True
    ).device.resume
    assert not digits_plan("mlp").device.resume and digits_plan("mlp", resume_examples=True).device.resume
    with pytest.raises(TypeError, match="resume_examples must be True or False"):
        digits_plan(resume_examples="yes")


# ----------------------------------------------------------------------------- where tokens are kept


def test_opstats_keeps_one_token_per_population_task_and_collection(tmp_path):
    opstats = OpStatsStore(tmp_path / "app.db")
    memory = MemoryResumptionTokens()
    for keeper in (opstats, memory):
        assert isinstance(keeper, ResumptionTokenKeeper)
        assert keeper.resumption_token("digits", "train", COLLECTION) is None
        keeper.save_resumption_token("digits", "train", COLLECTION, "t1", 1.0)
        keeper.save_resumption_token("digits", "train", COLLECTION, "t2", 2.0)  # replaces
        keeper.save_resumption_token("digits", "eval", COLLECTION, "e1", 3.0)
        keeper.save_resumption_token("other", "train", COLLECTION, "o1", 3.0)
        assert keeper.resumption_token("digits", "train", COLLECTION) == "t2"
        assert keeper.resumption_token("digits", "train", "app:/other") is None
        keeper.forget_resumption_token("digits", "eval", COLLECTION)
        assert keeper.resumption_token("digits", "eval", COLLECTION) is None
        assert keeper.resumption_token("other", "train", COLLECTION) == "o1"
    opstats.close()
    reopened = OpStatsStore(tmp_path / "app.db")
    assert reopened.resumption_token("digits", "train", COLLECTION) == "t2"
    reopened.close()


# ----------------------------------------------------------------------------- sessions over HTTP


class _RecordingIterator(ExampleIterator):
    def __init__(self, inner: ExampleIterator, read: list[int]) -> None:
        self._inner = inner
        self._read = read

    def __next__(self) -> Example:
        item = next(self._inner)
        self._read.extend(int(i) for i in np.ravel(item["id"]))
        return item

    def close(self) -> None:
        self._inner.close()

    def resumption_token(self) -> str:
        return self._inner.resumption_token()


class RecordingStore(ExampleStore):
    """Serves another store's examples and records the ``id`` of each one read, per iterator."""

    def __init__(self, inner: ExampleStore) -> None:
        self.inner = inner
        self.iterators: list[list[int]] = []

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        self.iterators.append([])
        return _RecordingIterator(self.inner.query(selector), self.iterators[-1])

    def query_batches(self, selector: ExampleSelector, batch_size: int) -> ExampleIterator:
        self.iterators.append([])
        return _RecordingIterator(self.inner.query_batches(selector, batch_size), self.iterators[-1])

    def count(self, selector: ExampleSelector) -> int:
        return self.inner.count(selector)

    def take(self) -> list[list[int]]:
        """The ids each iterator read since the last take."""
        out, self.iterators = self.iterators, []
        return out

    def close(self) -> None:
        self.inner.close()


def _examples(digits, ids: Iterable[int]) -> list[dict]:
    return [{"x": digits.x_train[i], "y": digits.y_train[i], "id": np.int64(i)} for i in ids]


def _resuming_deploy(admin, **plan_kwargs):
    kwargs = dict(selector=ExampleSelector(COLLECTION, limit=LIMIT), resume_examples=True)
    kwargs.update(plan_kwargs)
    return deploy(admin, plan=digits_plan(**kwargs), goal_count=1, over_selection=1.0)


def _session(runtime: FLRuntime, store: RecordingStore, **kwargs) -> tuple[SessionResult, set[int]]:
    result = runtime.run_session(**kwargs)
    reads = store.take()
    assert reads, "the session read nothing"
    return result, set().union(*map(set, reads))


def _resume_mode(result: SessionResult) -> str:
    return next(e.detail["resume"] for e in result.events if e.kind == "training_started")


@pytest.fixture
def sqlite_store(tmp_path, digits):
    with SQLiteExampleStore(tmp_path / "examples.db") as s:
        s.add(COLLECTION, _examples(digits, range(N)))
        yield s


def test_completed_sessions_read_disjoint_slices_then_wrap_around(server, admin, sqlite_store):
    _resuming_deploy(admin)
    store = RecordingStore(sqlite_store)
    runtime = FLRuntime("digits", server.url, store, retry=FAST)  # no opstats: tokens in memory
    seen = []
    for _ in range(4):
        result, ids = _session(runtime, store)
        assert result.outcome is Outcome.COMPLETED
        seen.append((ids, result.num_examples, _resume_mode(result)))
    assert seen == [
        (set(range(0, 15)), 15, "from_start"),
        (set(range(15, 30)), 15, "continued"),
        (set(range(30, 40)), 10, "continued"),  # the partial last slice is read as it is
        (set(range(0, 15)), 15, "wrapped"),  # nothing was left after the token: from the beginning
    ]
    rounds = admin.rounds("digits")
    assert [r["status"] for r in rounds] == ["committed"] * 4


def test_interrupted_and_rejected_sessions_leave_the_saved_token(server, admin, tmp_path, sqlite_store):
    _resuming_deploy(admin, epochs=1)
    store = RecordingStore(sqlite_store)
    opstats = OpStatsStore(tmp_path / "opstats.db")
    runtime = FLRuntime("digits", server.url, store, retry=FAST, opstats=opstats)
    key = ("digits", "train", COLLECTION)

    result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(15))
    saved = opstats.resumption_token(*key)
    assert saved is not None

    steps = []
    result, ids = _session(runtime, store, should_abort=lambda: steps.append(1) or len(steps) > 1)
    assert result.outcome is Outcome.INTERRUPTED and ids <= set(range(15, 30))
    assert opstats.resumption_token(*key) == saved  # no partial state

    result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(15, 30))  # the interrupted slice again
    assert opstats.resumption_token(*key) != saved
    opstats.close()


def test_a_rejected_report_leaves_the_saved_token(tmp_path, sqlite_store):
    clock = VirtualClock()
    with ServerThread(tmp_path / "server.db", clock=clock.now) as server, server.admin() as admin:
        _rejected_report_leaves_the_token(server, admin, sqlite_store, clock)


def _rejected_report_leaves_the_token(server, admin, sqlite_store, clock) -> None:
    plan = digits_plan(selector=ExampleSelector(COLLECTION, limit=LIMIT), resume_examples=True, epochs=1)
    deploy(admin, plan=plan, goal_count=1, over_selection=2.0, report_timeout_s=10.0, selection_timeout_s=600)
    store = RecordingStore(sqlite_store)
    runtime = FLRuntime("digits", server.url, store, retry=FAST)
    key = ("digits", "train", COLLECTION)

    result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(15))
    saved = runtime.resumption_tokens.resumption_token(*key)

    result, ids = _session(runtime, store, before_report=lambda: clock.advance(11.0))  # past the report deadline
    assert result.outcome is Outcome.REPORT_REJECTED and result.rejection_code == "REPORT_LATE"
    assert ids == set(range(15, 30))
    assert runtime.resumption_tokens.resumption_token(*key) == saved

    result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(15, 30))


def test_the_token_survives_an_app_restart(server, admin, tmp_path, digits):
    _resuming_deploy(admin)
    with SQLiteExampleStore(tmp_path / "examples.db") as examples:
        examples.add(COLLECTION, _examples(digits, range(N)))
    for expected in (set(range(0, 15)), set(range(15, 30))):
        # Each pass is an app start: the example store, the opstats database and the runtime are new.
        with SQLiteExampleStore(tmp_path / "examples.db") as examples:
            store = RecordingStore(examples)
            opstats = OpStatsStore(tmp_path / "app.db")
            with FLRuntime("digits", server.url, store, retry=FAST, opstats=opstats) as runtime:
                result, ids = _session(runtime, store)
            opstats.close()
        assert result.outcome is Outcome.COMPLETED and ids == expected


def test_the_furthest_position_read_is_kept_across_epochs(server, admin, digits, sqlite_store):
    """Examples added while the first epoch trains are read by the second one; the token kept is
    the last epoch's, so the next session reads only what came after them."""
    _resuming_deploy(admin, selector=ExampleSelector(COLLECTION), epochs=2)
    store = RecordingStore(sqlite_store)
    runtime = FLRuntime("digits", server.url, store, retry=FAST)
    added = []

    def add_during_first_epoch() -> bool:
        if not added:
            added.append(sqlite_store.add(COLLECTION, _examples(digits, range(N, N + 5))))
        return False

    result = runtime.run_session(should_abort=add_during_first_epoch)
    first_epoch, second_epoch = store.take()
    assert result.outcome is Outcome.COMPLETED
    assert set(first_epoch) == set(range(N)) and set(second_epoch) == set(range(N + 5))

    sqlite_store.add(COLLECTION, _examples(digits, range(N + 5, N + 10)))
    result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(N + 5, N + 10))
    assert _resume_mode(result) == "continued"


def test_a_refused_token_is_dropped_with_a_warning(server, admin, tmp_path, digits, caplog):
    _resuming_deploy(admin)
    opstats = OpStatsStore(tmp_path / "app.db")
    first = InMemoryExampleStore()
    first.add(COLLECTION, _examples(digits, range(N)))
    store = RecordingStore(first)
    result, ids = _session(FLRuntime("digits", server.url, store, retry=FAST, opstats=opstats), store)
    assert ids == set(range(15))

    # The app re-creates its store: same examples, a new token key, so the saved token is refused.
    rekeyed = InMemoryExampleStore()
    rekeyed.add(COLLECTION, _examples(digits, range(N)))
    store = RecordingStore(rekeyed)
    runtime = FLRuntime("digits", server.url, store, retry=FAST, opstats=opstats)
    with caplog.at_level(logging.WARNING, logger="device_runtime.reading"):
        result, ids = _session(runtime, store)
    assert result.outcome is Outcome.COMPLETED and ids == set(range(15)) and _resume_mode(result) == "from_start"
    assert any("refused the saved resumption token" in r.getMessage() for r in caplog.records)

    result, ids = _session(runtime, store)  # the new store's token is saved and used
    assert ids == set(range(15, 30)) and _resume_mode(result) == "continued"
    opstats.close()
