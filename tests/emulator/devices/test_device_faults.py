"""An emulated device survives whatever its session raises: the error is counted, the loop goes on."""

from __future__ import annotations

import threading

from emulator.devices.device import EmulatedDevice, RealTimeFleet


def test_an_unexpected_error_is_counted_and_the_device_keeps_running(tmp_path):
    device = EmulatedDevice("d0", tmp_path / "d0", "http://127.0.0.1:9", "p")
    calls = []

    def out_of_descriptors(**_kwargs):  # fault injection: what a full fd table raises
        calls.append(1)
        if len(calls) >= 3:
            fleet._stop.set()
        raise OSError(24, "Too many open files")

    device.runtime.run_session = out_of_descriptors  # type: ignore[method-assign]
    device.profile = type(device.profile)(cooldown_s=(0.0, 0.01))
    fleet = RealTimeFleet([device])
    fleet.start()
    assert fleet._stop.wait(10)
    fleet.stop()
    assert len(calls) >= 3
    assert fleet.outcomes()["error:OSError"] == len(calls)
    assert not any(t.is_alive() for t in threading.enumerate() if t.name == "d0")
