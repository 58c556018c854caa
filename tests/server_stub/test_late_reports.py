"""Late reports after a round closed: each is refused and counted in the round's record, and the
record is written once however many came: by the ticker every ``LATE_METRICS_EVERY_S``, or when
the rounds are read."""

from __future__ import annotations

import pytest

from device_runtime import encode_checkpoint, initial_weights
from device_runtime.plan import serialize_plan
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


@pytest.fixture
def round_with_stragglers(tmp_path):
    """A round of six selected devices that commits at two reports; four sessions are left."""
    now = [0.0]
    store = CountingStore(tmp_path / "server.db")
    service = FLService(store, clock=lambda: now[0])
    service.create_population("pop")
    plan = digits_plan()
    config = RoundConfig(goal_count=2, over_selection=3.0, selection_timeout_s=600.0, report_timeout_s=60.0, min_reports=2)
    service.deploy_task("pop", "train", serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), config)
    sessions = [service.checkin("pop", "1.31.1") for _ in range(6)]
    assert all(s["status"] == "accepted" for s in sessions)
    update = encode_checkpoint(update_of(plan))
    for s in sessions[:2]:
        service.report(s["session_id"], s["token"], update)
    assert [r["status"] for r in service.rounds("pop")] == ["committed"]

    def late(s: dict) -> None:
        with pytest.raises(ApiError) as refused:
            service.report(s["session_id"], s["token"], update)
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
    now[0] += LATE_METRICS_EVERY_S / 2
    service.tick()
    assert store.metric_writes == writes + 1  # not due yet
    now[0] += LATE_METRICS_EVERY_S / 2
    service.tick()
    assert store.metric_writes == writes + 2
    (record,) = service.rounds("pop")
    assert record["metrics"]["rejected_late"] == 3 and record["metrics"]["reported"] == 2


def test_reading_the_rounds_shows_every_late_report_at_once(round_with_stragglers):
    service, store, now, stragglers, late = round_with_stragglers
    writes = store.metric_writes
    for s in stragglers:
        late(s)
    (record,) = service.rounds("pop")
    assert record["metrics"]["rejected_late"] == 4 and record["metrics"]["reported"] == 2
    assert store.metric_writes == writes + 1
