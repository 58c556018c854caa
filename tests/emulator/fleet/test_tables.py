"""The run's tables: any rows survive a trip through CSV exactly, and the same rows write the
same bytes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulator.fleet import FleetRun, FleetTableError, RoundRow, SessionRow, TimelineRow

# Any text a CSV cell can hold: commas, quotes, line breaks, non-ASCII (not lone surrogates,
# which UTF-8 cannot encode).
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_any_float = st.floats(allow_nan=True, allow_infinity=True)
_int = st.integers(min_value=-(2**63), max_value=2**63)

_STRATEGY = {str: _text, float: _any_float, int: _int, bool: st.booleans()}


def rows_of(cls: type) -> st.SearchStrategy:
    return st.builds(cls, **{name: _STRATEGY[kind] for name, kind in cls.columns()})


def exact(row: object) -> tuple[str, ...]:
    """A row's values with NaN, -0.0 and the types told apart (NaN != NaN defeats ==)."""
    return tuple(f"{type(v).__name__}:{v!r}" for v in dataclasses.astuple(row))


@pytest.mark.parametrize("cls", [SessionRow, RoundRow, TimelineRow])
def test_any_rows_round_trip_through_csv_exactly(cls, tmp_path_factory):
    path = tmp_path_factory.mktemp(cls.__name__) / "table.csv"

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(rows_of(cls), max_size=8))
    def check(rows):
        cls.to_csv(rows, path)
        first = path.read_bytes()
        back = cls.from_csv(path)
        assert [exact(r) for r in back] == [exact(r) for r in rows]
        cls.to_csv(back, path)
        assert path.read_bytes() == first

    check()


def test_columns_follow_the_declared_fields_in_order(tmp_path):
    TimelineRow.to_csv([TimelineRow(0.0, 5, 2, 1, 1)], tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines() == [
        "t_s,available,checking_in,participating,active_sessions,resting",
        "0.0,5,2,1,1,0",
    ]
    older = tmp_path / "older.csv"  # a timeline written before the resting column reads back with 0
    older.write_text("t_s,available,checking_in,participating,active_sessions\r\n0.0,5,2,1,1\r\n")
    assert TimelineRow.from_csv(older) == [TimelineRow(0.0, 5, 2, 1, 1)]


def test_numpy_scalars_write_the_same_text_as_python_numbers(tmp_path):
    plain = RoundRow("r1", "train", 0.5, 60.25, True, 130, 110, 100, 20, 59.75, 0.875, float("nan"))
    numpy = RoundRow(
        "r1",
        "train",
        np.float64(0.5),
        np.float32(60.25),
        np.bool_(True),
        np.int64(130),
        np.int32(110),
        np.int64(100),
        np.int64(20),
        np.float64(59.75),
        np.float64(0.875),
        np.float64("nan"),
    )
    RoundRow.to_csv([plain], tmp_path / "a.csv")
    RoundRow.to_csv([numpy], tmp_path / "b.csv")
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    assert "0.5,60.25,true,130,110,100,20,59.75,0.875,nan" in (tmp_path / "a.csv").read_text()


def test_a_table_of_another_kind_is_refused_with_the_fix(tmp_path):
    RoundRow.to_csv([], tmp_path / "rounds.csv")
    with pytest.raises(FleetTableError, match="not a SessionRow table.*SessionRow.to_csv"):
        SessionRow.from_csv(tmp_path / "rounds.csv")
    with pytest.raises(FleetTableError, match="pass RoundRow rows"):
        RoundRow.to_csv([TimelineRow(0.0, 1, 1, 1, 1)], tmp_path / "x.csv")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("r1,train,0.0,1.0,yes,1,1,1,0,1.0,nan,nan,0,0,nan,committed", "'committed' holds a bool, got 'yes'"),
        ("r1,train,0.0,1.0,true,1.5,1,1,0,1.0,nan,nan,0,0,nan,committed", "'selected' holds a int"),
        ("r1,train,soon,1.0,true,1,1,1,0,1.0,nan,nan,0,0,nan,committed", "'start_s' holds a float"),
        ("r1,train,0.0,1.0,true,1,1,1,0,1.0,nan,0,0,nan", "line 2 has 14 values"),
    ],
)
def test_a_bad_value_names_its_line_and_column(tmp_path, line, message):
    path = tmp_path / "rounds.csv"
    header = ",".join(name for name, _ in RoundRow.columns())
    path.write_text(f"{header}\n{line}\n")
    with pytest.raises(FleetTableError, match=message.replace("(", r"\(")):
        RoundRow.from_csv(path)


def test_a_run_writes_its_three_tables(tmp_path):
    session = SessionRow(
        "d1", "s1", "train", "r1", 1.0, 2.5, "-v[]+^", "completed", 900, 300, 40, 1.0, 0.5, "1.31.1", "mid", 23.5
    )
    round_ = RoundRow("r1", "train", 0.0, 3.0, True, 1, 1, 1, 0, 3.0, 0.5, 1.25)
    sample = TimelineRow(0.0, 10, 3, 1, 1)
    run = FleetRun(sessions=[session], rounds=[round_], timeline=[sample], digest="00" * 32)
    run.write_tables(tmp_path / "out")
    assert SessionRow.from_csv(tmp_path / "out" / "sessions.csv") == [session]
    assert RoundRow.from_csv(tmp_path / "out" / "rounds.csv") == [round_]
    assert TimelineRow.from_csv(tmp_path / "out" / "timeline.csv") == [sample]


def test_the_span_comes_from_the_run_then_its_config_then_its_tables():
    from emulator.fleet.config import FleetConfig

    session = SessionRow("d1", "", "", "", 10.0, 7200.5, "-", "rejected", 0, 0, 0, 0.0, 0.0, "1.31.1", "mid", 1.0)
    run = FleetRun(sessions=[session], rounds=[], timeline=[TimelineRow(300.0, 1, 0, 0, 0)], digest="")
    assert run.span_s == 7200.5
    run.config = FleetConfig.default().replace(hours=3.0)
    assert run.span_s == 3 * 3600.0
    run.simulated_s = 42.0
    assert run.span_s == 42.0
    assert math.isfinite(FleetRun([], [], [], "").span_s) and FleetRun([], [], [], "").span_s == 0.0


def test_a_rounds_table_written_before_its_byte_columns_reads_back_with_zero_bytes(tmp_path):
    path = tmp_path / "rounds.csv"
    names = [name for name, _ in RoundRow.columns()]
    assert names[-4:] == ["bytes_down", "bytes_up", "epsilon", "outcome"]  # in the order they came
    path.write_text(",".join(names[:-4]) + "\r\nr1,train,0.0,1.0,true,1,1,1,0,1.0,0.5,nan\r\n")
    (row,) = RoundRow.from_csv(path)
    assert (row.round_id, row.accuracy, row.bytes_down, row.bytes_up, row.outcome) == ("r1", 0.5, 0, 0, "")
    assert math.isnan(row.epsilon) and not row.unfinished and not row.abandoned  # committed, from its column
    path.write_text(",".join(names[:-5]) + "\r\n")  # a column without a default is still required
    with pytest.raises(FleetTableError, match="not a RoundRow table"):
        RoundRow.from_csv(path)


def _session(round_id: str, start: float, down: int, up: int, attempt: int = 0) -> SessionRow:
    return SessionRow(
        "d",
        "s" if round_id else "",
        "t",
        round_id,
        start,
        start + 1.0,
        "-v[]+^",
        "completed",
        down,
        up,
        0,
        0.0,
        0.0,
        "1.31.1",
        "mid",
        0.0,
        attempt if round_id else 0,
    )


def _round(round_id: str, start: float, end: float) -> RoundRow:
    return RoundRow(round_id, "t", start, end, False, 1, 1, 1, 0, end - start, float("nan"), float("nan"))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "t/1", "t/2", "t/9"]),
            st.floats(0, 1000),
            st.integers(0, 10**6),
            st.integers(0, 10**6),
            st.integers(1, 3),
        ),
        max_size=30,
    )
)
def test_every_byte_of_a_seated_session_lands_in_the_attempt_that_seated_it(rows):
    from emulator.fleet.tables import with_round_bytes

    rounds = [_round("t/1/1", 0.0, 300.0), _round("t/1/2", 300.0, 600.0), _round("t/2/1", 600.0, 900.0)]
    sessions = [_session(*r) for r in rows]
    out = with_round_bytes(rounds, sessions)
    assert [r.round_id for r in out] == [r.round_id for r in rounds]
    for r in out:  # whenever the session started: a job started before a retry opens may be seated in it
        seated = [s for s in sessions if s.round_attempt == r.round_id]
        assert (r.bytes_down, r.bytes_up) == (sum(s.bytes_down for s in seated), sum(s.bytes_up for s in seated))
    counted = {r.round_id for r in rounds}
    lost = [s for s in sessions if s.round_attempt not in counted]
    assert sum(r.bytes_down for r in out) + sum(s.bytes_down for s in lost) == sum(s.bytes_down for s in sessions)


def test_a_session_started_before_a_retry_opened_counts_in_the_retry_that_seated_it():
    """The glyphs hour's d000456: its job started 4 ms before attempt 2 opened and attempt 2 seated it."""
    from emulator.fleet.tables import with_attempts, with_round_bytes

    rounds = [_round("t/15/1", 676.3, 707.0), _round("t/15/2", 861.0, 891.0)]
    row = _session("t/15", 860.996, 141_284, 129_283)
    out = with_round_bytes(rounds, with_attempts([row], {"s": 2}))
    assert [(r.bytes_down, r.bytes_up) for r in out] == [(0, 0), (141_284, 129_283)]
    assert [(r.bytes_down, r.bytes_up) for r in with_round_bytes(rounds, [row])] == [(0, 0), (0, 0)]  # no attempt known


def test_a_device_killed_and_seated_again_is_one_row_with_its_final_outcome():
    """Seed 0's 400 secure devices for 3 hours (goal 20): d000059 was killed after sending its
    masked input, checked in again 76 s later while the server held its seat, got the same session
    back and was interrupted; the round selected it once, and its rows were two. One row now, as
    the round counts it: from its first check-in, both check-ins' events, the last one's outcome,
    the bytes of both; rows of other seats stay as they were, in their order."""
    from emulator.fleet.tables import one_row_per_seat, unfinished_rounds, with_attempts

    killed = dataclasses.replace(
        _session("t/13", 7017.17, 5_000, 2_000), end_s=7128.71, shape="-v[]+", outcome="app_killed", compute_s=30.0
    )
    again = dataclasses.replace(
        _session("t/13", 7205.16, 300, 100), end_s=7205.67, shape="-v!", outcome="interrupted", compute_s=0.5
    )
    other = dataclasses.replace(_session("t/13", 7100.0, 1, 1), device_id="e", session_id="s2")
    rows = with_attempts([killed, other, again], {"s": 2, "s2": 2})
    merged = one_row_per_seat(rows)
    assert [(r.device_id, r.session_id) for r in merged] == [("e", "s2"), ("d", "s")]
    seat = merged[1]
    assert (seat.start_s, seat.end_s, seat.shape, seat.outcome) == (7017.17, 7205.67, "-v[]+-v!", "interrupted")
    assert (seat.bytes_down, seat.bytes_up, seat.compute_s, seat.attempt) == (5_300, 2_100, 30.5, 2)
    (open_round,) = unfinished_rounds([], merged, 8000.0)  # as many sessions as the round selected
    assert open_round.selected == 2 and open_round.round_id == "t/13/2"
    assert one_row_per_seat([killed, other]) == [killed, other]


def test_a_masked_input_summed_before_its_device_was_interrupted_is_no_drop_out():
    """Under Secure Aggregation a device interrupted during Unmasking (``-v[]+!``) whose group
    summed its masked input contributed: the server counts it as reported, and the session-based
    drop-out rate does not count it (it did, while the round's ``accepted`` counted it)."""
    from emulator.fleet.summary import is_dropout, summarize
    from emulator.fleet.tables import unfinished_rounds, with_attempts

    row = dataclasses.replace(_session("t/1", 10.0, 1, 1), shape="-v[]+!", outcome="interrupted")
    dropped = dataclasses.replace(row, session_id="s2")
    seated = with_attempts([row, dropped], {"s": 1, "s2": 1}, summed={"s"})
    assert [s.summed for s in seated] == [True, False]
    assert [is_dropout(s) for s in seated] == [False, True]
    run = FleetRun(sessions=seated, rounds=[], timeline=[], digest="")
    assert run.summary()["dropout_rate"] == 0.5 == summarize(run)["dropout_rate"]
    (open_round,) = unfinished_rounds([], seated, 100.0)
    assert (open_round.selected, open_round.reported, open_round.accepted, open_round.dropped) == (2, 1, 1, 1)
