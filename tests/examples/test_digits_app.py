"""The sample app embeds the SDK as an app would, against a real server."""

from __future__ import annotations

import time

from device_runtime.conditions import DeviceState, StaticConditions
from examples.digits_app import POPULATION, DigitsApp
from tests.support import deploy

READY = DeviceState(idle=True, charging=True, battery_level=1.0, unmetered_network=True)


def test_sample_app_trains_in_the_background_and_keeps_its_schedule(tmp_path, server, admin, digits):
    deploy(admin, POPULATION, goal_count=1, over_selection=1.0)
    conditions = StaticConditions(READY)
    app = DigitsApp(tmp_path / "app", server.url, conditions)
    for x, y in zip(digits.x_train[:25], digits.y_train[:25]):
        app.on_digit_written(x, int(y))
    app.enable_federated_learning(every_s=0.2)
    app.scheduler.queue.start()
    deadline = time.monotonic() + 20
    while app.opstats.shape_counts(POPULATION)["-v[]+^"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    app.scheduler.queue.stop()
    assert app.opstats.shape_counts(POPULATION)["-v[]+^"] >= 2
    assert sum(r["status"] == "committed" for r in admin.rounds(POPULATION)) >= 2
    app.close()

    reopened = DigitsApp(tmp_path / "app", server.url, conditions)  # an app restart
    [job] = reopened.scheduler.jobs()
    assert job.population == POPULATION and job.interval.recurrent
    reopened.disable_federated_learning()
    assert reopened.scheduler.jobs() == []
    reopened.close()
