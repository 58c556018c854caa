"""Training constraints: ``satisfied`` (asked between every two training steps) says exactly
what ``unmet`` lists, for every constraint and state."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from device_runtime.conditions import BATTERY_LOW_FRACTION, DeviceState, TrainingConstraints

LEVELS = st.one_of(st.sampled_from([0.0, BATTERY_LOW_FRACTION, 1.0]), st.floats(0.0, 1.0))


@given(
    st.builds(TrainingConstraints, st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    st.builds(DeviceState, st.booleans(), st.booleans(), LEVELS, st.booleans(), st.booleans()),
)
def test_satisfied_is_nothing_unmet(constraints, state):
    assert constraints.satisfied(state) is (not constraints.unmet(state))


def test_the_papers_constraints_need_idle_charging_unmetered_and_a_network():
    good = DeviceState(idle=True, charging=True, battery_level=0.5, unmetered_network=True)
    paper = TrainingConstraints()
    assert paper.satisfied(good)
    for field in ("idle", "charging", "unmetered_network", "network_available"):
        assert not paper.satisfied(DeviceState(**{**vars(good), field: False}))
    low = TrainingConstraints(requires_charging=False, requires_battery_not_low=True)
    assert low.satisfied(DeviceState(True, False, BATTERY_LOW_FRACTION, True))
    assert not low.satisfied(DeviceState(True, False, BATTERY_LOW_FRACTION / 2, True))
    assert low.satisfied(DeviceState(True, True, 0.0, True))  # charging is never low
