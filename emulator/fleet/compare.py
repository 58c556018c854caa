"""Two or more fleet runs side by side in one HTML page (``fedfleet compare RUN_DIR RUN_DIR ...``):
FedAvg against FedAdam, plain against secure, two fleet configs.

A run is a folder ``fedfleet simulate --out`` wrote; the page reads its ``summary.json`` and
``rounds.csv`` (nothing else, so a run's sessions table may be left behind). It holds a summary
table with one column per run and figures with every run on shared axes: accuracy and loss against
simulated hours and against committed rounds, rounds committed over time, bytes per round, and the
per-client accuracy percentiles of the runs whose summary has them. The plots are drawn as the
report's are (matplotlib, PNG inlined), so the page is one self-contained file; the same runs give
the same bytes.
"""

from __future__ import annotations

import base64
import csv
import html
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .heap import collector_paused
from .report import (
    _DP_ROWS,
    _OPTIONAL_ROWS,
    _SUMMARY_ROWS,
    SUMMARY_JSON,
    Figure,
    _hours_axis,
    _integer_ticks,
    _legend,
    _new_figure,
    _no_data,
    _percentile_marks,
    _png,
    _td,
    accuracy_series,
    read_run_summary,
    script_json,
)
from .tables import ROUNDS_CSV, FleetTableError, RoundRow

COMPARE_HTML = "compare.html"

#: One colour per run, kept across the page's figures (matplotlib's tab10 order).
_RUN_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


class FleetCompareError(ValueError):
    """A folder that is not a fleet run, or labels that do not match the runs; the message says what to do."""


@dataclass(frozen=True)
class RunFolder:
    """One run as the page shows it: its label, ``summary.json`` and ``rounds.csv``."""

    label: str
    path: Path
    summary: dict[str, Any]
    rounds: list[RoundRow]
    #: Its rounds.csv has the rounds' bytes (one written before they were recorded reads them as 0).
    round_bytes: bool = True

    @property
    def span_s(self) -> float:
        """Simulated seconds the run covered (its summary's, else its last round's end)."""
        span = self.summary.get("simulated_s")
        if isinstance(span, (int, float)) and math.isfinite(span) and span > 0:
            return float(span)
        return max((r.end_s for r in self.rounds if math.isfinite(r.end_s)), default=0.0)


def load_run(path: str | os.PathLike, label: str | None = None) -> RunFolder:
    """Read a run folder; :class:`FleetCompareError` names what is missing."""
    folder = Path(path)
    rounds_path = folder / ROUNDS_CSV
    summary = read_run_summary(
        folder, (SUMMARY_JSON, ROUNDS_CSV), FleetCompareError, f"write one with fedfleet simulate --out {folder}"
    )
    try:
        rounds = RoundRow.from_csv(rounds_path)
        with rounds_path.open(encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), [])
    except (FleetTableError, UnicodeDecodeError) as exc:
        raise FleetCompareError(f"{rounds_path} is not a run's rounds table ({exc})") from None
    round_bytes = {"bytes_down", "bytes_up"} <= set(header)
    return RunFolder(label or folder.resolve().name or str(folder), folder, summary, rounds, round_bytes)


def sweep_runs(path: str | os.PathLike) -> list[str]:
    """The runs of a ``simulate --seeds/--sweep --out DIR`` folder, ``DIR/run-0-seed=0``,
    ``DIR/run-1-seed=1``, ... in their order ([] for a folder that is a run itself, or holds none)."""
    folder = Path(path)
    if not folder.is_dir() or (folder / SUMMARY_JSON).is_file():
        return []
    places = {p: re.match(r"run-(\d+)(?:-|$)", p.name) for p in folder.glob("run-*") if (p / SUMMARY_JSON).is_file()}
    return [str(p) for p, _ in sorted(((p, m) for p, m in places.items() if m), key=lambda pm: int(pm[1][1]))]


def load_runs(paths: list[str], labels: list[str] | None = None) -> list[RunFolder]:
    """The runs in order, a ``--seeds``/``--sweep`` folder standing for its runs; labels from ``labels``
    or else the folder names (made unique by their parents)."""
    paths = [run for p in paths for run in (sweep_runs(p) or [p])]
    if len(paths) < 2:
        raise FleetCompareError(f"compare needs two or more run folders; got {len(paths)}")
    if labels and len(labels) != len(paths):
        raise FleetCompareError(
            f"{len(labels)} --label for {len(paths)} runs; give one --label per run, in order, or none"
        )
    runs = [load_run(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    where = [r.path.resolve() for r in runs]
    if not labels and len(set(where)) < len(where):  # else both are '.', relative to the one folder
        twice = next(r.path for r, w in zip(runs, where) if where.count(w) > 1)
        raise FleetCompareError(f"{twice} is given twice; name each run folder once")
    names = [r.label for r in runs]
    if not labels and len(set(names)) < len(names):  # run/ and ../b/run/: tell them apart by their parents
        names = [
            os.path.relpath(r.path.resolve(), Path(os.path.commonpath([str(x.path.resolve()) for x in runs])))
            or r.label
            for r in runs
        ]
        runs = [RunFolder(n, r.path, r.summary, r.rounds, r.round_bytes) for n, r in zip(names, runs)]
    if len({r.label for r in runs}) < len(runs):
        raise FleetCompareError(f"two runs share a label ({[r.label for r in runs]}); give each its own --label")
    return runs


# --- figures ---------------------------------------------------------------------------------


def _colour(i: int) -> str:
    return _RUN_COLOURS[i % len(_RUN_COLOURS)]


def compare_quality(runs: list[RunFolder], metric: str) -> Figure:
    """``metric`` (accuracy or loss) of every run against simulated hours and against committed rounds."""
    fig, (ax_t, ax_r) = _new_figure(2)
    drawn = False
    unmeasured = []
    for i, run in enumerate(runs):
        series = accuracy_series(run.rounds)
        by_hour, by_round = series[f"{metric}_by_hour"], series[f"{metric}_by_round"]
        if not by_round:
            unmeasured.append(run.label)
        else:
            drawn = True
            ax_t.plot([x for x, _ in by_hour], [v for _, v in by_hour], marker=".", color=_colour(i), label=run.label)
            ax_r.plot([x for x, _ in by_round], [v for _, v in by_round], marker=".", color=_colour(i), label=run.label)
        reached = run.summary.get("time_to_target_accuracy_s") if metric == "accuracy" else None
        if isinstance(reached, (int, float)) and math.isfinite(reached):
            ax_t.axvline(
                reached / 3600.0,
                color=_colour(i),
                linestyle="--",
                linewidth=1,
                label=f"{run.label}: target reached at {reached / 3600.0:.2f} h",
            )
    if drawn:
        _legend(ax_t)
        _legend(ax_r)
    else:
        _no_data(ax_t, f"measured {metric}")
        _no_data(ax_r, f"measured {metric}")
    ax_t.set_title(f"{metric.capitalize()} over simulated time")
    ax_t.set_ylabel(metric)
    _hours_axis(ax_t, max(r.span_s for r in runs))
    ax_r.set_title(f"{metric.capitalize()} over committed rounds")
    ax_r.set_xlabel("committed round")
    ax_r.set_ylabel(metric)
    _integer_ticks(ax_r.xaxis)
    ax_r.grid(True, alpha=0.3)
    caption = (
        f"Each run's committed models' {metric}, against simulated hours and against committed rounds, on shared axes."
    )
    if metric == "accuracy":
        caption += " A dashed line marks when a run's first model reached its target accuracy."
    if unmeasured:
        caption += f" No committed round measured its {metric} in: {', '.join(unmeasured)}."
    return Figure(f"compare_{metric}.png", caption, _png(fig), fig)


def compare_rounds(runs: list[RunFolder]) -> Figure:
    """Rounds committed so far against simulated hours, one step line per run."""
    fig, (ax,) = _new_figure(1)
    for i, run in enumerate(runs):
        ends = sorted(r.end_s / 3600.0 for r in run.rounds if r.committed)
        ax.step(
            [0.0, *ends, run.span_s / 3600.0],
            [0, *range(1, len(ends) + 1), len(ends)],
            where="post",
            color=_colour(i),
            label=f"{run.label} ({len(ends)} of {len(run.rounds)})",
        )
    _legend(ax)
    ax.set_title("Rounds committed over time")
    ax.set_ylabel("rounds committed")
    ax.set_ylim(bottom=0)
    _integer_ticks(ax.yaxis)
    _hours_axis(ax, max(r.span_s for r in runs))
    caption = "Rounds committed so far against simulated hours; the legend gives committed of all rounds."
    return Figure("compare_rounds.png", caption, _png(fig), fig)


def compare_bytes(runs: list[RunFolder]) -> Figure:
    """Bytes down (solid) and up (dashed) per round, every run on the same axes."""
    fig, (ax,) = _new_figure(1)
    recorded = [r for r in runs if r.round_bytes]
    longest = max((len(r.rounds) for r in recorded), default=0)
    for i, run in enumerate(runs):
        if not run.round_bytes:
            continue
        x = list(range(1, len(run.rounds) + 1))
        ax.plot(
            x,
            [r.bytes_down / 1e6 for r in run.rounds],
            drawstyle="steps-mid",
            color=_colour(i),
            label=f"{run.label} down",
        )
        ax.plot(
            x,
            [r.bytes_up / 1e6 for r in run.rounds],
            drawstyle="steps-mid",
            color=_colour(i),
            linestyle="--",
            label=f"{run.label} up",
        )
    if longest:
        ax.set_xlim(0.5, longest + 0.5)
        ax.set_ylim(bottom=0)
        _legend(ax)
    else:
        _no_data(ax, "rounds")
    ax.set_title("Traffic per round")
    ax.set_xlabel("round")
    ax.set_ylabel("MB")
    _integer_ticks(ax.xaxis)
    ax.grid(True, alpha=0.3)
    caption = "Bytes each round's selected devices received (down, solid) and sent (up, dashed)."
    older = [r.label for r in runs if not r.round_bytes]
    if older:
        caption += f" Not recorded in: {', '.join(older)} (a rounds.csv written before rounds carried their bytes)."
    return Figure("compare_bytes.png", caption, _png(fig), fig)


def compare_client_accuracy(runs: list[RunFolder]) -> Figure | None:
    """Per-client accuracy percentiles, one row of marks per run that has them; ``None`` when no run has."""
    rows = []
    for i, run in enumerate(runs):
        percentiles = run.summary.get("client_accuracy_percentiles")
        marks = _percentile_marks(percentiles) if isinstance(percentiles, dict) else []
        if marks:
            rows.append((i, run, marks))
    if not rows:
        return None
    fig, (ax,) = _new_figure(1, height=1.2 + 0.6 * len(rows))
    for y, (i, run, marks) in enumerate(rows):
        values = [v for _, v in marks]
        ax.plot([values[0], values[-1]], [y, y], color=_colour(i), linewidth=4, alpha=0.35, solid_capstyle="butt")
        ax.scatter(values, [y] * len(values), color=_colour(i), s=40, zorder=2, label=run.label)
        for key, value in marks:
            ax.annotate(key, (value, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([run.label for _, run, _ in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0.0, 1.0)
    ax.set_xlabel("accuracy on the client's own test examples")
    ax.set_title("Per-client accuracy percentiles")
    ax.grid(True, axis="x", alpha=0.3)
    skipped = [run.label for run in runs if run not in [r for _, r, _ in rows]]
    caption = "Percentiles over clients of the last model's accuracy on each client's own test examples."
    if skipped:
        caption += f" Not measured in: {', '.join(skipped)}."
    return Figure("compare_client_accuracy.png", caption, _png(fig), fig)


def compare_figures(runs: list[RunFolder]) -> list[Figure]:
    with collector_paused():
        figures = [
            compare_quality(runs, "accuracy"),
            compare_quality(runs, "loss"),
            compare_rounds(runs),
            compare_bytes(runs),
        ]
        extra = compare_client_accuracy(runs)
    return figures + ([extra] if extra is not None else [])


# --- the page --------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
.table-wrap{overflow-x:auto;margin:1em 0}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right;overflow-wrap:anywhere}
th{background:#f3f3f3;position:sticky;top:0}td:first-child,th:first-child{text-align:left}code{font-family:monospace}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}td.absent{color:#888;font-style:italic}
"""


def _absent(key: str) -> str:
    """The cell of a figure a run's summary does not hold (written before the figure existed):
    said as such, not as an undefined value."""
    return f'<td data-key="{html.escape(key)}" data-value="null" class="absent">not in this run\'s summary</td>'


def render_compare(runs: list[RunFolder], figures: list[Figure]) -> str:
    """The self-contained page: the summary table (a column per run), then the figures."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Fleet runs compared: {html.escape(', '.join(r.label for r in runs))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Fleet runs compared</h1>",
        "<ul>"
        + "".join(f"<li><b>{html.escape(r.label)}</b>: <code>{html.escape(str(r.path))}</code></li>" for r in runs)
        + "</ul>",
        '<h2>Summary</h2><div class="table-wrap"><table id="compare-summary"><tr><th>figure</th>',
    ]
    out.extend(f'<th data-run="{html.escape(r.label)}">{html.escape(r.label)}</th>' for r in runs)
    out.append("</tr>")
    dp_rows = _DP_ROWS if any(r.summary.get("delta") is not None for r in runs) else ()
    rows = [*_SUMMARY_ROWS, *dp_rows, *_OPTIONAL_ROWS]
    for key, label in rows:
        if not any(key in r.summary for r in runs):
            continue
        cells = "".join(_td(r.summary[key], key) if key in r.summary else _absent(key) for r in runs)
        out.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    out.append("</table></div><h2>Figures</h2>")
    for fig in figures:
        data = base64.b64encode(fig.png).decode("ascii")
        out.append(
            f'<figure id="{html.escape(fig.name)}"><img alt="{html.escape(fig.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(fig.caption)}</figcaption></figure>"
        )
    payload = script_json({r.label: r.summary for r in runs}, indent=1)
    out.append(f'<script type="application/json" id="summaries-json">{payload}</script>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_compare(paths: list[str], out: str | os.PathLike, labels: list[str] | None = None) -> list[RunFolder]:
    """Read the run folders and write the comparison page to ``out``; return the runs."""
    runs = load_runs(paths, labels)
    page = render_compare(runs, compare_figures(runs))
    Path(out).write_text(page, encoding="utf-8")
    return runs
