"""``fedfleet compare``: runs side by side, a column and a series per run; a folder that is not a run is one line."""

from __future__ import annotations

import importlib.util
import json
import shutil
from html.parser import HTMLParser

import pytest

from emulator.cli.commands import main
from emulator.fleet import FleetRun, simulate, summarize
from emulator.fleet.compare import FleetCompareError, compare_client_accuracy, compare_figures, load_runs, write_compare
from emulator.fleet.config import FleetConfig
from emulator.fleet.report import accuracy_series

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again; the
#: goal-8 fleet is the report tests' (``goal8_fleet``), in their group.
#: matplotlib is looked for, not imported, as each pytest worker collects the module (about 1 s of CPU).
pytestmark = [
    pytest.mark.xdist_group("fleet_reports"),
    pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed"),
]


def _run_folder(path, run: FleetRun) -> FleetRun:
    """What ``fedfleet simulate --out`` leaves that compare reads: the tables and summary.json (no plots, to stay quick)."""
    run.write_tables(path)
    (path / "summary.json").write_text(json.dumps(summarize(run), indent=2) + "\n")
    return run


@pytest.fixture(scope="session")
def two_runs(goal8_fleet, tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    goal10 = FleetConfig.from_dict({"fleet": {"devices": 400, "hours": 2.0, "seed": 5}, "task": {"goal_count": 10}})
    runs = {
        "goal8": _run_folder(base / "goal8", goal8_fleet),
        "goal10": _run_folder(base / "goal10", simulate(goal10, progress=False)),
    }
    assert all(any(r.committed for r in run.rounds) for run in runs.values())
    return base, runs


class _Page(HTMLParser):
    """The summary table's column heads and cells by key, and the figures' ids."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[str] = []
        self.cells: dict[str, list[object]] = {}
        self.figures: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "th" and "data-run" in a:
            self.columns.append(a["data-run"])
        elif tag == "td" and "data-key" in a:
            self.cells.setdefault(a["data-key"], []).append(json.loads(a["data-value"]))
        elif tag == "figure":
            self.figures.append(a["id"])


def _page(path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_the_page_has_one_column_per_run_holding_that_runs_summary(two_runs, tmp_path):
    base, runs = two_runs
    out = tmp_path / "compare.html"
    assert main(["compare", str(base / "goal8"), str(base / "goal10"), "--out", str(out)]) == 0
    page = _page(out)
    assert page.columns == ["goal8", "goal10"]
    summaries = [json.loads((base / name / "summary.json").read_text()) for name in page.columns]
    for key in ("digest", "devices", "rounds", "rounds_committed", "round_completion_rate", "accuracy", "bytes_down"):
        assert page.cells[key] == [s[key] for s in summaries], key
    assert all(len(values) == 2 for values in page.cells.values())
    assert {"compare_accuracy.png", "compare_loss.png", "compare_rounds.png", "compare_bytes.png"} <= set(page.figures)
    assert "<link" not in out.read_text() and "http" not in out.read_text()  # self-contained


def test_every_run_has_its_series_on_the_shared_axes(two_runs):
    base, runs = two_runs
    folders = load_runs([str(base / "goal8"), str(base / "goal10")], ["FedAvg", "other"])
    figures = {f.name: f.drawn for f in compare_figures(folders)}
    for folder, run in zip(folders, runs.values()):
        series = accuracy_series(run.rounds)
        lines = {
            (ax.get_title(), line.get_label()): line.get_xydata().tolist()
            for fig in figures.values()
            for ax in fig.axes
            for line in ax.get_lines()
        }
        assert lines[("Accuracy over simulated time", folder.label)] == [list(p) for p in series["accuracy_by_hour"]]
        assert lines[("Accuracy over committed rounds", folder.label)] == [list(p) for p in series["accuracy_by_round"]]
        assert lines[("Loss over committed rounds", folder.label)] == [list(p) for p in series["loss_by_round"]]
        committed = sum(r.committed for r in run.rounds)
        steps = lines[("Rounds committed over time", f"{folder.label} ({committed} of {len(run.rounds)})")]
        assert steps[-1][1] == committed
        down = lines[("Traffic per round", f"{folder.label} down")]
        assert [y for _, y in down] == [r.bytes_down / 1e6 for r in run.rounds]
    span_h = max(f.span_s for f in folders) / 3600.0
    for name in ("compare_accuracy.png", "compare_rounds.png"):
        assert figures[name].axes[0].get_xlim() == pytest.approx((0.0, span_h))  # one time axis for all runs


def test_client_accuracy_percentiles_are_drawn_for_the_runs_that_have_them(two_runs, tmp_path):
    base, _runs = two_runs
    measured = tmp_path / "measured"
    shutil.copytree(base / "goal8", measured)
    summary = json.loads((measured / "summary.json").read_text())
    percentiles = {"p10": 0.2, "p50": 0.6, "p90": 0.9, "clients": 30}
    summary.update(time_to_target_accuracy_s=3000.0, client_accuracy_percentiles=percentiles)
    (measured / "summary.json").write_text(json.dumps(summary))
    unmeasured = load_runs([str(base / "goal8"), str(base / "goal10")])
    for run in unmeasured:
        run.summary.pop("client_accuracy_percentiles", None)
    assert compare_client_accuracy(unmeasured) is None
    out = tmp_path / "c.html"
    write_compare([str(measured), str(base / "goal10")], out)
    page = _page(out)
    assert "compare_client_accuracy.png" in page.figures
    assert page.cells["time_to_target_accuracy_s"] == [3000.0, None]
    assert page.cells["client_accuracy_percentiles"][0]["p50"] == 0.6


def test_folders_of_the_same_name_are_told_apart_and_labels_must_match_the_runs(two_runs, tmp_path):
    base, _runs = two_runs
    for parent in ("a", "b"):
        shutil.copytree(base / "goal8", tmp_path / parent / "run")
    runs = load_runs([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")])
    assert [r.label for r in runs] == ["a/run", "b/run"]
    with pytest.raises(FleetCompareError, match="give one --label per run"):
        load_runs([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")], ["only one"])
    with pytest.raises(FleetCompareError, match=r"run is given twice; name each run folder once"):
        load_runs([str(tmp_path / "a" / "run"), str(tmp_path / "a" / ".." / "a" / "run")])


def test_labels_are_given_after_one_label_option_or_each_after_its_own(two_runs, tmp_path, capsys):
    """The page documents ``[--label NAME ...]``: ``--label a b`` was refused as "unrecognized
    arguments: b", only ``--label a --label b`` was taken."""
    base, _runs = two_runs
    runs = [str(base / "goal8"), str(base / "goal10")]
    assert main(["compare", *runs, "--label", "eight", "ten", "--out", str(tmp_path / "c.html")]) == 0
    assert "2 runs (eight, ten)" in capsys.readouterr().out  # as --label eight --label ten is
    assert main(["compare", *runs, "--label", "eight", "ten", "more", "--out", str(tmp_path / "c.html")]) == 2
    assert "3 --label for 2 runs" in capsys.readouterr().err


def test_a_runs_own_report_is_refused_as_the_pages_out(two_runs, tmp_path, capsys):
    """--out RUN/report.html replaced the run's report with the comparison, which only a new run of
    it could draw again; so did a run's of a folder of runs."""
    base, _runs = two_runs
    for name in ("goal8", "goal10"):
        shutil.copytree(base / name, tmp_path / name)
        (tmp_path / name / "report.html").write_text(f"<p>{name}'s own report</p>")  # as simulate --out draws one
    runs = [str(tmp_path / "goal8"), str(tmp_path / "goal10")]
    before = (tmp_path / "goal8" / "report.html").read_bytes()
    out = tmp_path / "goal10" / ".." / "goal8" / "report.html"
    assert main(["compare", *runs, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"fedfleet compare: --out {out} is the report of the run {tmp_path / 'goal8'}; name another .html file "
        "(compare.html, say)\n"
    )
    assert (tmp_path / "goal8" / "report.html").read_bytes() == before
    (tmp_path / "seeds").mkdir()
    shutil.move(tmp_path / "goal10", tmp_path / "seeds" / "run-0-seed=0")
    out = tmp_path / "seeds" / "run-0-seed=0" / "report.html"
    assert main(["compare", str(tmp_path / "goal8"), str(tmp_path / "seeds"), "--out", str(out)]) == 2
    assert "is the report of the run" in capsys.readouterr().err


def test_a_seeds_or_sweep_folder_stands_for_its_runs_in_order(two_runs, tmp_path, capsys):
    """``simulate --seeds 0,1 --out DIR`` writes DIR/run-0-seed=0 and DIR/run-1-seed=1, and ``compare
    DIR`` sets them side by side."""
    base, _runs = two_runs
    seeds = tmp_path / "seeds"
    for i, name in enumerate(("goal8", "goal10")):  # run-10 after run-2: in the runs' order, not the names'
        shutil.copytree(base / name, seeds / f"run-{10 * i}-seed={10 * i}")
    shutil.copytree(base / "goal8", seeds / "run-2-seed=2")
    (seeds / "notes").mkdir()  # not a run: left out
    assert main(["compare", str(seeds), "--out", str(tmp_path / "c.html")]) == 0
    assert "3 runs (run-0-seed=0, run-2-seed=2, run-10-seed=10)" in capsys.readouterr().out
    runs = load_runs([str(seeds), str(base / "goal10")])
    assert [r.label for r in runs] == ["run-0-seed=0", "run-2-seed=2", "run-10-seed=10", "goal10"]


@pytest.mark.parametrize("make", ["empty", "missing", "file", "bad_json", "no_rounds", "one_run", "parent"])
def test_a_folder_that_is_not_a_run_gets_one_line_saying_what_is_missing(two_runs, tmp_path, capsys, make):
    base, _runs = two_runs
    other = tmp_path / "other"
    expected = {
        "empty": "no summary.json or rounds.csv",
        "missing": "no such folder",
        "file": "a file, not a folder",
        "bad_json": "not JSON",
        "no_rounds": "no rounds.csv",
        "one_run": "two or more run folders",
        # a folder of runs (not named run-N, as --seeds writes) was told "write one with simulate --out"
        "parent": "it has no summary.json or rounds.csv; it holds 2 runs (goal10, goal8): name each, as ",
    }[make]
    if make == "empty":
        other.mkdir()
    elif make == "file":
        other.write_text("x")
    elif make == "bad_json":
        shutil.copytree(base / "goal8", other)
        (other / "summary.json").write_text("{not json")
    elif make == "no_rounds":
        shutil.copytree(base / "goal8", other)
        (other / "rounds.csv").unlink()
    elif make == "parent":
        for name in ("goal8", "goal10"):
            shutil.copytree(base / name, other / name)
    argv = ["compare", str(base / "goal8"), "--out", str(tmp_path / "c.html")]
    if make != "one_run":
        argv.insert(2, str(other))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedfleet compare: ") and err.count("\n") == 1 and "Traceback" not in err
    assert expected in err
    assert not (tmp_path / "c.html").exists()


class _Captions(HTMLParser):
    """Each figure's caption and each summary cell's text by key, as the page shows them."""

    def __init__(self) -> None:
        super().__init__()
        self.captions: dict[str, str] = {}
        self.shown: dict[str, list[str]] = {}
        self._figure: str | None = None
        self._key: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self._figure = a["id"]
        elif tag == "td" and "data-key" in a:
            self._key = a["data-key"]
            self.shown.setdefault(self._key, []).append("")

    def handle_endtag(self, tag):
        if tag == "td":
            self._key = None

    def handle_data(self, data):
        if self._key is not None:
            self.shown[self._key][-1] += data
        elif self._figure is not None and self.get_starttag_text().startswith("<figcaption"):
            self.captions[self._figure] = self.captions.get(self._figure, "") + data


def test_the_page_says_what_a_run_lacks_instead_of_drawing_or_showing_it_as_nothing(two_runs, tmp_path):
    """A run that committed no round, one written before rounds carried their bytes and before its
    summary held some figures, and a DP run: each gap is named on the page. The older run's bytes
    were drawn as 0 MB a round, its missing figures shown as n/a like an undefined value, the run
    without a committed round left out of the accuracy figure without a word, and no DP row shown."""
    import dataclasses

    from emulator.fleet.tables import RoundRow

    base, _runs = two_runs
    idle, older, private = tmp_path / "idle", tmp_path / "older", tmp_path / "private"
    for folder in (idle, older, private):
        shutil.copytree(base / "goal8", folder)
    rounds = RoundRow.from_csv(base / "goal8" / "rounds.csv")
    none_committed = [dataclasses.replace(r, committed=False, accuracy=float("nan"), loss=float("nan")) for r in rounds]
    RoundRow.to_csv(none_committed, idle / "rounds.csv")
    lines = (older / "rounds.csv").read_text().splitlines()
    (older / "rounds.csv").write_text("\n".join(",".join(line.split(",")[:12]) for line in lines) + "\n")
    summary = json.loads((older / "summary.json").read_text())
    for key in ("plan_cost", "target_accuracy", "devices_short_of_memory"):
        summary.pop(key, None)
    (older / "summary.json").write_text(json.dumps(summary))
    dp = json.loads((private / "summary.json").read_text())
    dp.update(epsilon=2.5, delta=1e-5, dp_rounds=4, noise_multiplier=1.0)
    (private / "summary.json").write_text(json.dumps(dp))

    out = tmp_path / "c.html"
    assert main(["compare", str(idle), str(older), str(private), "--out", str(out)]) == 0
    page = _Captions()
    page.feed(out.read_text(encoding="utf-8"))
    assert page.captions["compare_accuracy.png"].strip().endswith("No committed round measured its accuracy in: idle.")
    assert "No committed round measured its loss in: idle." in page.captions["compare_loss.png"]
    assert "Not recorded in: older" in page.captions["compare_bytes.png"]
    assert page.shown["plan_cost"][1] == "not in this run's summary" and page.shown["plan_cost"][0] != "n/a"
    assert page.shown["epsilon"] == ["n/a", "n/a", "2.5"] and page.shown["dp_rounds"][2] == "4"
    figures = {f.name: f.drawn for f in compare_figures(load_runs([str(idle), str(older)]))}
    drawn = [line.get_label() for line in figures["compare_bytes.png"].axes[0].get_lines()]
    assert drawn == ["idle down", "idle up"]  # the older run's bytes are not drawn as zeros
