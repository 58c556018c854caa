"""The sample app embeds the SDK as an app would, against a real server."""

from __future__ import annotations

import time

from device_runtime.conditions import DeviceState, StaticConditions
from example_store import ExampleSelector
from examples.digits_app import COLLECTION, POPULATION, DigitsApp
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
    # The app's examples are sealed under its key: no example's pixels are on disk in the clear.
    disk = b"".join(p.read_bytes() for p in (tmp_path / "app").glob("app.db*"))
    assert all(x.astype("float32").tobytes() not in disk for x in digits.x_train[:25])

    reopened = DigitsApp(tmp_path / "app", server.url, conditions)  # an app restart
    [job] = reopened.scheduler.jobs()
    assert job.population == POPULATION and job.interval.recurrent
    assert reopened.store.sealed and reopened.store.count(ExampleSelector(COLLECTION)) == 25
    reopened.disable_federated_learning()
    assert reopened.scheduler.jobs() == []
    reopened.close()
