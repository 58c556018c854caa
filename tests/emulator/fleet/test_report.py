"""The fleet report: its files exist, its images are real plots, its numbers are the run's."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet import (
    FleetReportError,
    FleetRun,
    RoundRow,
    SessionRow,
    TimelineRow,
    simulate,
    summarize,
    write_report,
)
from emulator.fleet.config import FleetConfig
from emulator.fleet.report import FIGURE_FILES, PLOTS, available_by_hour, script_json

pytest.importorskip("matplotlib")
#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again; the
#: compare tests read the same fleet (``goal8_fleet``) in the same group.
pytestmark = pytest.mark.xdist_group("fleet_reports")

# Shapes of the paper's Table 1 plus rarer failures, with the shares the synthetic fleet draws.
_SHAPES = ("-v[]+^", "-v[]+#", "-v[!", "-v!", "-v[]+*", "-!")
_SHAPE_P = (0.72, 0.2, 0.04, 0.02, 0.01, 0.01)


def synthetic_run(*, seed: int = 0, hours: float = 24.0, devices: int = 300, rounds: int = 40) -> FleetRun:
    """A run as the simulator would record it, drawn from a seeded generator (no simulator)."""
    rng = np.random.default_rng(seed)
    span = hours * 3600.0
    timeline = []
    for t in np.arange(0.0, span, 300.0):
        day = 0.5 * (1 + math.cos(2 * math.pi * (t / 86400.0 - 0.1)))  # peak near 02:24 UTC
        available = int(devices * (0.1 + 0.3 * day) + rng.integers(0, 5))
        participating = int(rng.integers(0, max(1, available // 3)))
        timeline.append(
            TimelineRow(float(t), available, int(rng.integers(0, available + 1)), participating, participating)
        )
    round_rows = []
    sessions = []
    for i in range(rounds):
        start = float(rng.uniform(0, span - 900))
        duration = float(rng.uniform(60, 600))
        selected = int(rng.integers(5, 40))
        dropped = int(rng.integers(0, selected // 4 + 1))
        reported = selected - dropped
        accepted = int(rng.integers(0, reported + 1))
        committed = bool(rng.random() < 0.8)
        accuracy = float(0.3 + 0.6 * i / rounds) if committed and i % 3 else float("nan")
        loss = float(2.0 - 1.5 * i / rounds) if committed else float("nan")
        round_id = f"r{i:03d}"
        round_rows.append(
            RoundRow(
                round_id,
                "train",
                start,
                start + duration,
                committed,
                selected,
                reported,
                accepted,
                dropped,
                duration,
                accuracy,
                loss,
            )
        )
        for j in range(selected):
            shape = str(rng.choice(_SHAPES, p=_SHAPE_P))
            s_start = start + float(rng.uniform(0, 30))
            s_end = s_start + float(rng.uniform(10, duration))
            sessions.append(
                SessionRow(
                    device_id=f"d{int(rng.integers(devices)):05d}",
                    session_id=f"{round_id}-s{j}",
                    task="train",
                    round_id=round_id,
                    start_s=s_start,
                    end_s=s_end,
                    shape=shape,
                    outcome="completed" if shape.endswith("^") else "other",
                    bytes_down=int(rng.integers(10_000, 20_000)),
                    bytes_up=int(rng.integers(2_000, 5_000)) if "+" in shape else 0,
                    examples=int(rng.integers(0, 50)),
                    compute_s=float(rng.uniform(0, 5)),
                    network_s=float(rng.uniform(0, 5)),
                    runtime_version=str(rng.choice(["1.17.3", "1.20.1", "1.31.0"])),
                    device_class=str(rng.choice(["low", "mid", "high"])),
                    local_hour=float(rng.uniform(0, 24)),
                )
            )
    for k in range(devices):
        t = float(rng.uniform(0, span))
        sessions.append(
            SessionRow(f"d{k:05d}", "", "", "", t, t + 0.5, "-", "rejected", 300, 0, 0, 0.0, 0.5, "1.20.1", "mid", 12.0)
        )
    sessions.sort(key=lambda s: (s.start_s, s.device_id))
    round_rows.sort(key=lambda r: r.start_s)
    return FleetRun(
        sessions=sessions, rounds=round_rows, timeline=timeline, digest="ab" * 32, wall_s=12.5, simulated_s=span
    )


# --- reading the report back ------------------------------------------------------------------


class _ReportParser(HTMLParser):
    """Collects the report's machine-readable parts: every ``data-value`` cell by table, the
    summary cells by key, the embedded images and the embedded summary JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[object]]] = {}
        self.summary: dict[str, object] = {}
        self.images: dict[str, bytes] = {}
        self.json_text = ""
        self._table: str | None = None
        self._figure: str | None = None
        self._in_json = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag == "td" and "data-value" in a:
            value = json.loads(a["data-value"])
            self.tables[self._table][-1].append(value)
            if "data-key" in a:
                self.summary[a["data-key"]] = value
        elif tag == "figure":
            self._figure = a["id"]
        elif tag == "img":
            prefix = "data:image/png;base64,"
            assert a["src"].startswith(prefix)
            self.images[self._figure] = base64.b64decode(a["src"][len(prefix) :])
        elif tag == "script" and a.get("id") == "summary-json":
            self._in_json = True

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        elif tag == "script":
            self._in_json = False

    def handle_data(self, data):
        if self._in_json:
            self.json_text += data


def _parse_report(path) -> _ReportParser:
    parser = _ReportParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _decode_png(data: bytes) -> np.ndarray:
    from matplotlib.image import imread

    return imread(io.BytesIO(data), format="png")


def _has_colour(pixels: np.ndarray, hex_colour: str, *, at_least: int = 50) -> bool:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    close = np.all(np.abs(pixels[..., :3] - rgb) < 2 / 255, axis=-1)
    return int(close.sum()) >= at_least


# --- values computed here from the tables, independently of emulator.fleet.report ---------------


def _expected(run: FleetRun) -> dict[str, object]:
    accepted = [s for s in run.sessions if s.session_id]
    ended = [s for s in accepted if s.outcome != "unfinished"]  # cut by the run's end: neither
    dropped = [s for s in ended if s.shape[-1] not in "^#"]
    hours = np.floor(np.array([r.t_s for r in run.timeline]) / 3600.0).astype(int) % 24
    available = np.array([r.available for r in run.timeline], dtype=float)
    hourly = [available[hours == h].mean() for h in np.unique(hours)]
    committed = [r for r in run.rounds if r.committed]
    return {
        "sessions": len(run.sessions),
        "sessions_accepted": len(accepted),
        "checkins_rejected": len(run.sessions) - len(accepted),
        "sessions_completed": sum(s.shape.endswith("^") for s in accepted),
        "dropout_rate": len(dropped) / len(ended),
        "shapes": dict(Counter(s.shape for s in ended)),
        "bytes_down": int(sum(s.bytes_down for s in run.sessions)),
        "bytes_up": int(sum(s.bytes_up for s in run.sessions)),
        "rounds": len(run.rounds),
        "rounds_committed": len(committed),
        "rounds_abandoned": len(run.rounds) - len(committed),
        "available_peak": max(hourly),
        "available_trough": min(hourly),
        "availability_swing": max(hourly) / max(min(hourly), 1.0),
        "accuracy": [r.accuracy for r in committed if not math.isnan(r.accuracy)][-1],
        "simulated_s": run.simulated_s,
        "sim_s_per_wall_s": run.simulated_s / run.wall_s,
        "completed_sessions_per_wall_s": sum(s.shape.endswith("^") for s in accepted) / run.wall_s,
    }


@pytest.fixture(scope="session")
def run() -> FleetRun:
    return synthetic_run(seed=7)


@pytest.fixture(scope="session")
def report_dir(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    write_report(run, out)
    return out


def _assert_matches(actual: dict, expected: dict) -> None:
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-12), key
        else:
            assert got == want, key


def test_the_report_writes_its_tables_summary_plots_and_page(report_dir):
    names = {"sessions.csv", "rounds.csv", "timeline.csv", "summary.json", "report.html"}
    names |= {f"{p.__name__.removeprefix('plot_')}.png" for p in PLOTS}
    assert names <= {p.name for p in report_dir.iterdir()}
    assert all((report_dir / n).stat().st_size > 0 for n in names)
    # the plots a later run into the folder removes first (report.clear_run): every one it may draw
    assert {p.name for p in report_dir.iterdir() if p.suffix == ".png"} <= set(FIGURE_FILES)


def test_the_images_are_real_plots_of_the_run(run, report_dir):
    for plot in PLOTS:
        pixels = _decode_png((report_dir / f"{plot.__name__.removeprefix('plot_')}.png").read_bytes())
        height, width, _ = pixels.shape
        assert width == 900 and height >= 400, plot.__name__
        rgb = (pixels[..., :3] * 255).round().astype(np.uint32)
        colours = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
        assert len(colours) >= 20, plot.__name__  # lines, text and antialiasing, not a blank page
        assert pixels[..., :3].std() > 0.02, plot.__name__
    # The data is drawn, in the colours the figures give it.
    devices = _decode_png((report_dir / "devices.png").read_bytes())
    assert _has_colour(devices, "#2ca02c") and _has_colour(devices, "#8e44ad") and _has_colour(devices, "#1f77b4")
    shapes = _decode_png((report_dir / "shapes.png").read_bytes())
    assert _has_colour(shapes, "#2ca02c", at_least=2000)  # the -v[]+^ bar
    assert _has_colour(shapes, "#ff7f0e", at_least=500)  # the -v[]+# bar


def test_the_summary_json_holds_the_runs_numbers(run, report_dir):
    summary = json.loads((report_dir / "summary.json").read_text())
    _assert_matches(summary, _expected(run))
    assert summary["digest"] == run.digest
    assert summary == json.loads(json.dumps(summarize(run)))


def test_the_html_page_holds_the_runs_numbers_plots_and_rounds(run, report_dir):
    page = _parse_report(report_dir / "report.html")
    expected = _expected(run)
    _assert_matches(page.summary, {k: v for k, v in expected.items() if k != "shapes"})
    assert json.loads(page.json_text) == json.loads((report_dir / "summary.json").read_text())
    shape_rows = page.tables["shapes"][1:]
    assert {shape: count for shape, count, _share in shape_rows} == expected["shapes"]
    assert [count for _s, count, _share in shape_rows] == sorted(expected["shapes"].values(), reverse=True)
    round_rows = page.tables["rounds"][1:]
    assert len(round_rows) == len(run.rounds)
    for cells, r in zip(round_rows, run.rounds):
        assert (
            cells[0] == r.round_id
            and cells[5] == r.committed
            and cells[6:10] == [r.selected, r.reported, r.accepted, r.dropped]
        )
        assert cells[4] == r.duration_s and (
            cells[10] == r.accuracy if not math.isnan(r.accuracy) else cells[10] is None
        )
    for plot in PLOTS:
        name = f"{plot.__name__.removeprefix('plot_')}.png"
        assert page.images[name] == (report_dir / name).read_bytes()
    text = (report_dir / "report.html").read_text()
    assert "<link" not in text and "http" not in text and 'src="data:image/png;base64,' in text  # self-contained


def test_the_same_run_writes_the_same_bytes(run, report_dir, tmp_path):
    write_report(synthetic_run(seed=7), tmp_path)
    for path in report_dir.iterdir():
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


# --- edge cases -------------------------------------------------------------------------------


def _timeline(available_by_hour: list[int]) -> list[TimelineRow]:
    """Twelve samples per hour, hour h holding ``available_by_hour[h]`` devices."""
    return [TimelineRow(h * 3600.0 + k * 300.0, n, 0, 0, 0) for h, n in enumerate(available_by_hour) for k in range(12)]


def test_an_empty_run_has_undefined_rates_and_still_writes_a_report(tmp_path):
    empty = FleetRun(sessions=[], rounds=[], timeline=[], digest="cd" * 32)
    summary = write_report(empty, tmp_path)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "dropout_rate",
        "availability_swing",
        "round_completion_rate",
        "round_duration_median_s",
        "accuracy",
        "loss",
        "sim_s_per_wall_s",
        "sessions_per_wall_s",
    ):
        assert summary[key] is None, key
    assert summary["shapes"] == {} and summary["rounds"] == summary["sessions"] == 0
    page = _parse_report(tmp_path / "report.html")
    assert page.summary["dropout_rate"] is None and page.tables["rounds"] == [[]] and len(page.images) == len(PLOTS)
    for data in page.images.values():
        pixels = _decode_png(data)
        assert pixels.shape[1] == 900 and pixels[..., :3].std() > 0.01  # axes and "no ... in this run"


def test_a_run_of_rejected_check_ins_has_no_shapes_and_no_dropout():
    rejected = [
        SessionRow(f"d{i}", "", "", "", float(i), i + 0.5, "-", "rejected", 200, 0, 0, 0.0, 0.5, "1.31.1", "mid", 3.0)
        for i in range(5)
    ]
    summary = summarize(FleetRun(sessions=rejected, rounds=[], timeline=_timeline([3] * 24), digest="", wall_s=2.0))
    assert summary["shapes"] == {} and summary["dropout_rate"] is None
    assert summary["checkins_rejected"] == summary["sessions"] == 5 and summary["sessions_accepted"] == 0
    assert summary["bytes_down"] == 1000 and summary["availability_swing"] == 1.0
    assert summary["sessions_per_wall_s"] == 0.0


def test_a_trough_of_zero_available_devices_reads_as_the_peak_count():
    day = [40] * 24
    day[13:16] = [0, 0, 0]
    summary = summarize(FleetRun(sessions=[], rounds=[], timeline=_timeline(day), digest=""))
    assert (summary["available_peak"], summary["available_trough"], summary["availability_swing"]) == (40.0, 0.0, 40.0)
    never = summarize(FleetRun(sessions=[], rounds=[], timeline=_timeline([0] * 24), digest=""))
    assert never["availability_swing"] == 1.0
    json.dumps(summary, allow_nan=False)


def test_hours_of_day_start_at_the_configs_start_hour():
    config = FleetConfig.from_dict({"fleet": {"devices": 50, "seed": 3, "start_utc_hour": 6.0}})
    timeline = _timeline([10, 20, 30])
    assert list(available_by_hour(timeline, 6.0)) == [6, 7, 8]
    summary = summarize(FleetRun(sessions=[], rounds=[], timeline=timeline, digest="", config=config))
    assert (summary["devices"], summary["seed"], summary["availability_swing"]) == (50, 3, 3.0)
    assert summary["simulated_s"] == config.horizon_s


_shape = st.text(alphabet="-v[]+^#!*", min_size=1, max_size=7).map(lambda s: "-" + s)


@st.composite
def _runs(draw) -> FleetRun:
    n = draw(st.integers(0, 30))
    sessions = [
        SessionRow(
            f"d{i}",
            draw(st.sampled_from(["", f"s{i}"])),
            "t",
            "",
            float(i),
            i + 1.0,
            draw(_shape),
            "",
            draw(st.integers(0, 10**6)),
            draw(st.integers(0, 10**6)),
            0,
            0.0,
            0.0,
            "1.31.1",
            "mid",
            draw(st.floats(0, 23.99)),
        )
        for i in range(n)
    ]
    rounds = [
        RoundRow(
            f"r{i}",
            "t",
            0.0,
            1.0,
            draw(st.booleans()),
            3,
            2,
            1,
            1,
            draw(st.floats(0, 1e4)),
            draw(st.floats(allow_nan=True, allow_infinity=False)),
            draw(st.floats(allow_nan=True, allow_infinity=False)),
        )
        for i in range(draw(st.integers(0, 10)))
    ]
    counts = draw(st.lists(st.integers(0, 10**4), max_size=30))
    timeline = [TimelineRow(300.0 * i, c, 0, 0, 0) for i, c in enumerate(counts)]
    return FleetRun(sessions, rounds, timeline, digest="", wall_s=draw(st.floats(0, 100)))


@settings(max_examples=100, deadline=None)
@given(_runs())
def test_any_run_summarizes_to_strict_json_whose_counts_add_up(run):
    summary = summarize(run)
    json.dumps(summary, allow_nan=False)
    assert sum(summary["shapes"].values()) == summary["sessions_accepted"]
    assert summary["sessions_accepted"] + summary["checkins_rejected"] == summary["sessions"] == len(run.sessions)
    assert summary["rounds_committed"] + summary["rounds_abandoned"] == summary["rounds"] == len(run.rounds)
    assert summary["dropout_rate"] is None or 0.0 <= summary["dropout_rate"] <= 1.0
    assert (summary["availability_swing"] is None) == (not run.timeline)
    assert summary["availability_swing"] is None or summary["availability_swing"] >= 1.0
    if summary["shapes"]:
        assert sum(summary["shape_shares"].values()) == pytest.approx(1.0)


# --- a real simulated run ---------------------------------------------------------------------


def _same_rows(a: list, b: list) -> bool:
    """Row lists equal value for value, NaN equal to NaN (dataclass == says NaN != NaN)."""
    return [tuple(map(repr, vars(r).values())) for r in a] == [tuple(map(repr, vars(r).values())) for r in b]


@pytest.fixture(scope="session")
def simulated(tmp_path_factory) -> tuple[FleetRun, Path]:
    """A small simulated fleet and the folder its run wrote; the network is lost so often that
    some uploads run out of retries (ServerUnreachable), so its sessions end in errors too."""
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 120, "hours": 2.0, "seed": 5},
            "task": {"goal_count": 10},
            "faults": {"network_lost_per_h": 20.0},
        }
    )
    out = tmp_path_factory.mktemp("simulated")
    return simulate(config, out_dir=out, progress=False), out


def test_a_small_simulated_fleet_writes_a_report_of_its_own_numbers(simulated):
    run, out = simulated
    assert run.sessions and run.rounds and run.timeline
    assert _same_rows(SessionRow.from_csv(out / "sessions.csv"), run.sessions)
    assert _same_rows(RoundRow.from_csv(out / "rounds.csv"), run.rounds)
    assert _same_rows(TimelineRow.from_csv(out / "timeline.csv"), run.timeline)
    summary = json.loads((out / "summary.json").read_text())
    accepted = [s for s in run.sessions if s.session_id and s.outcome != "unfinished"]  # ended: the cut ones apart
    assert summary["digest"] == run.digest and summary["devices"] == 120 and summary["simulated_s"] == 7200.0
    assert summary["shapes"] == dict(Counter(s.shape for s in accepted))
    assert summary["dropout_rate"] == pytest.approx(sum(s.shape[-1] not in "^#" for s in accepted) / len(accepted))
    assert summary["sessions_unfinished"] == sum(s.session_id != "" and s.outcome == "unfinished" for s in run.sessions)
    assert summary["rounds_committed"] == sum(r.committed for r in run.rounds)
    assert sum(summary["errors"].values()) == sum(s.outcome == "error" for s in run.sessions)
    page = _parse_report(out / "report.html")
    assert page.summary["digest"] == run.digest and len(page.tables["rounds"]) == len(run.rounds) + 1
    for name, data in page.images.items():
        assert (out / name).read_bytes() == data and _decode_png(data)[..., :3].std() > 0.02


def test_sessions_that_end_in_errors_are_counted_by_kind(simulated):
    run, out = simulated
    errors = [s for s in run.sessions if s.outcome == "error"]
    assert errors and run.errors == {"ServerUnreachable": len(errors)}
    assert json.loads((out / "summary.json").read_text())["errors"] == run.errors
    assert _parse_report(out / "report.html").summary["errors"] == run.errors


def test_fedfleet_report_draws_the_same_page_again_from_what_the_run_left(simulated, tmp_path, capsys):
    """A run stopped while its plots were drawn, or one an older release drew, had no way to get its
    report: ``fedfleet report RUN_DIR`` draws it from the tables, summary.json and config.toml, the
    very page the run drew (``--out``: the page alone, its plots inline)."""
    from emulator.cli.commands import main

    _, out = simulated
    page = tmp_path / "again.html"
    assert main(["report", str(out), "--out", str(page)]) == 0
    assert capsys.readouterr().out.strip() == str(page)
    assert page.read_bytes() == (out / "report.html").read_bytes()
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("shapes", ["-v[]+^"], "its shapes is list"),  # a value of another kind than a run writes
        ("dropout_rate", "0.3", "its dropout_rate is str"),
        ("simulated_s", "two hours", "could not convert"),  # read by the summary's own figures
        ("shape_shares", {"-v[!": 1.0}, "cannot be drawn"),  # the right kind, not the run's shapes
    ],
)
def test_fedfleet_report_of_a_summary_with_values_of_the_wrong_kind_is_one_line(
    simulated, tmp_path, capsys, key, value, says
):
    """A summary.json edited by hand (or another program's) reached the drawing: a value of another
    kind than the run wrote was a TypeError, AttributeError or KeyError traceback; it is one line."""
    from emulator.cli.commands import main

    _, out = simulated
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("rounds.csv", "sessions.csv", "timeline.csv", "config.toml"):
        (folder / name).write_bytes((out / name).read_bytes())
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    (folder / "summary.json").write_text(json.dumps({**summary, key: value}), encoding="utf-8")
    assert main(["report", str(folder), "--out", str(tmp_path / "page.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedfleet report: {folder / 'summary.json'} is not the run's summary: ")
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "page.html").exists()


def test_without_matplotlib_the_report_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure now fails
    with pytest.raises(FleetReportError, match=r"pip install 'fedfleet\[sim\]'"):
        write_report(FleetRun([], [], [], digest=""), tmp_path)
    assert summarize(FleetRun([], [], [], digest=""))["sessions"] == 0  # the summary needs no plots


# --- what the figures draw (read from the drawn axes, not from pixels) ---------------------------

from emulator.fleet.report import (  # noqa: E402
    RATE_KEYS,
    _headline,
    _hours,
    _png_rgb,
    accuracy_series,
    build_report,
    explain_rates,
    hour_arc,
    plot_accuracy,
    plot_client_accuracy,
    plot_devices,
    plot_dropout,
    render_html,
    round_outcomes,
)
from emulator.fleet.tables import with_round_bytes  # noqa: E402


@pytest.fixture(scope="session")
def fleet_report(goal8_fleet, tmp_path_factory):
    """(run, summary, figures, out dir) of a small real fleet's report."""
    run = goal8_fleet
    assert any(r.committed for r in run.rounds) and any(not r.committed for r in run.rounds)
    out = tmp_path_factory.mktemp("fleet-report")
    summary, figures, page = build_report(run)  # what write_report writes, drawn once for the figures' axes
    run.write_tables(out)
    (out / "report.html").write_text(page, encoding="utf-8")
    return run, summary, figures, out


def _visible_ticks(axis, lo: float, hi: float) -> list[float]:
    return [t for t in axis.get_majorticklocs() if min(lo, hi) - 1e-9 <= t <= max(lo, hi) + 1e-9]


def _all_axes(figures):
    for fig in figures:
        for ax in fig.drawn.axes:
            yield fig, ax


def test_every_round_and_device_count_axis_has_whole_number_ticks(fleet_report):
    _run, _summary, figures, _out = fleet_report
    checked = 0
    for fig, ax in _all_axes(figures):
        for axis, label, lim in (
            (ax.xaxis, ax.get_xlabel(), ax.get_xlim()),
            (ax.yaxis, ax.get_ylabel(), ax.get_ylim()),
        ):
            if label in ("round", "committed round", "rounds", "devices", "sessions"):
                ticks = _visible_ticks(axis, *lim)
                assert ticks, (fig.name, label)
                assert all(float(t).is_integer() for t in ticks), (fig.name, label, ticks)
                checked += 1
    assert checked >= 7


def test_every_label_title_and_legend_is_inside_its_figure_and_no_legend_covers_a_plot(fleet_report):
    """The report lays its figures out itself (one measure, no constrained-layout solver): whatever
    surrounds a plot (ticks, labels, titles, legends beside it) fits in the image, and no legend
    lies on a plot area."""
    _run, _summary, figures, _out = fleet_report
    for fig in figures:
        drawn = fig.drawn
        renderer = drawn.canvas.get_renderer()
        frame = drawn.bbox
        areas = [ax.get_window_extent() for ax in drawn.axes]
        legends = [ax.get_legend() for ax in drawn.axes if ax.get_legend() is not None] + list(drawn.legends)
        boxes = [ax.get_tightbbox(renderer) for ax in drawn.axes] + [leg.get_window_extent(renderer) for leg in legends]
        for box in boxes:
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, (
                fig.name,
                box,
            )
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(area) for area in areas), fig.name
        assert legends or fig.name == "shapes.png"


def test_the_png_writer_keeps_every_pixel():
    rng = np.random.default_rng(0)
    for shape in ((1, 1), (2, 7), (40, 33)):
        rgba = rng.integers(0, 256, (*shape, 4), dtype=np.uint8)
        pixels = _decode_png(_png_rgb(rgba))  # read back by matplotlib's reader (Pillow)
        assert pixels.shape == (*shape, 3)
        assert (np.round(pixels * 255).astype(np.uint8) == rgba[..., :3]).all()


def test_time_axes_span_the_run_and_no_more(fleet_report):
    run, _summary, figures, _out = fleet_report
    span_h = run.span_s / 3600.0
    checked = 0
    for fig, ax in _all_axes(figures):
        if ax.get_xlabel().startswith("simulated time"):
            assert ax.get_xlim() == pytest.approx((0.0, span_h)), fig.name
            checked += 1
    assert checked >= 5  # devices, rounds (2), traffic, accuracy


def test_hour_of_day_axes_span_only_the_hours_with_data(fleet_report):
    run, _summary, figures, _out = fleet_report
    by_name = {f.name: f for f in figures}
    # the config starts at 00:00 UTC; the sample at the run's end counts in the hour it closes
    utc_hours = {int(min(t.t_s, run.span_s - 1e-3) // 3600) % 24 for t in run.timeline}
    local_hours = {int(s.local_hour) % 24 for s in run.sessions if s.accepted}
    for name, hours in (("devices.png", utc_hours), ("dropout.png", local_hours)):
        ax = by_name[name].drawn.axes[-1] if name == "devices.png" else by_name[name].drawn.axes[1]
        assert "hour of day" in ax.get_xlabel()
        arc = hour_arc(hours)
        assert len(arc) < 24 and set(hours) <= set(arc)
        assert ax.get_xlim() == pytest.approx((-0.5, len(arc) - 0.5)), name
        labels = [int(t.get_text()) for t in ax.get_xticklabels()]
        assert set(labels) <= set(arc), name  # no hour of day past the data
        assert f"{arc[0]}" in by_name[name].caption and f"{arc[-1]}" in by_name[name].caption


def test_an_hour_without_sessions_inside_the_axis_is_named_in_the_caption():
    def session(i: int, hour: float) -> SessionRow:
        return SessionRow(
            f"d{i}",
            f"s{i}",
            "t",
            "t/1",
            0.0,
            1.0,
            "-v[]+^" if i % 3 else "-v[!",
            "completed",
            10,
            10,
            1,
            0.0,
            0.0,
            "1.31.1",
            "mid",
            hour,
        )

    sessions = [session(i, h) for i, h in enumerate([22.5, 23.1, 2.4, 22.0, 23.9, 2.0])]
    fig = plot_dropout(FleetRun(sessions, [], [], digest=""))
    ax = fig.drawn.axes[1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["22", "23", "0", "1", "2"]
    assert ax.get_xlim() == pytest.approx((-0.5, 4.5))
    assert "No session started in local hour 0-1, so there is no bar there" in fig.caption


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 23), min_size=1))
def test_the_hour_axis_is_the_shortest_run_of_hours_round_the_clock_holding_them_all(hours):
    arc = hour_arc(hours)
    assert set(hours) <= set(arc) and arc[0] in hours and arc[-1] in hours
    assert all((b - a) % 24 == 1 for a, b in zip(arc, arc[1:])) and len(set(arc)) == len(arc)
    shortest = min(next(n for n in range(1, 25) if all((h - start) % 24 < n for h in hours)) for start in range(24))
    assert len(arc) == shortest


_round_rows = st.builds(
    lambda committed, selected, reported, accepted, dropped: RoundRow(
        "t/1/1", "t", 0.0, 1.0, committed, selected, reported, min(accepted, reported), dropped, 1.0, math.nan, math.nan
    ),
    st.booleans(),
    st.integers(0, 200),
    st.integers(0, 200),
    st.integers(0, 200),
    st.integers(0, 200),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_round_rows, max_size=20))
def test_an_abandoned_round_has_no_outcome_bars_only_its_mark(rounds):
    out = round_outcomes(rounds)
    for i, r in enumerate(rounds):
        bars = (out["aggregated"][i], out["rejected"][i], out["dropped"][i])
        if r.committed:
            assert bars == (r.accepted, r.reported - r.accepted, r.dropped) and out["abandoned_selected"][i] == 0
            assert out["abandoned_summed"][i] == 0
        else:
            assert bars == (0, 0, 0) and out["abandoned_selected"][i] == r.selected
            assert out["abandoned_summed"][i] == r.accepted  # what it summed and did not publish


def test_the_outcome_chart_marks_each_abandoned_round_and_stacks_nothing_there(fleet_report):
    run, _summary, figures, _out = fleet_report
    ax = next(f for f in figures if f.name == "dropout.png").drawn.axes[0]
    abandoned = [(i, r.selected) for i, r in enumerate(run.rounds, start=1) if not r.committed]
    (marks,) = [c for c in ax.collections if "abandoned round" in c.get_label()]
    assert [tuple(p) for p in marks.get_offsets()] == [(float(i), float(n)) for i, n in abandoned]
    aggregated = next(c for c in ax.collections if c.get_label() == "reported, aggregated").get_paths()[0]
    for i, _n in abandoned:  # the polygon has no height over round i
        assert not aggregated.contains_point((i, 0.5))


def test_an_abandoned_secure_round_is_drawn_with_the_reports_its_completed_groups_summed():
    """Seed 1's 300 secure devices for 2 hours in groups of 8 (goal 20): round 2's first attempt
    was abandoned with 7 of its 26 devices summed by the one of its three groups that completed
    (rounds.csv accepted 7, the round's secagg summed_devices 7); the chart drew it as nothing
    aggregated, an x over zero. It is an x over a grey step of 7, and its caption says so."""
    from emulator.fleet.report import plot_dropout

    nan = math.nan
    rounds = [
        RoundRow("t/1/1", "t", 0.0, 305.0, True, 26, 22, 22, 4, 305.0, 0.4, 2.0, outcome="committed"),
        RoundRow("t/2/1", "t", 305.0, 567.0, False, 26, 7, 7, 12, 262.0, nan, nan, outcome="abandoned"),
        RoundRow("t/2/2", "t", 567.0, 1047.0, False, 20, 0, 0, 10, 480.0, nan, nan, outcome="abandoned"),
    ]
    figure = plot_dropout(FleetRun(sessions=[], rounds=rounds, timeline=[], digest=""))
    ax = figure.drawn.axes[0]
    (grey,) = [c for c in ax.collections if c.get_label() == "reported, summed, round abandoned"]
    (marks,) = [c for c in ax.collections if "abandoned round" in c.get_label()]
    assert [tuple(p) for p in marks.get_offsets()] == [(2.0, 26.0), (3.0, 20.0)]
    path = grey.get_paths()[0]
    assert path.contains_point((2, 0.5)) and path.contains_point((2, 6.5)) and not path.contains_point((2, 7.5))
    assert not any(path.contains_point((i, y)) for i in (1, 3) for y in (0.5, 25.5, 26.5))
    assert "published nothing" in figure.caption and "groups that completed" in figure.caption


def test_every_rate_in_the_summary_table_has_its_explanation(fleet_report):
    run, summary, _figures, out = fleet_report
    text = (out / "report.html").read_text()
    why = dict(__import__("re").findall(r'<td class="why" data-explains="([a-z_]+)">([^<]+)</td>', text))
    rates = [k for k in summary if k.endswith(("_rate", "_swing", "_per_wall_s"))]
    assert set(rates) <= set(RATE_KEYS) <= set(why)
    assert all(len(why[k].split()) >= 8 for k in RATE_KEYS)
    committed = sum(r.committed for r in run.rounds)
    completion = why["round_completion_rate"]
    assert (
        summary["round_completion_rate"] < 0.9
    )  # low: the sentence says why, with the run's figures, and what to change
    assert f"{committed} of {len(run.rounds)} rounds committed" in completion
    assert "--devices" in completion and "selection window" in completion
    assert f"{100 * summary['dropout_rate']:.1f}%" in why["dropout_rate"]


def test_a_run_without_config_or_rounds_still_explains_every_rate():
    for run in (synthetic_run(seed=3), FleetRun([], [], [], digest="")):
        why = explain_rates(summarize(run), run.rounds)
        assert set(RATE_KEYS) <= set(why) and all(why[k] for k in RATE_KEYS)


def test_every_table_scrolls_sideways_and_shows_all_its_rows(fleet_report):
    run, _summary, _figures, out = fleet_report
    text = (out / "report.html").read_text()
    import re

    css = re.search(r"<style>(.*?)</style>", text, re.S).group(1)
    assert "max-height" not in css and re.search(r"\.table-wrap\{[^}]*overflow-x:auto", css)
    assert text.count("<table") == text.count('<div class="table-wrap"><table') == 3
    page = _parse_report(out / "report.html")
    assert len(page.tables["rounds"]) == len(run.rounds) + 1


def test_rounds_hold_their_sessions_bytes(fleet_report):
    run, _summary, _figures, out = fleet_report
    rows = RoundRow.from_csv(out / "rounds.csv")
    expected = with_round_bytes(run.rounds, run.sessions)
    assert [(r.bytes_down, r.bytes_up) for r in rows] == [(r.bytes_down, r.bytes_up) for r in expected]
    selected = [s for s in run.sessions if s.round_id]
    assert sum(r.bytes_down for r in rows) == sum(s.bytes_down for s in selected) > 0
    assert sum(r.bytes_up for r in rows) == sum(s.bytes_up for s in selected) > 0


def test_accuracy_and_loss_are_drawn_against_hours_and_rounds(fleet_report):
    run, _summary, figures, _out = fleet_report
    series = accuracy_series(run.rounds)
    committed = [r for r in run.rounds if r.committed]
    assert [a for _, a in series["accuracy_by_round"]] == [r.accuracy for r in committed]
    fig = next(f for f in figures if f.name == "accuracy.png").drawn
    lines = [
        (ax.get_title(), line.get_label(), line.get_xydata().tolist()) for ax in fig.axes for line in ax.get_lines()
    ]
    assert ("Model quality over simulated time", "accuracy", [list(p) for p in series["accuracy_by_hour"]]) in lines
    assert ("Model quality over committed rounds", "accuracy", [list(p) for p in series["accuracy_by_round"]]) in lines
    loss_lines = [xy for _title, label, xy in lines if label == "loss"]
    assert [list(p) for p in series["loss_by_round"]] in loss_lines and [
        list(p) for p in series["loss_by_hour"]
    ] in loss_lines
    bytes_ax = next(f for f in figures if f.name == "bytes.png").drawn.axes[0]
    down = next(line for line in bytes_ax.get_lines() if line.get_label().startswith("down"))
    assert down.get_ydata().tolist() == [r.bytes_down / 1e6 for r in run.rounds]


def test_per_client_accuracy_and_time_to_target_are_shown_when_the_summary_has_them(fleet_report, tmp_path):
    run, summary, figures, out = fleet_report
    assert summary["client_accuracy_percentiles"] and "client_accuracy.png" in {
        f.name for f in figures
    }  # measured by the run
    unmeasured = {k: v for k, v in summary.items() if k != "client_accuracy_percentiles"}
    assert (
        plot_client_accuracy(unmeasured) is None
        and plot_client_accuracy({**summary, "client_accuracy_percentiles": None}) is None
    )
    measured = {
        **summary,
        "target_accuracy": 0.5,
        "time_to_target_accuracy_s": 4321.0,
        "client_accuracy_percentiles": {"p10": 0.25, "p50": 0.5, "p90": 0.875, "accuracy": 0.55, "clients": 40},
    }
    fig = plot_client_accuracy(measured)
    (marks,) = [c for c in fig.drawn.axes[0].collections if c.get_label() == "percentiles over clients"]
    assert marks.get_offsets()[:, 0].tolist() == [0.25, 0.5, 0.875]
    page = render_html(measured, [*figures, fig], run)
    (tmp_path / "report.html").write_text(page)
    parsed = _parse_report(tmp_path / "report.html")
    assert parsed.summary["time_to_target_accuracy_s"] == 4321.0
    assert parsed.summary["client_accuracy_percentiles"]["p90"] == 0.875 and "client_accuracy.png" in parsed.images
    assert 'data-explains="time_to_target_accuracy_s"' in page and 'data-explains="client_accuracy_percentiles"' in page
    assert "Target accuracy reached after 1.20 simulated hours" in page
    never = render_html({**summary, "target_accuracy": 0.99, "time_to_target_accuracy_s": None}, figures, run)
    assert "Target accuracy not reached" in never


def test_a_run_without_a_target_accuracy_says_none_was_set_and_one_with_a_target_draws_it(fleet_report, tmp_path):
    """The summary carries the target: a null time to it is "none was set" when there was none (the
    page said "Target accuracy not reached" of a run that never asked), and the accuracy figure
    draws the target's line (it read a key the summary never had)."""
    run, summary, figures, _out = fleet_report
    assert summary["target_accuracy"] is None and summary["time_to_target_accuracy_s"] is None
    page = render_html(summary, figures, run)
    (tmp_path / "report.html").write_text(page)
    assert _parse_report(tmp_path / "report.html").summary["target_accuracy"] is None
    assert "Target accuracy not reached" not in page and "No committed model reached" not in page
    assert "No target accuracy was set" in explain_rates(summary, run.rounds)["time_to_target_accuracy_s"]
    assert "target" not in plot_accuracy(run, summary).caption
    aimed = {**summary, "target_accuracy": 0.99}
    assert "Target accuracy not reached" in render_html(aimed, figures, run)
    drawn = plot_accuracy(run, aimed)
    assert "No committed model reached the target accuracy" in drawn.caption
    assert "target 0.99" in [h.get_label() for h in drawn.drawn.legends[0].legend_handles]


@given(
    note=st.text(alphabet="<>&!-/scriptSCRIPT \"'", max_size=40)
    | st.sampled_from(["<!--<script>", "</script><script>alert(1)</script>", "<!-- <script> -->"])
)
def test_a_summary_embedded_as_json_cannot_leave_or_bend_its_script_element(note):
    """The report's and the comparison's summaries travel in a <script type="application/json">:
    a run folder's value '<!--<script>' (a note, a task file name) turned the page's own
    '</script>' into text when only '</' was escaped. No '<', '>' or '&' is left, and the JSON reads back."""
    summary = {"round_completion_note": note, note: [note]}
    payload = script_json(summary, indent=1)
    assert not set(payload) & set("<>&") and json.loads(payload) == summary


class _Shown(HTMLParser):
    """What a reader of the page sees: each summary cell's text by key, each explanation by key, the
    rounds table's cells as text; and the page's structure (open elements, ids) to check it is well formed."""

    VOID = {"meta", "img", "br", "link", "hr", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, str] = {}
        self.why: dict[str, str] = {}
        self.rounds: list[list[str]] = []
        self.ids: list[str] = []
        self.stack: list[str] = []
        self.misnested: list[tuple[str, list[str]]] = []
        self._into: tuple[dict, str] | None = None
        self._table: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "table":
            self._table = a.get("id")
        elif tag == "tr" and self._table == "rounds":
            self.rounds.append([])
        elif tag == "td" and "data-key" in a:
            self._into = (self.cells, a["data-key"])
            self.cells[a["data-key"]] = ""
        elif tag == "td" and "data-explains" in a:
            self._into = (self.why, a["data-explains"])
            self.why[a["data-explains"]] = ""
        elif tag == "td" and self._table == "rounds":
            self.rounds[-1].append("")
            self._into = None

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.misnested.append((tag, list(self.stack)))
        else:
            self.stack.pop()
        if tag == "td":
            self._into = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._into is not None:
            target, key = self._into
            target[key] += data
        elif self._table == "rounds" and self.rounds and self.rounds[-1] and self.stack[-1] == "td":
            self.rounds[-1][-1] += data


def _shown_number(text: str) -> float:
    return float(text.replace(",", "").removesuffix("%"))


def test_every_figure_the_page_shows_is_the_one_its_tables_give(fleet_report):
    """The page as read (its text, not its data-value attributes), against figures computed here from
    sessions.csv, rounds.csv and timeline.csv: the summary cells, the numbers each rate's sentence
    quotes (the swing's sentence quoted other roundings of the peak, trough and swing than their
    cells: 180 beside 179.8), the rounds table; no NaN or infinity in the text; a well formed page."""
    run, summary, _figures, out = fleet_report
    page = _Shown()
    page.feed((out / "report.html").read_text(encoding="utf-8"))
    sessions = SessionRow.from_csv(out / "sessions.csv")
    rounds = RoundRow.from_csv(out / "rounds.csv")
    timeline = TimelineRow.from_csv(out / "timeline.csv")
    accepted = [s for s in sessions if s.session_id]
    ended = [s for s in accepted if s.outcome != "unfinished"]
    dropped = sum(s.shape[-1] not in "^#" for s in ended)
    committed = sum(r.committed for r in rounds)
    # the sample at the run's end in the hour it closes (a lone sample in the next was a peak of its own)
    hours = np.floor(np.minimum([r.t_s for r in timeline], run.span_s - 1e-3) / 3600.0).astype(int) % 24
    available = np.array([r.available for r in timeline], dtype=float)
    hourly = [available[hours == h].mean() for h in np.unique(hours)]

    counts = {
        "sessions": len(sessions),
        "sessions_accepted": len(accepted),
        "sessions_completed": sum(s.shape.endswith("^") for s in accepted),
        "checkins_rejected": len(sessions) - len(accepted),
        "rounds": len(rounds),
        "rounds_committed": committed,
        "rounds_abandoned": len(rounds) - committed,
        "bytes_down": sum(s.bytes_down for s in sessions),
        "bytes_up": sum(s.bytes_up for s in sessions),
    }
    for key, value in counts.items():
        assert page.cells[key] == f"{value:,}", key
    assert page.cells["dropout_rate"] == f"{100 * dropped / len(ended):.2f}%"
    assert page.cells["round_completion_rate"] == f"{100 * committed / len(rounds):.2f}%"
    for key, value in (("available_peak", max(hourly)), ("available_trough", min(hourly))):
        assert _shown_number(page.cells[key]) == pytest.approx(value, rel=5e-4, abs=0.05), key
    assert _shown_number(page.cells["availability_swing"]) == pytest.approx(
        max(hourly) / max(min(hourly), 1.0), rel=5e-4
    )

    assert page.why["dropout_rate"].startswith(
        f"{100 * dropped / len(ended):.1f}% of the {len(ended):,} accepted sessions that ended"
    )
    swing = page.why["availability_swing"]
    assert f"from {page.cells['available_trough']} in the quietest hour" in swing
    assert f"to {page.cells['available_peak']} in the busiest" in swing
    assert f"a {page.cells['availability_swing']}x swing" in swing
    assert page.why["round_completion_rate"].startswith(
        f"{committed} of {len(rounds)} rounds committed ({100 * committed / len(rounds):.1f}%)"
    )
    assert f"{run.span_s / 3600.0:g} simulated hours took" in page.why["sim_s_per_wall_s"]

    header, *rows = page.rounds
    assert len(rows) == len(rounds)
    for shown, r in zip(rows, rounds):
        assert shown[0] == r.round_id and shown[5] == ("yes" if r.committed else "no")
        assert [int(_shown_number(v)) for v in shown[6:10]] == [r.selected, r.reported, r.accepted, r.dropped]
        assert [int(_shown_number(v)) for v in shown[12:14]] == [r.bytes_down, r.bytes_up]
        for text, value in ((shown[2], r.start_s), (shown[3], r.end_s), (shown[4], r.duration_s)):
            assert _shown_number(text) == pytest.approx(value, rel=5e-4, abs=0.5)
        if math.isfinite(r.accuracy):
            assert _shown_number(shown[10]) == pytest.approx(r.accuracy, rel=5e-4)
        else:
            assert shown[10] == shown[11] == "n/a"

    text = " ".join([*page.cells.values(), *page.why.values(), *(c for row in rows for c in row)])
    assert not {"nan", "NaN", "inf", "Infinity", "None"} & set(text.replace(",", " ").split())
    assert page.stack == [] and page.misnested == [] and len(page.ids) == len(set(page.ids))


def test_a_fleet_whose_tasks_complete_early_says_when_and_that_the_rest_of_the_run_idled(tmp_path):
    """A task of two rounds in a run of an hour: the summary says when every task had completed and
    the rounds' sentence that the rest of the run only turned check-ins away (200 hours of a
    20-round task read as 20 of 23 rounds committed, nothing about why no round ran after hour 7)."""
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 60, "hours": 1.0, "start_utc_hour": 6.0, "seed": 1},
            "task": {
                "goal_count": 7,
                "max_rounds": 2,
                "compute_s_per_example": 0.2,
                "report_timeout_s": 600.0,
                "retry_min_s": 60.0,
                "retry_max_s": 300.0,
            },
        }
    )
    run = simulate(config, progress=False)
    summary = summarize(run)
    assert sum(r.committed for r in run.rounds) == 2
    last_end = max(r.end_s for r in run.rounds)
    assert summary["tasks_completed_s"] == last_end < 3600.0 - 60.0
    after = [s for s in run.sessions if s.start_s > last_end]
    assert after and not any(s.session_id for s in after)  # check-ins went on, and were all turned away
    why = explain_rates(summary, run.rounds)["round_completion_rate"]
    assert (
        f"Every task had completed (its max_rounds, or its privacy budget) {round(last_end / 3600.0, 2):g} hours" in why
    )
    assert "only turned check-ins away" in why
    running = summarize(FleetRun(run.sessions, run.rounds, run.timeline, run.digest, config, extra={}))
    assert running["tasks_completed_s"] is None
    assert "Every task had completed" not in explain_rates(running, run.rounds)["round_completion_rate"]


def test_a_stretch_without_an_open_round_is_explained_by_the_devices_waiting_out_their_interval():
    """Rounds ran for 40 minutes, then none opened for the last 20 while 154 of the 162 available
    devices had taken part and were waiting out their hour: the summary and the report's rate say
    when, how many devices were available and waiting, and that fewer than a round's 13 seats were
    free to check in; a run whose rounds follow each other says nothing of it."""
    from emulator.fleet.report import explain_rates

    config = FleetConfig.default().replace(devices=300, hours=1.0, goal=10)  # 13 seats, 5-minute windows
    rounds = [
        RoundRow(f"t/{i}/1", "t", 600.0 * i, 600.0 * (i + 1), True, 13, 10, 10, 3, 600.0, 0.5, 1.0, outcome="committed")
        for i in range(4)
    ]
    timeline = [TimelineRow(300.0 * k, 162, 5, 0, 0, 154 if k >= 8 else 20) for k in range(13)]
    extra = {"device_min_interval_s": 3600.0}
    run = FleetRun(
        sessions=[], rounds=rounds, timeline=timeline, digest="", config=config, simulated_s=3600.0, extra=extra
    )
    summary = summarize(run)
    assert summary["round_gaps"] == [
        {"from_s": 2400.0, "to_s": 3600.0, "samples": 5, "available": 162.0, "resting": 154.0, "gathered": 0}
    ]
    note = summary["round_gap_note"]
    assert note.startswith("no round was open from 0.67 h to 1.00 h (the end of the run), 1,200 s")
    for said in (
        "about 162 devices were available",
        "about 154 of them had taken part",
        "3,600 s after a session",
        "min_interval_s",
        "at most about 8 could check in, fewer than the 16.25 the server expects before it opens a selection "
        "(1.25 times the 13 devices a round selects",
    ):
        assert said in note, said
    assert note[1:] in explain_rates(summary, rounds)["round_completion_rate"]
    back_to_back = summarize(
        dataclasses.replace(
            run, rounds=[*rounds, dataclasses.replace(rounds[0], round_id="t/5/1", start_s=2400.0, end_s=3600.0)]
        )
    )
    assert back_to_back["round_gaps"] == [] and back_to_back["round_gap_note"] is None


@settings(max_examples=60, deadline=None)
@given(
    starts=st.lists(st.integers(0, 40), max_size=8),
    times=st.lists(st.integers(0, 48), max_size=30),
)
def test_each_stretch_without_a_round_holds_the_timeline_samples_within_it(starts, times):
    """The samples of each stretch are found by bisection (a scan of the whole timeline for each
    stretch grew as the square of a run's length): the same ones, ends included, in any order."""
    from emulator.fleet.summary import round_gaps

    task = FleetConfig.default().task  # 300 s windows: stretches of 600 s or more
    rounds = [
        RoundRow(f"t/{i}/1", "t", 300.0 * a, 300.0 * a + 200.0, True, 1, 1, 1, 0, 200.0, 0.5, 1.0, outcome="committed")
        for i, a in enumerate(starts)
    ]
    timeline = [TimelineRow(150.0 * k, k, 0, 0, 0, k % 3) for k in times]
    for gap in round_gaps(rounds, timeline, 7200.0, task):
        inside = [r for r in timeline if gap["from_s"] <= r.t_s <= gap["to_s"]]
        assert gap["samples"] == len(inside)
        if inside:
            assert gap["available"] == pytest.approx(sum(r.available for r in inside) / len(inside))
            assert gap["resting"] == pytest.approx(sum(r.resting for r in inside) / len(inside))


def test_a_stretch_without_a_round_is_measured_against_what_the_server_waits_for_and_never_rounded_past_it():
    """The server opens a selection once it expects 1.25 times a round's seats: 14 devices free to
    check in for 13 seats leave no round open, and the note says so (it told of 14 free "of the 13"
    and no reason); 12.6 free for 13 seats was "about 13, fewer than the 13 devices a round selects",
    and 9.6 for 8 seats (10 awaited) is at most 9, never "about 10, fewer than the 10"."""

    def note(resting: float, goal: int = 10) -> str:
        config = FleetConfig.default().replace(devices=300, hours=1.0, goal=goal)  # 10: 13 seats, 16.25 awaited
        timeline = [TimelineRow(300.0 * k, 162, 5, 0, 0, resting if k >= 8 else 20) for k in range(13)]
        run = FleetRun([], rounds, timeline, "", config, simulated_s=3600.0, extra={"device_min_interval_s": 3600.0})
        return summarize(run)["round_gap_note"]

    rounds = [
        RoundRow(f"t/{i}/1", "t", 600.0 * i, 600.0 * (i + 1), True, 13, 10, 10, 3, 600.0, 0.5, 1.0, outcome="committed")
        for i in range(4)
    ]
    assert "so at most about 14 could check in, fewer than the 16.25 the server expects before it opens" in note(148)
    assert "so at most about 13 could check in, fewer than the 16.25" in note(149.4)
    assert "so at most about 9 could check in, fewer than the 10 the server expects" in note(152.4, goal=6)
    assert (
        "which left about 20 free to check in, no fewer than the 16.25 a selection waits for, so the devices"
        " waiting out their interval do not explain the stretch" in note(142)
    )  # it said "about 20 free to check in, of the 16.25", as if 20 were a part of 16.25


def test_a_secure_runs_drop_out_rate_says_a_summed_masked_input_is_not_a_drop_out():
    """The sentence under the drop-out rate of a secure run says which interrupted devices it does
    not count: those whose masked input their group summed (``summed`` in sessions.csv)."""
    from emulator.fleet.report import explain_rates

    base = {"dropout_rate": 0.05, "sessions_accepted": 100, "sessions_unfinished": 0, "secure_groups": None}
    secure = {**base, "secure_groups": {"rounds": 1, "groups": 1, "completed": 1}}
    assert "summed in sessions.csv" in explain_rates(secure, [])["dropout_rate"]
    assert "summed" not in explain_rates(base, [])["dropout_rate"]


def test_the_sample_at_a_runs_end_closes_its_last_hour_rather_than_opening_another():
    """A run of one hour from 0:00 samples its timeline at 0, 300, ..., 3,600 s; the sample at its
    end was taken for hour 1: the devices figure said the run covered 0:00 to 1:59, "2 of 24", and
    the swing set hour 0's mean against that lone sample (a 1.021x swing of one hour's fleet)."""
    config = FleetConfig.default().replace(devices=300, hours=1.0)
    timeline = [TimelineRow(300.0 * k, 180 if k < 12 else 176, 0, 0, 0) for k in range(13)]
    run = FleetRun([], [], timeline, "", config, simulated_s=3600.0)
    summary = summarize(run)
    assert (summary["available_trough"], summary["available_peak"]) == (
        pytest.approx(179.6923),
        pytest.approx(179.6923),
    )
    assert summary["availability_swing"] == 1.0
    caption = plot_devices(run).caption
    assert "0:00 to 0:59 (1 of 24: the run is 1 simulated hour long)" in caption and "1:59" not in caption
    longer = FleetRun([], [], [TimelineRow(300.0 * k, 180, 0, 0, 0) for k in range(19)], "", config, simulated_s=5400.0)
    assert "0:00 to 1:59 (2 of 24" in plot_devices(longer).caption  # an hour and a half reaches into hour 1


def test_per_client_percentiles_are_read_as_at_or_below_so_a_p90_of_one_is_not_nine_in_ten_below_it():
    """A p90 of 1.000 is reached when many clients score every test example: the sentence said
    "nine in ten below 1.000", and the figure's caption that nine in ten clients "beat" the p10."""
    from emulator.fleet.report import explain_rates

    summary = {"client_accuracy_percentiles": {"p10": 0.25, "p50": 1.0, "p90": 1.0, "accuracy": 0.8, "clients": 40}}
    said = explain_rates(summary, [])["client_accuracy_percentiles"]
    assert "one client in ten is at or below 0.250, half are at or below 1.000, nine in ten at or below 1.000" in said
    assert " below 1.000" not in said.replace("at or below 1.000", "")
    caption = plot_client_accuracy(summary).caption
    assert "the accuracy nine in ten clients reach" in caption and "beat" not in caption


def test_sessions_ended_in_an_error_are_said_to_be_the_fleets_faults_not_the_server_down():
    """The summary row "sessions ended in an error, by kind ServerUnreachable: 2" had no sentence, and
    a run against an in-process server seemed to have lost it."""
    from emulator.fleet.report import explain_rates

    said = explain_rates({"errors": {"ServerUnreachable": 2, "CorruptResource": 1}}, [])["errors"]
    assert said.startswith("3 sessions ended in an error, by its kind (outcome error in sessions.csv)")
    assert "network failed mid-request, one of the fleet's simulated faults, not the server down" in said
    assert explain_rates({"errors": {"CorruptResource": 1}}, [])["errors"].endswith("sessions.csv).")
    assert "errors" not in explain_rates({"errors": {}}, [])


def test_a_span_of_seconds_is_said_in_seconds_never_as_zero_hours():
    """A run of --hours 0.0001 was "the run is 0 simulated hours long", and a target reached 10 s
    in "reached after 0.00 simulated hours"."""
    assert _hours(0.36, "simulated ") == "0.36 simulated seconds" and _hours(1.0) == "1 second"
    assert _hours(17.9) == "17.9 seconds" and _hours(18.0) == "0.01 hours" and _hours(3600.0) == "1 hour"
    assert _hours(0.0) == "0 hours"
    said = _headline({"time_to_target_accuracy_s": 10.0, "target_accuracy": 0.5})
    assert "Target accuracy reached after 10 simulated seconds." in said
    said = _headline({"time_to_target_accuracy_s": 4320.0, "target_accuracy": 0.5})
    assert "Target accuracy reached after 1.20 simulated hours." in said


def test_a_long_run_draws_its_per_round_figures_as_steps_of_consecutive_rounds_means():
    """A month of a small fleet is thousands of rounds: a step per round was narrower than a pixel,
    the down and up lines of 4,850 rounds filled the traffic axes as one band, and the outcomes
    one solid green. Past ``MAX_ROUND_STEPS`` each step is the mean of a group of consecutive
    rounds (the groups add up to the run's bytes and devices), the legends and captions say how
    many, and every abandoned round keeps its own mark."""
    from emulator.fleet.report import MAX_ROUND_STEPS, plot_bytes, plot_dropout, round_outcomes

    nan = math.nan
    rounds = [
        RoundRow(
            f"t/{i}/1", "t", 60.0 * i, 60.0 * i + 50.0, i % 50 != 0, 8, 7 - i % 3, 6 - i % 3, 1 + i % 2, 50.0, nan, nan,
            bytes_down=1000 * (i % 7) + 50_000, bytes_up=500 * (i % 5) + 20_000,
            outcome="committed" if i % 50 else "abandoned",
        )
        for i in range(1, 1201)
    ]  # fmt: skip
    run = FleetRun(sessions=[], rounds=rounds, timeline=[], digest="")
    figure = plot_bytes(run)
    ax = figure.drawn.axes[0]
    down, up = (next(line for line in ax.get_lines() if line.get_label().startswith(side)) for side in ("down", "up"))
    assert len(down.get_xdata()) == len(up.get_xdata()) == MAX_ROUND_STEPS
    assert down.get_label().endswith("mean of 4 rounds") and "mean of 4 consecutive rounds" in figure.caption
    assert down.get_xdata()[:2].tolist() == [2.5, 6.5]
    assert sum(down.get_ydata()) * 4 * 1e6 == pytest.approx(sum(r.bytes_down for r in rounds))
    assert sum(up.get_ydata()) * 4 * 1e6 == pytest.approx(sum(r.bytes_up for r in rounds))
    (marks,) = [c for c in ax.collections if c.get_label() == "abandoned round"]
    assert [x for x, _ in marks.get_offsets()] == [float(i) for i in range(50, 1201, 50)]

    figure = plot_dropout(run)
    ax = figure.drawn.axes[0]
    outcomes = round_outcomes(rounds)
    for key, label in (("aggregated", "reported, aggregated"), ("dropped", "dropped out")):
        (fill,) = [c for c in ax.collections if c.get_label() == f"{label} (mean of 4 rounds)"]
        xy = fill.get_paths()[0].vertices
        area = 0.5 * abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(xy, [*xy[1:], xy[0]])))
        assert area == pytest.approx(sum(outcomes[key]))  # each group as wide as its rounds, at their mean
        assert len({x for x, _ in xy}) <= MAX_ROUND_STEPS + 1
    (marks,) = [c for c in ax.collections if "abandoned round" in c.get_label()]
    assert [x for x, _ in marks.get_offsets()] == [float(i) for i in range(50, 1201, 50)]
    assert "mean of 4 consecutive rounds" in figure.caption


def test_the_papers_four_times_swing_is_set_against_participating_devices_not_available_ones():
    """The paper's 4x over a day (sec. 9) is of participating devices; the report set it against the
    available devices' swing alone. A day whose available devices swing 4x while its rounds keep
    some 40 devices seated at every hour (the default day: 1,467 to 6,014 available, 35 to 90
    participating) now says both, and why a round's seats cap the second."""
    available = [400 if 6 <= h < 12 else 100 for h in range(24)]
    timeline = [
        TimelineRow(h * 3600.0 + k * 300.0, n, 0, 40 if h % 2 else 30, 0)
        for h, n in enumerate(available)
        for k in range(12)
    ]
    summary = summarize(FleetRun([], [], timeline, "", simulated_s=86400.0))
    assert (summary["available_peak"], summary["available_trough"]) == (400.0, 100.0)
    assert (summary["participating_peak"], summary["participating_trough"]) == (40.0, 30.0)
    swing = explain_rates(summary, [])["availability_swing"]
    assert "ranged from 100 in the quietest hour to 400 in the busiest (hourly means), a 4x swing." in swing
    assert "The paper's 4x over a day (sec. 9) counts participating devices" in swing
    assert "ranged from 30 in their quietest hour to 40 in their busiest" in swing
    assert "goal times its over-selection" in swing
    assert "the paper saw about 4x over a day." not in swing
    empty = summarize(FleetRun([], [], [], ""))
    assert empty["participating_peak"] is None and empty["participating_trough"] is None


def test_the_devices_figure_says_which_hours_of_the_devices_own_day_its_utc_hours_are():
    """The devices figure's hours are UTC, the paper's (Fig. 5) the devices' own: the caption turns
    the busiest and quietest hours into the clocks of the fleet's time zones, so that the US
    population's peak at 8:00 UTC reads as the night it is (0:00 to 3:00)."""
    from emulator.fleet.report import _local_hours

    config = FleetConfig.default().replace(devices=300)
    available = [100 + (500 if h == 8 else 0) - (50 if h == 17 else 0) for h in range(24)]
    timeline = [TimelineRow(h * 3600.0 + k * 300.0, n, 0, 0, 0) for h, n in enumerate(available) for k in range(12)]
    caption = plot_devices(FleetRun([], [], timeline, "", config, simulated_s=86400.0)).caption
    assert (
        "Hours are UTC; on the devices' own clocks (availability.time_zones) the busiest hour of available devices,"
        " 8:00 UTC, is 0:00 (UTC-8) to 3:00 (UTC-5), and the quietest, 17:00 UTC, 9:00 (UTC-8) to 12:00 (UTC-5)."
    ) in caption
    india = FleetConfig.from_dict(
        {"fleet": {"devices": 300}, "availability": {"time_zones": [{"utc_offset_h": 5.5, "share": 1.0}]}}
    )
    hourly = available_by_hour(timeline)
    sentence = _local_hours(FleetRun([], [], timeline, "", india, simulated_s=86400.0), hourly)
    assert sentence.endswith("8:00 UTC, is 13:30 (UTC+5:30), and the quietest, 17:00 UTC, 22:30 (UTC+5:30).")
    assert _local_hours(FleetRun([], [], timeline, "", simulated_s=86400.0), hourly) == ""  # no config: no zones


def test_a_stretch_without_a_round_names_the_check_ins_the_server_turned_away_to_gather_them():
    """A day of 3,000 devices over the world's time zones had no round open for 1,226 s while about
    202 devices were free to check in, more than a selection waits for: the note said only that the
    devices waiting out their interval did not explain it. The server had turned 392 check-ins away
    as ROUND_NOT_OPEN in it, gathering them for a later selection; the note now says so, counting
    only those within the stretch."""
    config = FleetConfig.default().replace(devices=300, hours=1.0, goal=10)
    rounds = [
        RoundRow(f"t/{i}/1", "t", 600.0 * i, 600.0 * (i + 1), True, 13, 10, 10, 3, 600.0, 0.5, 1.0, outcome="committed")
        for i in range(4)
    ]
    timeline = [TimelineRow(300.0 * k, 162, 5, 0, 0, 20) for k in range(13)]

    def turned_away(t: float, code: str) -> SessionRow:
        return SessionRow(
            "d1", "", "", "", t, t + 0.1, "-", "rejected", 200, 200, 0, 0.0, 0.1, "1.31.1", "mid", 3.0, code=code
        )

    sessions = [turned_away(t, "ROUND_NOT_OPEN") for t in (100.0, 2500.0, 2600.0, 3500.0)] + [
        turned_away(2700.0, "ROUND_FULL")
    ]
    run = FleetRun(sessions, rounds, timeline, "", config, simulated_s=3600.0, extra={"device_min_interval_s": 3600.0})
    summary = summarize(run)
    assert summary["round_gaps"][0]["gathered"] == 3  # not the one before the stretch, nor ROUND_FULL
    assert summary["round_gap_note"].endswith(
        "; the server turned 3 check-ins in it away as ROUND_NOT_OPEN: its pace steering gathered the devices"
        " for a later selection, as it gathers a population whose check-ins come too slowly to fill a selection"
        " window (task.selection_timeout_s) of themselves"
    )
