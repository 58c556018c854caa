"""What a fleet run looked like: its summary, the plots of the paper's operational profile
(section 9 and appendix A, Fig. 5-9, Table 1), and one self-contained HTML page.

The figures follow the paper's: devices available / checking in / participating over the day
(Fig. 5-6), round completions and durations (Fig. 5, 6 and 8), how the devices of a round ended up
(Fig. 7), drop-out by hour of day (Fig. 7's day/night contrast), traffic down and up (Fig. 9),
session shapes (Table 1) and the model's accuracy over rounds.

:func:`summarize` is pure; :func:`write_report` is the shell that writes files. Everything written
is a function of the run alone (no dates, no host names, PNGs without a Software tag), so the same
run gives the same bytes.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from device_runtime.opstats import SHAPE_SYMBOLS

from .tables import FleetRun, SessionRow, TimelineRow

#: Colours kept across figures: the paper's Fig. 6 draws participating devices blue, waiting purple.
_AVAILABLE = "#2ca02c"
_CHECKING_IN = "#8e44ad"
_PARTICIPATING = "#1f77b4"
_COMMITTED = "#2ca02c"
_ABANDONED = "#d62728"
_LATE = "#ff7f0e"
_DOWN = "#1f77b4"
_UP = "#ff7f0e"

SUMMARY_JSON = "summary.json"
REPORT_HTML = "report.html"


class FleetReportError(RuntimeError):
    """The report cannot be drawn here (its plotting library is missing)."""


def _finite(x: float) -> float | None:
    """JSON has no NaN: an unmeasured value is null."""
    return float(x) if math.isfinite(x) else None


def _ratio(num: float, den: float) -> float | None:
    """``num / den``, or ``None`` when that is undefined or overflows (a wall time of 1e-320 s)."""
    return _finite(num / den) if den else None


def _start_hour_utc(run: FleetRun) -> float:
    """The UTC hour of day simulated time 0 falls at (0 when the run carries no config)."""
    return 0.0 if run.config is None else float(run.config.fleet.start_utc_hour)


def hour_of_day(t_s: float, start_hour_utc: float = 0.0) -> int:
    """The UTC hour of day (0-23) of simulated time ``t_s``."""
    return int(math.floor(start_hour_utc + t_s / 3600.0)) % 24


def available_by_hour(timeline: list[TimelineRow], start_hour_utc: float = 0.0) -> dict[int, float]:
    """Mean number of available devices in each UTC hour of day the timeline covers."""
    sums: dict[int, list[float]] = {}
    for row in timeline:
        sums.setdefault(hour_of_day(row.t_s, start_hour_utc), []).append(row.available)
    return {h: statistics.fmean(v) for h, v in sorted(sums.items())}


def availability_swing(timeline: list[TimelineRow], start_hour_utc: float = 0.0) -> tuple[float | None, float, float]:
    """(swing, peak, trough) of available devices over the day (paper, Fig. 5-6).

    Peak and trough are hourly means (the samples of each UTC hour of day averaged over every day
    the run covers), so one noisy sample does not make the swing. The swing is peak over trough
    with both floored at one device: a trough of zero available devices reads as the peak count
    itself instead of infinity (JSON has no infinity), a fleet that never had a device available
    reads as 1 (no swing), and the swing is never below 1. It is ``None`` without a timeline.
    """
    hourly = available_by_hour(timeline, start_hour_utc)
    if not hourly:
        return None, 0.0, 0.0
    peak, trough = max(hourly.values()), min(hourly.values())
    return max(peak, 1.0) / max(trough, 1.0), peak, trough


def is_dropout(session: SessionRow) -> bool:
    """A selected device that never got its report to the server: no completed (``^``) or
    rejected (``#``) upload (paper, section 9: drop-out from computation errors, network failures
    or changes in eligibility). A late report that the server rejected is not a drop-out: the
    device finished, the round had closed."""
    return session.accepted and not session.shape.endswith(("^", "#"))


def shape_counts(sessions: list[SessionRow]) -> dict[str, int]:
    """Counts of the shapes of training sessions (accepted check-ins, as in the paper's Table 1),
    most frequent first (ties by shape, so the order is stable)."""
    counts = Counter(s.shape for s in sessions if s.accepted)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize(run: FleetRun) -> dict[str, Any]:
    """The run's headline figures, as JSON-ready values (``None`` where a figure is undefined).

    - ``digest``: the run's digest (round history and committed models); ``devices`` and
      ``seed`` from its config (``None`` without one);
    - ``dropout_rate``: drop-outs (see :func:`is_dropout`) over accepted sessions;
    - ``availability_swing``, ``available_peak``, ``available_trough``: see :func:`availability_swing`;
    - ``shapes`` and ``shape_shares``: training session shapes, counts and shares (Table 1);
    - ``rounds``, ``rounds_committed``, ``rounds_abandoned``, ``round_completion_rate``,
      ``round_duration_median_s`` (committed rounds);
    - ``sessions`` (every check-in), ``sessions_accepted``, ``sessions_completed`` (upload
      completed), ``checkins_rejected``; ``errors``: sessions that ended in an error, by kind;
      ``bytes_down``, ``bytes_up``;
    - ``devices_short_of_memory``: devices whose memory cannot hold the plan (they took no part);
      ``plan_cost``: the plan's FLOPs per example, parameters, peak memory estimate, plan,
      checkpoint and update bytes, and the simulated seconds per example on the reference phone;
    - ``accuracy``, ``loss``: of the last committed round that measured them;
    - ``simulated_s``, ``wall_s``, ``sim_s_per_wall_s``, ``sessions_per_wall_s`` (accepted
      sessions), ``completed_sessions_per_wall_s``.
    """
    sessions: list[SessionRow] = run.sessions
    rounds = run.rounds
    accepted = [s for s in sessions if s.accepted]
    completed = sum(1 for s in accepted if s.shape.endswith("^"))
    dropouts = sum(1 for s in accepted if is_dropout(s))
    shapes = shape_counts(sessions)
    committed = [r for r in rounds if r.committed]
    swing, peak, trough = availability_swing(run.timeline, _start_hour_utc(run))
    measured_acc = [r for r in committed if math.isfinite(r.accuracy)]
    measured_loss = [r for r in committed if math.isfinite(r.loss)]
    wall_s = float(run.wall_s)
    span_s = float(run.span_s)
    fleet = run.config.fleet if run.config is not None else None
    return {
        "digest": run.digest,
        "devices": fleet.devices if fleet else None,
        "seed": fleet.seed if fleet else None,
        "dropout_rate": _ratio(dropouts, len(accepted)),
        "availability_swing": swing,
        "available_peak": peak,
        "available_trough": trough,
        "shapes": shapes,
        "shape_shares": {k: v / len(accepted) for k, v in shapes.items()},
        "rounds": len(rounds),
        "rounds_committed": len(committed),
        "rounds_abandoned": len(rounds) - len(committed),
        "round_completion_rate": _ratio(len(committed), len(rounds)),
        "round_duration_median_s": _finite(statistics.median(r.duration_s for r in committed)) if committed else None,
        "sessions": len(sessions),
        "sessions_accepted": len(accepted),
        "sessions_completed": completed,
        "checkins_rejected": len(sessions) - len(accepted),
        "errors": dict(run.errors),
        "bytes_down": sum(s.bytes_down for s in sessions),
        "bytes_up": sum(s.bytes_up for s in sessions),
        "devices_short_of_memory": run.devices_short_of_memory,
        "plan_cost": run.plan_cost,
        "accuracy": _finite(measured_acc[-1].accuracy) if measured_acc else None,
        "loss": _finite(measured_loss[-1].loss) if measured_loss else None,
        "simulated_s": span_s,
        "wall_s": wall_s,
        "sim_s_per_wall_s": _ratio(span_s, wall_s),
        "sessions_per_wall_s": _ratio(len(accepted), wall_s),
        "completed_sessions_per_wall_s": _ratio(completed, wall_s),
    }


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One plot of the report: its file name, caption, and PNG bytes."""

    name: str
    caption: str
    png: bytes


def _new_figure(rows: int = 1, height: float = 4.0) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.figure import Figure as MplFigure  # no pyplot: no global state, no GUI backend
    except ModuleNotFoundError:
        raise FleetReportError("the fleet report's plots need matplotlib; install it with pip install 'fedfleet[sim]'") from None

    fig = MplFigure(figsize=(9.0, height * rows), dpi=100, layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0].tolist()
    return fig, axes


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    # No Software tag (it names the matplotlib version): the same run gives the same bytes.
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _legend(ax: Any) -> None:
    """Beside the plot, where it hides no data (constrained layout makes room)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes, color="0.4")


def _hours_axis(ax: Any) -> None:
    ax.set_xlabel("simulated time (hours since the start)")
    ax.grid(True, alpha=0.3)


def _per_hour(times_s: list[float], weights: list[float], span_s: float) -> tuple[list[float], list[float]]:
    """(bin edges in hours, sums of ``weights`` per simulated hour since the start), for ``stairs``."""
    bins = max(1, math.ceil(span_s / 3600.0))
    sums = [0.0] * bins
    for t, w in zip(times_s, weights):
        sums[min(bins - 1, max(0, int(t // 3600.0)))] += w
    return [float(i) for i in range(bins + 1)], sums


def plot_devices(run: FleetRun) -> Figure:
    """Devices available / checking in / participating over time and by hour of day (Fig. 5-6)."""
    fig, (ax_t, ax_h) = _new_figure(2)
    tl = run.timeline
    if tl:
        t = [r.t_s / 3600.0 for r in tl]
        ax_t.plot(t, [r.available for r in tl], color=_AVAILABLE, label="available")
        ax_t.plot(t, [r.checking_in for r in tl], color=_CHECKING_IN, label="checking in / waiting")
        ax_t.plot(t, [r.participating for r in tl], color=_PARTICIPATING, label="participating")
        _legend(ax_t)
        start_h = _start_hour_utc(run)
        for field, colour, label in (
            ("available", _AVAILABLE, "available"),
            ("checking_in", _CHECKING_IN, "checking in / waiting"),
            ("participating", _PARTICIPATING, "participating"),
        ):
            groups: dict[int, list[int]] = {}
            for r in tl:
                groups.setdefault(hour_of_day(r.t_s, start_h), []).append(getattr(r, field))
            hours = sorted(groups)
            ax_h.plot(hours, [statistics.fmean(groups[h]) for h in hours], marker="o", color=colour, label=label)
        ax_h.set_xlim(-0.5, 23.5)
        ax_h.set_xticks(range(0, 24, 2))
        _legend(ax_h)
    else:
        _no_data(ax_t, "timeline")
        _no_data(ax_h, "timeline")
    ax_t.set_title("Devices over time")
    ax_t.set_ylabel("devices")
    _hours_axis(ax_t)
    ax_h.set_title("Devices by hour of day (mean over the run)")
    ax_h.set_xlabel("hour of day (UTC)")
    ax_h.set_ylabel("devices")
    ax_h.grid(True, alpha=0.3)
    return Figure("devices.png", "Devices available, checking in and participating (paper, Fig. 5-6).", _png(fig))


def plot_rounds(run: FleetRun) -> Figure:
    """Round completions per hour and round durations over time (Fig. 6 bottom, Fig. 8)."""
    fig, (ax_r, ax_d) = _new_figure(2)
    rounds = run.rounds
    if rounds:
        span = run.span_s
        for committed, colour, label in ((True, _COMMITTED, "committed"), (False, _ABANDONED, "abandoned")):
            ends = [r.end_s for r in rounds if r.committed is committed]
            edges, per_hour = _per_hour(ends, [1.0] * len(ends), span)
            ax_r.stairs(per_hour, edges, color=colour, linewidth=1.5, label=label)
            ax_d.scatter(
                [r.start_s / 3600.0 for r in rounds if r.committed is committed],
                [r.duration_s / 60.0 for r in rounds if r.committed is committed],
                s=14,
                alpha=0.7,
                linewidths=0,
                color=colour,
                label=label,
            )
        _legend(ax_r)
        _legend(ax_d)
    else:
        _no_data(ax_r, "rounds")
        _no_data(ax_d, "rounds")
    ax_r.set_title("Rounds per hour")
    ax_r.set_ylabel("rounds")
    _hours_axis(ax_r)
    ax_d.set_title("Round duration")
    ax_d.set_ylabel("minutes")
    _hours_axis(ax_d)
    return Figure("rounds.png", "Round completions per hour and round durations (paper, Fig. 5, 6 and 8).", _png(fig))


def plot_dropout(run: FleetRun) -> Figure:
    """How each round's selected devices ended (Fig. 7) and drop-out by local hour of day."""
    fig, (ax_o, ax_h) = _new_figure(2)
    rounds = run.rounds
    if rounds:
        accepted = [r.accepted for r in rounds]
        late = [max(0, r.reported - r.accepted) for r in rounds]
        dropped = [r.dropped for r in rounds]
        # Stacked steps, not bars: three polygons whatever the number of rounds (a day of a large
        # fleet has thousands, and a bar each took matplotlib seconds).
        edges = [i + 0.5 for i in range(len(rounds) + 1)]  # round i spans [i - 0.5, i + 0.5]
        bottom = [0] * len(rounds)
        for counts, colour, label in (
            (accepted, _COMMITTED, "reported, aggregated"),
            (late, _LATE, "reported, rejected"),
            (dropped, _ABANDONED, "dropped out"),
        ):
            top = [b + c for b, c in zip(bottom, counts)]
            ax_o.fill_between(edges, bottom + bottom[-1:], top + top[-1:], step="post", color=colour, linewidth=0, label=label)
            bottom = top
        ax_o.set_xlim(edges[0], edges[-1])
        _legend(ax_o)
    else:
        _no_data(ax_o, "rounds")
    ax_o.set_title("Selected devices per round, by outcome")
    ax_o.set_xlabel("round")
    ax_o.set_ylabel("devices")
    ax_o.grid(True, alpha=0.3)
    accepted_s = [s for s in run.sessions if s.accepted]
    if accepted_s:
        by_hour: dict[int, list[bool]] = {}
        for s in accepted_s:
            by_hour.setdefault(int(s.local_hour) % 24, []).append(is_dropout(s))
        hours = sorted(by_hour)
        ax_h.bar(hours, [100.0 * statistics.fmean(by_hour[h]) for h in hours], color=_ABANDONED)
        overall = 100.0 * statistics.fmean(is_dropout(s) for s in accepted_s)
        ax_h.axhline(overall, color="0.3", linestyle="--", label=f"whole run {overall:.1f}%")
        _legend(ax_h)
    else:
        _no_data(ax_h, "sessions")
    ax_h.set_xlim(-0.5, 23.5)
    ax_h.set_xticks(range(0, 24, 2))
    ax_h.set_title("Drop-out rate by the device's local hour of day")
    ax_h.set_xlabel("local hour of day")
    ax_h.set_ylabel("drop-out (% of accepted sessions)")
    ax_h.grid(True, alpha=0.3)
    return Figure("dropout.png", "Outcomes of each round's selected devices and drop-out by hour (paper, Fig. 7).", _png(fig))


def plot_shapes(run: FleetRun) -> Figure:
    """Session shapes and their shares (Table 1)."""
    fig, (ax,) = _new_figure(1)
    shapes = shape_counts(run.sessions)
    if shapes:
        top = list(shapes.items())[:10]
        total = sum(shapes.values())
        labels = [k for k, _ in top][::-1]
        counts = [v for _, v in top][::-1]
        colours = [_COMMITTED if k.endswith("^") else _LATE if k.endswith("#") else _ABANDONED for k in labels]
        bars = ax.barh(labels, counts, color=colours)
        ax.bar_label(bars, labels=[f"{c} ({100.0 * c / total:.1f}%)" for c in counts], padding=3)
        ax.set_xlim(0, max(counts) * 1.25)
        for tick in ax.get_yticklabels():
            tick.set_family("monospace")
    else:
        _no_data(ax, "training sessions")
    ax.set_title("Training session shapes")
    ax.set_xlabel("sessions")
    ax.grid(True, axis="x", alpha=0.3)
    return Figure("shapes.png", "Session shapes of accepted check-ins (paper, Table 1).", _png(fig))


def plot_traffic(run: FleetRun) -> Figure:
    """Bytes down and up per hour (Fig. 9: downloads dominate)."""
    fig, (ax,) = _new_figure(1)
    if run.sessions:
        ends = [s.end_s for s in run.sessions]
        edges, down = _per_hour(ends, [s.bytes_down / 1e6 for s in run.sessions], run.span_s)
        _, up = _per_hour(ends, [s.bytes_up / 1e6 for s in run.sessions], run.span_s)
        ax.stairs(down, edges, color=_DOWN, linewidth=1.5, label="down (server to devices)")
        ax.stairs(up, edges, color=_UP, linewidth=1.5, label="up (devices to server)")
        _legend(ax)
    else:
        _no_data(ax, "sessions")
    ax.set_title("Traffic per hour")
    ax.set_ylabel("MB")
    _hours_axis(ax)
    return Figure("traffic.png", "Bytes down and up per hour (paper, Fig. 9).", _png(fig))


def plot_accuracy(run: FleetRun) -> Figure:
    """The model's accuracy (and loss) over committed rounds."""
    fig, (ax,) = _new_figure(1)
    committed = [r for r in run.rounds if r.committed]
    acc = [(i, r.accuracy) for i, r in enumerate(committed, start=1) if math.isfinite(r.accuracy)]
    loss = [(i, r.loss) for i, r in enumerate(committed, start=1) if math.isfinite(r.loss)]
    if acc or loss:
        lines = []
        if acc:
            lines += ax.plot([i for i, _ in acc], [a for _, a in acc], marker=".", color=_PARTICIPATING, label="accuracy")
            ax.set_ylabel("accuracy")
        if loss:
            ax_l = ax.twinx()  # loss on its own scale, to the right
            lines += ax_l.plot([i for i, _ in loss], [v for _, v in loss], color=_LATE, label="loss")
            ax_l.set_ylabel("loss")
        fig.legend(handles=lines, loc="outside right upper", fontsize="small")
    else:
        _no_data(ax, "measured rounds")
    ax.set_title("Model quality over committed rounds")
    ax.set_xlabel("committed round")
    ax.grid(True, alpha=0.3)
    return Figure("accuracy.png", "Model accuracy and loss over committed rounds.", _png(fig))


def plot_durations(run: FleetRun) -> Figure:
    """Round run time and device participation time (Fig. 8: participation is capped)."""
    fig, (ax,) = _new_figure(1)
    participation = [(s.end_s - s.start_s) / 60.0 for s in run.sessions if s.accepted]
    durations = [r.duration_s / 60.0 for r in run.rounds if r.committed]
    if participation or durations:
        # Up to the 99th percentile: a few stragglers would squeeze the rest into one bin.
        values = sorted(participation + durations)
        lo, hi = values[0], values[int(0.99 * (len(values) - 1))]
        bins = [lo + (hi - lo) * i / 30 for i in range(31)] if hi > lo else 1
        # Shares, not counts: sessions outnumber rounds a hundredfold.
        if participation:
            weights = [1.0 / len(participation)] * len(participation)
            ax.hist(participation, bins=bins, weights=weights, color=_PARTICIPATING, alpha=0.6, label="device participation")
        if durations:
            weights = [1.0 / len(durations)] * len(durations)
            ax.hist(durations, bins=bins, weights=weights, color=_COMMITTED, alpha=0.6, label="committed round")
        _legend(ax)
    else:
        _no_data(ax, "sessions or rounds")
    ax.set_title("Round run time and device participation time (to the 99th percentile)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("share")
    ax.grid(True, alpha=0.3)
    return Figure("durations.png", "Round run time and device participation time (paper, Fig. 8).", _png(fig))


PLOTS: tuple[Callable[[FleetRun], Figure], ...] = (
    plot_devices,
    plot_rounds,
    plot_dropout,
    plot_shapes,
    plot_traffic,
    plot_accuracy,
    plot_durations,
)


# --- HTML ------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    """A value as the page shows it (the exact value goes in ``data-value``)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) or "none"
    return str(value)


def _exact(value: Any) -> str:
    """The exact value, for machines: JSON text (floats as their shortest exact decimal)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "null"
    return json.dumps(value)


def _td(value: Any, key: str | None = None) -> str:
    attrs = f' data-key="{html.escape(key)}"' if key else ""
    shown = f"{100.0 * value:.2f}%" if key and key.endswith("_rate") and isinstance(value, float) else _fmt(value)
    return f'<td{attrs} data-value="{html.escape(_exact(value))}">{html.escape(shown)}</td>'


_SUMMARY_ROWS = (
    ("digest", "digest"),
    ("devices", "devices"),
    ("seed", "seed"),
    ("simulated_s", "simulated seconds"),
    ("wall_s", "wall seconds"),
    ("sim_s_per_wall_s", "simulated seconds per wall second"),
    ("sessions", "sessions (check-ins)"),
    ("sessions_accepted", "accepted sessions"),
    ("sessions_completed", "completed sessions (upload completed)"),
    ("checkins_rejected", "rejected check-ins"),
    ("errors", "sessions ended in an error, by kind"),
    ("sessions_per_wall_s", "accepted sessions per wall second"),
    ("completed_sessions_per_wall_s", "completed sessions per wall second"),
    ("dropout_rate", "drop-out rate"),
    ("availability_swing", "availability swing (peak / trough)"),
    ("available_peak", "available devices, peak hour (mean)"),
    ("available_trough", "available devices, trough hour (mean)"),
    ("rounds", "rounds"),
    ("rounds_committed", "rounds committed"),
    ("rounds_abandoned", "rounds abandoned"),
    ("round_completion_rate", "round completion rate"),
    ("round_duration_median_s", "median committed round duration (s)"),
    ("bytes_down", "bytes down"),
    ("bytes_up", "bytes up"),
    ("devices_short_of_memory", "devices short of the plan's memory (took no part)"),
    ("plan_cost", "plan cost per device"),
    ("accuracy", "accuracy (last measured committed round)"),
    ("loss", "loss (last measured committed round)"),
)

_ROUND_COLUMNS = (
    "round_id",
    "task",
    "start_s",
    "end_s",
    "duration_s",
    "committed",
    "selected",
    "reported",
    "accepted",
    "dropped",
    "accuracy",
    "loss",
)

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}code,.shape{font-family:monospace}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}
.rounds{max-height:30em;overflow:auto;display:block}
"""


def render_html(summary: dict[str, Any], figures: list[Figure], run: FleetRun) -> str:
    """The self-contained report: summary, figures (PNG as base64), shapes and rounds tables."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Fleet run {html.escape(str(summary['digest'])[:12])}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Fleet simulation report</h1>",
        f"<p>Run digest <code>{html.escape(str(summary['digest']))}</code>.</p>",
        '<h2>Summary</h2><table id="summary">',
    ]
    for key, label in _SUMMARY_ROWS:
        out.append(f"<tr><th>{html.escape(label)}</th>{_td(summary[key], key)}</tr>")
    out.append("</table>")

    out.append("<h2>Figures</h2>")
    for fig in figures:
        data = base64.b64encode(fig.png).decode("ascii")
        out.append(
            f'<figure id="{html.escape(fig.name)}"><img alt="{html.escape(fig.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(fig.caption)}</figcaption></figure>"
        )

    out.append('<h2>Session shapes</h2><table id="shapes"><tr><th>shape</th><th>sessions</th><th>share</th></tr>')
    for shape, count in summary["shapes"].items():
        share = summary["shape_shares"][shape]
        out.append(f'<tr><td class="shape" data-value="{html.escape(_exact(shape))}">{html.escape(shape)}</td>'
                   f"{_td(count)}<td data-value=\"{_exact(share)}\">{100.0 * share:.1f}%</td></tr>")
    out.append("</table>")
    legend = ", ".join(f"<code>{html.escape(sym)}</code> {html.escape(kind.replace('_', ' '))}" for kind, sym in SHAPE_SYMBOLS.items())
    out.append(f"<p>Legend: {legend}.</p>")

    out.append('<h2>Rounds</h2><div class="rounds"><table id="rounds"><tr>')
    out.extend(f"<th>{c}</th>" for c in _ROUND_COLUMNS)
    out.append("</tr>")
    for r in run.rounds:
        out.append("<tr>" + "".join(_td(getattr(r, c)) for c in _ROUND_COLUMNS) + "</tr>")
    out.append("</table></div>")

    # The summary as JSON too, for tools; "</" is escaped so no value can close the script element.
    payload = json.dumps(summary, indent=1, allow_nan=False).replace("</", "<\\/")
    out.append(f'<script type="application/json" id="summary-json">{payload}</script>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(run: FleetRun, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Write the run's tables (``sessions.csv``, ``rounds.csv``, ``timeline.csv``),
    ``summary.json``, the PNG plots and ``report.html`` into ``out_dir``; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run.write_tables(out)
    summary = summarize(run)
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    figures = [plot(run) for plot in PLOTS]
    for fig in figures:
        (out / fig.name).write_bytes(fig.png)
    (out / REPORT_HTML).write_text(render_html(summary, figures, run), encoding="utf-8")
    return summary
