"""Availability traces: the documented CSV replays to the conditions it records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet import (
    AVAILABLE,
    FleetConfig,
    TraceAvailability,
    TraceError,
    generate_population,
    load_traces,
    write_traces,
)
from emulator.fleet.traces import format_state, parse_state


def test_written_traces_replay_to_the_models_conditions(tmp_path):
    config = FleetConfig.default().replace(devices=60, hours=30.0, seed=9)
    path = tmp_path / "day.csv"
    rows = write_traces(config, path)
    assert rows > 60 and path.read_text().startswith("device,start,end,state\n")
    model = generate_population(config)
    replayed = generate_population(
        config.model_copy(update={"availability": config.availability.model_copy(update={"trace": str(path)})})
    )
    probes = np.linspace(0.0, config.horizon_s - 1e-6, 2000)
    for m, r in zip(model, replayed):
        assert isinstance(r.availability, TraceAvailability)
        assert (m.device_class, m.runtime_version) == (r.device_class, r.runtime_version)
        assert [m.availability.flags_at(t) & AVAILABLE for t in probes] == [
            r.availability.flags_at(t) & AVAILABLE for t in probes
        ]
        change = r.availability.next_change(0.0)
        assert change is None or r.availability.flags_at(change) != r.availability.flags_at(0.0)


def test_a_device_missing_from_the_trace_is_never_available(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("device,start,end,state\nd000001,10.0,20.0,idle+charging+unmetered\n")
    config = FleetConfig.default().replace(devices=3)
    config = config.model_copy(update={"availability": config.availability.model_copy(update={"trace": str(path)})})
    a, b, _ = generate_population(config)
    assert not any(a.availability.available_at(t) for t in (0.0, 15.0, 1e5)) and a.availability.next_change(0.0) is None
    assert [b.availability.available_at(t) for t in (9.9, 10.0, 19.9, 20.0)] == [False, True, True, False]
    assert b.availability.next_change(0.0) == 10.0 and b.availability.next_change(10.0) == 20.0


spans_strategy = st.lists(st.tuples(st.floats(0.1, 1000.0), st.integers(0, 7)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(pieces=spans_strategy, t=st.floats(-10.0, 15_000.0))
def test_a_trace_holds_exactly_the_recorded_state(pieces, t):
    # Back-to-back spans of random lengths and states, every other one left out (a gap).
    spans, start = [], 0.0
    for k, (length, flags) in enumerate(pieces):
        if k % 2 == 0:
            spans.append((start, start + length, flags))
        start += length
    trace = TraceAvailability.from_spans(spans)
    at = max(t, 0.0)  # before the run, the state at its start holds
    expected = next((f for s, e, f in spans if s <= at < e), 0)
    assert trace.flags_at(t) & AVAILABLE == expected
    change = trace.next_change(t)
    if change is not None:
        assert change > t and trace.flags_at(change) != trace.flags_at(t)


@pytest.mark.parametrize("flags", range(8))
def test_states_are_written_and_read_back(flags):
    assert parse_state(format_state(flags)) == flags
    assert parse_state("unmetered+idle") == parse_state("idle+unmetered")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("device,begin,end,state\n", "header"),
        ("device,start,end,state\nd000001,0,10\n", ":2: expected 4 columns"),
        ("device,start,end,state\nphone-1,0,10,idle\n", ":2: device 'phone-1'"),
        ("device,start,end,state\nd000001,0,10,idle\nd000001,5,20,charging\n", "overlapping"),
        ("device,start,end,state\nd000001,10,10,idle\n", ":2: need 0 <= start < end"),
        ("device,start,end,state\nd000001,-1,10,idle\n", ":2: need 0 <= start < end"),
        ("device,start,end,state\nd000001,0,nan,idle\n", ":2: need 0 <= start < end"),
        ("device,start,end,state\nd000001,0,ten,idle\n", ":2:"),
        ("device,start,end,state\nd000001,0,10,asleep\n", ":2: unknown condition 'asleep'"),
        ("device,start,end,state\nd000009,0,10,idle\n", ":2: device d000009 is outside a fleet of 5"),
        (  # a log's datetimes, time zone and all: the format counts seconds from the run's start
            "device,start,end,state\nd000001,2026-11-27T08:00:00+01:00,2026-11-27T09:00:00+01:00,idle\n",
            ":2: start '2026-11-27T08:00:00+01:00' is a date and time; a trace's times are seconds since the run's start",
        ),
        ("device,start,end,state\nd000001,0,soon,idle\n", ":2: end 'soon' is not a number of seconds"),
        (  # Unix times: every span after the run, where the run would have met no device at all
            "device,start,end,state\nd000001,1764230400,1764234000,idle\nd000002,1764231000,1764234000,idle\n",
            "every span starts after the run's 2 hours (the first at 1764230400 s, 20,419 days in)",
        ),
    ],
)
def test_a_malformed_trace_is_refused_saying_where(tmp_path, text, where):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_traces(path, devices=5, horizon_s=7200.0)
    assert where in str(info.value)


def test_a_trace_saved_by_a_spreadsheet_reads_past_its_byte_order_mark(tmp_path):
    path = tmp_path / "day.csv"
    path.write_bytes("device,start,end,state\r\nd000001,0,10,idle\r\n".encode("utf-8-sig"))
    assert load_traces(path)["d000001"].flags_at(5.0) & AVAILABLE == parse_state("idle")


def test_a_missing_trace_file_says_how_to_make_one(tmp_path):
    with pytest.raises(TraceError, match="write_traces"):
        load_traces(tmp_path / "none.csv")


def test_a_trace_that_is_a_folder_or_not_text_is_refused_saying_so(tmp_path):
    with pytest.raises(TraceError, match=r"cannot read the availability trace .*\(Is a directory\)"):
        load_traces(tmp_path)
    binary = tmp_path / "day.csv"
    binary.write_bytes(b"\xff\xfe" + "device,start,end,state\n".encode("utf-16-le"))
    with pytest.raises(TraceError, match="is not UTF-8 text"):
        load_traces(binary)
