"""Late reports after a round closed: each is refused and counted in the round's record, and the
record is written once however many came: by the ticker every ``late_metrics_every_s`` (by default
``LATE_METRICS_EVERY_S``), or when the rounds are read."""

from __future__ import annotations

import pytest

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
from device_runtime.wire import CheckinAccepted
from server_stub.errors import ApiError
from server_stub.persistence import ServerStore
from server_stub.rounds import RoundConfig
from server_stub.service import LATE_METRICS_EVERY_S, FLService
from tests.server_stub.test_defects import update_of
from tests.support import digits_plan


class CountingStore(ServerStore):
    """The real SQLite store, counting the writes of round metrics."""

    metric_writes = 0

    def update_round_metrics(self, *args, **kwargs):
        self.metric_writes += 1
        return super().update_round_metrics(*args, **kwargs)


@pytest.fixture(params=[LATE_METRICS_EVERY_S, 3600.0], ids=["default-period", "simulation-period"])
def round_with_stragglers(tmp_path, request):
    """A round of six selected devices that commits at two reports; four sessions are left."""
    now = [0.0]
    store = CountingStore(tmp_path / "server.db")
    service = FLService(store, clock=lambda: now[0], late_metrics_every_s=request.param)
    service.create_population("pop")
    plan = digits_plan()
    config = RoundConfig(
        goal_count=2, over_selection=3.0, selection_timeout_s=600.0, report_timeout_s=60.0, min_reports=2
    )
    service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    sessions = [service.checkin("pop", "1.31.1") for _ in range(6)]
    assert all(isinstance(s, CheckinAccepted) for s in sessions)
    update = encode_checkpoint(update_of(plan))
    for s in sessions[:2]:
        service.report(s.session_id, s.token, update)
    assert [r["status"] for r in service.rounds("pop")] == ["committed"]

    def late(s: dict) -> None:
        with pytest.raises(ApiError) as refused:
            service.report(s.session_id, s.token, update)
        assert refused.value.code == "REPORT_LATE"

    yield service, store, now, sessions[2:], late
    store.close()


def test_the_ticker_writes_late_reports_once_per_interval(round_with_stragglers):
    service, store, now, stragglers, late = round_with_stragglers
    writes = store.metric_writes
    late(stragglers[0])
    late(stragglers[1])
    assert store.metric_writes == writes  # nothing written per late report
    service.tick()
    assert store.metric_writes == writes + 1
    late(stragglers[2])
    now[0] += service.late_metrics_every_s / 2
    service.tick()
    assert store.metric_writes == writes + 1  # not due yet
    now[0] += service.late_metrics_every_s / 2
    service.tick()
    assert store.metric_writes == writes + 2
    record = service.rounds("pop")[0]  # (the next round may have begun meanwhile)
    assert record["metrics"]["rejected_late"] == 3 and record["metrics"]["reported"] == 2


def test_reading_the_rounds_shows_every_late_report_at_once(round_with_stragglers):
    service, store, now, stragglers, late = round_with_stragglers
    writes = store.metric_writes
    for s in stragglers:
        late(s)
    (record,) = service.rounds("pop")
    assert record["metrics"]["rejected_late"] == 4 and record["metrics"]["reported"] == 2
    assert store.metric_writes == writes + 1


def test_session_ids_and_tokens_come_from_the_services_token_source(tmp_path):
    """A simulation's seeded source gives the same sessions in every run; the default is the OS's."""
    import random

    def sessions(seed: int | None, name: str) -> list[tuple[str, str]]:
        store = ServerStore(tmp_path / f"{name}.db")
        kwargs = {} if seed is None else {"token_bytes": random.Random(seed).randbytes}
        service = FLService(store, clock=lambda: 0.0, **kwargs)
        service.create_population("pop")
        plan = digits_plan()
        config = RoundConfig(
            goal_count=2, over_selection=2.0, selection_timeout_s=600.0, report_timeout_s=60.0, min_reports=2
        )
        service.deploy_task(
            "pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config
        )
        answers = [service.checkin("pop", "1.31.1") for _ in range(3)]
        update = encode_checkpoint(update_of(plan))
        service.report(answers[0].session_id, answers[0].token, update)  # a drawn token authorizes its report
        with pytest.raises(ApiError):
            service.report(answers[1].session_id, answers[0].token, update)  # and only its own
        store.close()
        return [(a.session_id, a.token) for a in answers if isinstance(a, CheckinAccepted)]

    seeded = sessions(7, "a")
    assert seeded == sessions(7, "b")
    assert seeded != sessions(8, "c")
    drawn = sessions(None, "d") + sessions(None, "e")
    assert len({s for s, _ in drawn}) == len(drawn) == 6
    assert all(len(s) == 22 and len(t) == 43 for s, t in seeded + drawn)  # 16 and 32 bytes, URL-safe base64


def test_late_reports_of_a_round_retention_removed_are_logged_once_and_never_written_to_another_record(
    round_with_stragglers, caplog
):
    """Retention may remove a closed round's record while its stragglers still report. Their count
    has nowhere to go: it is logged once, and never written over the record that took the removed
    one's id (SQLite gives the id of a removed newest row to the next one)."""
    from server_stub.persistence import rounds

    service, store, now, stragglers, late = round_with_stragglers
    [task] = store.tasks("pop")
    [removed] = store.rounds(task.id)
    with store.engine.begin() as conn:  # as retention does, here to the round it would keep
        conn.execute(rounds.delete().where(rounds.c.id == removed.id))
    newer = store.record_round(task.id, 99, 1, "abandoned", {"selected": 0}, 1.0, 2.0)
    assert newer.id == removed.id
    late(stragglers[0])
    with caplog.at_level("INFO", logger="server_stub.commit"):
        service.write_late_metrics()
        late(stragglers[1])
        service.write_late_metrics()
    assert store.rounds(task.id)[0].metrics == {"selected": 0}
    said = [r.getMessage() for r in caplog.records if "late reports" in r.getMessage()]
    assert said == [
        "pop/train: the late reports of round 1 (attempt 1), 1 in all, are not recorded: retention removed its record"
    ], said
