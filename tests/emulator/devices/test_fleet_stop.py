"""A real-time fleet's stop ends every session under way: a late device waiting to report is not
waited for, its session ends interrupted and the server is told."""

from __future__ import annotations

import threading
import time

from emulator.devices.device import DeviceProfile, EmulatedDevice, RealTimeFleet
from tests.support import COLLECTION, deploy


def test_a_stop_ends_a_late_devices_wait_before_its_report_and_tells_the_server(tmp_path, server, admin, digits):
    deploy(admin, goal_count=5, min_fraction=1.0, report_timeout_s=600.0)  # the round stays open
    # late by an hour: a stop that waited for it would still be waiting long after the join's timeout
    device = EmulatedDevice(
        "late-0", tmp_path / "late-0", server.url, "digits", collection_uri=COLLECTION,
        profile=DeviceProfile(late_prob=1.0, late_delay_s=3600.0),
    )  # fmt: skip
    device.add_examples(digits.x_train[:20], digits.y_train[:20])
    fleet = RealTimeFleet([device])
    fleet.start()
    deadline = time.monotonic() + 30
    while admin.status("digits")["current_round"]["selected"] < 1:  # its session is under way
        assert time.monotonic() < deadline, "the device was never selected"
        time.sleep(0.02)
    fleet.stop(timeout=10.0)
    assert not any(t.is_alive() for t in threading.enumerate() if t.name == "late-0")
    assert fleet.outcomes() == {"interrupted": 1}  # not reported, not left open
    assert admin.status("digits")["current_round"]["aborted"] == 1  # the server was told
    fleet.remove_folders()
    assert not device.root.exists()
