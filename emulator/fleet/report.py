"""What a fleet run looked like: its summary, the plots of the paper's operational profile
(section 9 and appendix A, Fig. 5-9, Table 1), and one self-contained HTML page.

The figures follow the paper's: devices available / checking in / participating over the day
(Fig. 5-6), round completions and durations (Fig. 5, 6 and 8), how the devices of a round ended up
(Fig. 7; an abandoned round published nothing and is drawn as a mark at its selected devices,
over the reports it had summed, in grey: under Secure Aggregation its completed groups' masked inputs),
drop-out by hour of day (Fig. 7's day/night contrast), traffic down and up per hour (Fig. 9) and
per round, session shapes (Table 1), the model's accuracy and loss against simulated hours and
against committed rounds, and per-client accuracy percentiles when the summary has them. Axes span
the data (an hour-of-day axis only the hours the run reached, captions naming empty hours), counts
of rounds and devices get whole-number ticks, and every rate in the summary table carries a
sentence from the run's figures (:func:`explain_rates`): what it measures, and when it is low what
to change.

:func:`summarize` is pure; :func:`write_report` is the shell that writes files. Everything written
is a function of the run alone (no dates, no host names, PNGs without a Software tag), so the same
run gives the same bytes.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import statistics
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_runtime.opstats import SHAPE_SYMBOLS
from server_stub.errors import install_hint

# the headline figures live in the leaf module .summary (FleetRun.summary() computes them); the
# report draws them, and they stay importable from here
from .heap import collector_paused
from .summary import _start_hour_utc, ended, is_dropout, sample_hour, shape_counts, summarize
from .summary import availability_swing as availability_swing
from .summary import available_by_hour as available_by_hour
from .summary import cannot_fill as cannot_fill
from .summary import completion_note as completion_note
from .summary import time_to_target_accuracy_s as time_to_target_accuracy_s
from .tables import FleetRun, RoundRow

if TYPE_CHECKING:
    from .config import FleetConfig

#: Colours kept across figures: the paper's Fig. 6 draws participating devices blue, waiting purple.
_AVAILABLE = "#2ca02c"
_CHECKING_IN = "#8e44ad"
_PARTICIPATING = "#1f77b4"
_COMMITTED = "#2ca02c"
_ABANDONED = "#d62728"
_LATE = "#ff7f0e"
_DOWN = "#1f77b4"
_UP = "#ff7f0e"
#: An abandoned round (nothing published): a dark x, apart from the outcome colours.
_ABANDONED_ROUND = "#444444"
#: The reports an abandoned round summed and did not publish (a completed Secure Aggregation group's).
_ABANDONED_SUMMED = "#bbbbbb"

SUMMARY_JSON = "summary.json"
REPORT_HTML = "report.html"
#: The fleet config the run ran, as ``fedfleet simulate`` takes it (:func:`write_config`).
CONFIG_TOML = "config.toml"
#: The first line of a run's ``config.toml``: what tells it from a config file of the user's own.
CONFIG_HEADER = "# The fleet config of the run in this folder"
#: Every plot a report may draw (a run draws some of them: privacy.png only with DP, ...).
FIGURE_FILES = (
    "devices.png",
    "rounds.png",
    "dropout.png",
    "shapes.png",
    "traffic.png",
    "accuracy.png",
    "privacy.png",
    "bytes.png",
    "client_accuracy.png",
    "durations.png",
)


def clear_run(out_dir: str | os.PathLike, *, server_left: bool = False) -> str | None:
    """Remove what an earlier run wrote in ``out_dir`` (its tables, summary, plots and report; other
    files stay), as a run starts there: else a run stopped before its summary left the earlier run's
    ``summary.json`` beside its own tables, which ``fedfleet compare`` read as one run, and a run
    without DP the earlier one's ``privacy.png``. Returns the line that says what this run replaced,
    None when nothing (``server_left``: the folder held an earlier run's server database, which the
    simulator replaced): a run started again after one was killed starts over, and said nothing."""
    from .tables import ROUNDS_CSV, SESSIONS_CSV, TIMELINE_CSV

    removed = []
    for name in (SESSIONS_CSV, ROUNDS_CSV, TIMELINE_CSV, SUMMARY_JSON, REPORT_HTML, *FIGURE_FILES):
        path = Path(out_dir) / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(name)
    if SUMMARY_JSON in removed:
        what = "an earlier run's tables, summary.json and report"
    elif removed:
        what = "the tables of an earlier run stopped before its end"
    elif server_left:
        what = "the server database of an earlier run stopped before its end"
    else:
        return None
    return f"{os.fspath(out_dir)} held {what}: this run starts over and replaces them (a run does not resume)"


def earlier_server(out_dir: str | os.PathLike | None) -> bool:
    """Whether ``out_dir`` holds an earlier run's server database (``out_dir/server``), which a run
    there replaces as it starts."""
    return out_dir is not None and (Path(out_dir) / "server" / "server.db").exists()


#: The keys of a fleet config that name files: a run's ``config.toml`` holds them absolute, so that
#: the folder reruns from anywhere (``FleetConfig.load`` reads a relative one against its own folder).
_PATH_KEYS = (("availability", "trace"), ("task", "file"), ("data", "path"))


def write_config(config: FleetConfig, out_dir: str | os.PathLike) -> None:
    """``config.toml`` in ``out_dir``: the config the run ran (its file with the command line's
    options applied, a sweep's run with its own values), only the keys that were set, so that
    ``fedfleet simulate out_dir/config.toml`` runs the same fleet to the same digest (with the
    versions the summary's ``versions`` names)."""
    data = config.dump()
    options = data.get("data", {}).get("options")
    places = [(data.get(section), key) for section, key in _PATH_KEYS] + [(options, "test"), (options, "vocab")]
    for table, key in places:
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(table, dict) and isinstance(value, str) and not Path(value).expanduser().is_absolute():
            table[key] = str(Path(value).expanduser().resolve())  # as the run read it: from the working folder
    from .config import _to_toml

    text = (
        f"{CONFIG_HEADER}: its config file with the command line's options (a sweep's: this run's values)\n"
        "# applied. fedfleet simulate config.toml runs it again, to the digest of its summary.json, with the\n"
        "# releases its versions name.\n\n"
    )
    Path(out_dir, CONFIG_TOML).write_text(text + _to_toml(data).lstrip("\n"), encoding="utf-8")


class FleetReportError(RuntimeError):
    """The report cannot be drawn here (its plotting library is missing)."""


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One plot of the report: its file name, caption, and PNG bytes; ``drawn`` is the matplotlib
    figure they were rendered from (its axes say what is drawn, for checks that read no pixels)."""

    name: str
    caption: str
    png: bytes
    drawn: Any = field(default=None, compare=False, repr=False)


#: The space kept around and between the plots' parts, as constrained layout keeps it (3 points).
_PAD_IN = 3.0 / 72.0
#: Where the plot area of a figure starts before :func:`_fit` measures what surrounds it (figure fractions).
_FIRST_GUESS = {"left": 0.07, "right": 0.75, "top": 0.95, "bottom": 0.07, "hspace": 0.3}


def _new_figure(rows: int = 1, height: float = 4.0) -> tuple[Any, list[Any]]:
    try:
        # no pyplot: no global state, no GUI backend
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure
    except ModuleNotFoundError:
        raise FleetReportError(
            f"the fleet report's plots need matplotlib; install it with {install_hint('sim')}"
        ) from None

    fig = MplFigure(figsize=(9.0, height * rows), dpi=100)
    FigureCanvasAgg(fig)  # one renderer measures the figure for _fit and draws its PNG
    fig.subplots_adjust(**_FIRST_GUESS)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0].tolist()
    for ax in axes:
        # The title sits just above the plot, not placed again at every draw (matplotlib moves it
        # only past ticks or a label on top, which no figure here has, or past an offset text:
        # _raise_title)
        ax.set_title("", y=1.0)
    return fig, axes


def _extents(fig: Any, renderer: Any) -> tuple[float, float, list[tuple[float, float]]]:
    """How far, in pixels, what surrounds the plot areas reaches past them: left and right (the most
    of any row; a figure's own legend, at its upper right, counted beside the rows' right edges) and,
    for each row, above and below. The spines are left out: they lie on the plot area's edge, their
    ticks within the tick labels, and measuring each one works out its axis's ticks once more."""
    from matplotlib.spines import Spine

    left = right = 0.0
    rows: dict[int, list[Any]] = {}
    for ax in fig.axes:  # twin axes (loss on the right) share their row's plot area
        rows.setdefault(ax.get_subplotspec().rowspan.start, []).append(ax)
    extents = []
    for _, row in sorted(rows.items()):
        above = below = 0.0
        for ax in row:
            others = [a for a in ax.get_default_bbox_extra_artists() if not isinstance(a, Spine)]
            box = ax.get_tightbbox(renderer, bbox_extra_artists=others, for_layout_only=True)
            area = ax.get_window_extent()
            left, right = max(left, area.x0 - box.x0), max(right, box.x1 - area.x1)
            above, below = max(above, box.y1 - area.y1 + _raise_title(ax, row, renderer)), max(below, area.y0 - box.y0)
        extents.append((above, below))
    beside = max((fig.bbox.x1 - legend.get_window_extent(renderer).x0 for legend in fig.legends), default=0.0)
    right += beside  # the legend keeps its own distance to the figure's edge
    return left, right, extents


def _raise_title(ax: Any, row: list[Any], renderer: Any) -> float:
    """Lift ``ax``'s title above an offset text of the row's y axes ("1e7", "+2.3" over the axis)
    that it would touch, as matplotlib's own title placement does (which :func:`_new_figure` turns
    off: it worked out every y axis's ticks again at each draw); return by how many pixels."""
    import matplotlib as mpl

    title = ax.title
    box = title.get_window_extent(renderer)
    tops = [
        t.y1
        for a in row
        if a.yaxis.offsetText.get_visible() and a.yaxis.offsetText.get_text()
        for t in [a.yaxis.offsetText.get_window_extent(renderer)]
        if t.x0 < box.x1 and box.x0 < t.x1
    ]
    lift = max(tops, default=box.y0) - box.y0
    if title.get_text() and lift > 0:
        ax.set_title(title.get_text(), pad=mpl.rcParams["axes.titlepad"] + lift * 72.0 / ax.figure.dpi)
        return lift
    return 0.0


def _fit(fig: Any) -> None:
    """Size the plot areas so that ticks, labels, titles and legends fit in the figure with
    :data:`_PAD_IN` to spare, the areas of all rows as wide and as tall as each other (what
    constrained layout does for these one-column figures, measured once rather than solved for).
    When the new size changes an axis's ticks (and with them its labels' widths), it is measured
    again. The axis labels then stay where the measure put them (:func:`_label_pins`)."""
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    pad = _PAD_IN * fig.dpi
    for _ in range(2):
        ticks = [list(axis.get_majorticklocs()) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]
        left, right, rows = _extents(fig, renderer)
        pins = _label_pins(fig)
        gap = max((rows[i][1] + rows[i + 1][0] for i in range(len(rows) - 1)), default=0.0) + 2 * pad
        area = height - rows[0][0] - rows[-1][1] - 2 * pad
        tall = (area - gap * (len(rows) - 1)) / len(rows)
        fig.subplots_adjust(
            left=(left + pad) / width,
            right=1.0 - (right + pad) / width,
            top=1.0 - (rows[0][0] + pad) / height,
            bottom=(rows[-1][1] + pad) / height,
            hspace=gap / tall,
        )
        if ticks == [list(axis.get_majorticklocs()) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)]:
            break
    for axis, x, y, shift in pins:
        axis.set_label_coords(x, y, transform=axis.axes.transAxes + shift)


def _label_pins(fig: Any) -> list[tuple[Any, float, float, Any]]:
    """Each axis label where matplotlib placed it when the figure was measured (past the tick
    labels), as a position on the plot area and a shift in pixels from its edge, for
    ``set_label_coords``: the shift holds when the area moves, and matplotlib, which placed the
    labels again at every draw by measuring every tick label once more, leaves them there."""
    from matplotlib.transforms import Affine2D

    pins = []
    for ax in fig.axes:
        area = ax.get_window_extent()
        (along_x, x_label_y), (y_label_x, along_y) = ax.xaxis.label.get_position(), ax.yaxis.label.get_position()
        top, right = ax.xaxis.get_label_position() == "top", ax.yaxis.get_label_position() == "right"
        pins.append((ax.xaxis, along_x, float(top), Affine2D().translate(0.0, x_label_y - area.y0 - top * area.height)))
        pins.append(
            (ax.yaxis, float(right), along_y, Affine2D().translate(y_label_x - area.x0 - right * area.width, 0.0))
        )
    return pins


def _png(fig: Any) -> bytes:
    """The figure laid out by :func:`_fit`, drawn once, as a PNG (:func:`_png_rgb`)."""
    import numpy as np

    _fit(fig)
    fig.canvas.draw()
    return _png_rgb(np.asarray(fig.canvas.buffer_rgba()))


def _png_rgb(rgba: Any) -> bytes:
    """An opaque image (an RGBA array, rows from the top) as an 8-bit RGB PNG: no alpha channel of
    255s to compress, every row stored as its difference from the row above (PNG's "Up" filter:
    mostly zeros in a plot's flat areas) and deflated at zlib's level 3. These plots come out within
    2% of the size of matplotlib's RGBA PNGs (deflated at level 6), in a third of the time. Nothing
    but the pixels (no Software tag naming a library's version): the same run gives the same bytes."""
    import numpy as np

    height, width = rgba.shape[:2]
    rgb = np.empty((height, width, 3), np.uint8)
    for channel in range(3):  # a channel at a time: numpy copied the 3 of 4 bytes of each pixel 5x slower
        rgb[..., channel] = rgba[..., channel]
    rgb = rgb.reshape(height, 3 * width)
    rows = np.empty((height, 1 + 3 * width), np.uint8)
    rows[:, 0] = 2  # the filter of each row: Up
    rows[0, 1:] = rgb[0]
    np.subtract(rgb[1:], rgb[:-1], out=rows[1:, 1:])  # modulo 256, as PNG's filter

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.data, 3))
        + chunk(b"IEND", b"")
    )


def _legend(ax: Any) -> None:
    """Beside the plot, where it hides no data (:func:`_fit` makes room)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes, color="0.4")


def _hours_axis(ax: Any, span_s: float | None = None) -> None:
    """Simulated hours on x, from the start to the end of the run (no margin past the data)."""
    ax.set_xlabel("simulated time (hours since the start)")
    ax.grid(True, alpha=0.3)
    if span_s is not None and span_s > 0:
        ax.set_xlim(0.0, span_s / 3600.0)


def _integer_ticks(axis: Any) -> None:
    """Ticks only at whole numbers: rounds and devices come in ones (no round 1.25)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def hour_arc(hours: Iterable[int]) -> list[int]:
    """The hours of day (0-23) an hour-of-day axis spans: the shortest run of consecutive hours,
    wrapping past midnight, that holds every hour in ``hours`` (``[22, 23, 0, 1]`` for a run from
    22:00 to 02:00); empty without hours. A run that covers every hour gets 0-23."""
    present = sorted({int(h) % 24 for h in hours})
    if not present:
        return []
    if len(present) == 24:
        return list(range(24))
    # the arc starts after the widest gap between hours with data (going round the clock)
    gaps = [((present[(i + 1) % len(present)] - h) % 24 or 24, i) for i, h in enumerate(present)]
    _, widest = max(gaps)
    start = present[(widest + 1) % len(present)]
    end = present[widest]
    length = (end - start) % 24 + 1
    return [(start + k) % 24 for k in range(length)]


def _hour_of_day_axis(ax: Any, arc: list[int]) -> None:
    """x positions 0..len(arc)-1 labelled with the hours of ``arc``, the axis no wider than it."""
    step = 1 if len(arc) <= 12 else 2
    ax.set_xticks(range(0, len(arc), step))
    ax.set_xticklabels([str(arc[i]) for i in range(0, len(arc), step)])
    ax.set_xlim(-0.5, len(arc) - 0.5)


def _hour_list(hours: list[int]) -> str:
    """``[3, 4, 5, 9]`` as "3-5 and 9"."""
    spans: list[list[int]] = []
    for h in hours:
        if spans and h == spans[-1][-1] + 1:
            spans[-1].append(h)
        else:
            spans.append([h])
    parts = [f"{s[0]}" if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _per_hour(times_s: list[float], weights: list[float], span_s: float) -> tuple[list[float], list[float]]:
    """(bin edges in hours, sums of ``weights`` per simulated hour since the start), for ``stairs``."""
    bins = max(1, math.ceil(span_s / 3600.0))
    sums = [0.0] * bins
    for t, w in zip(times_s, weights):
        sums[min(bins - 1, max(0, int(t // 3600.0)))] += w
    return [float(i) for i in range(bins + 1)], sums


def _clock(hour: float) -> str:
    """An hour of the day as a clock reads it: 8.0 is '8:00', 13.5 is '13:30', -1 is '23:00'."""
    minutes = round((hour % 24.0) * 60.0) % 1440
    return f"{minutes // 60}:{minutes % 60:02d}"


def _zone(offset_h: float) -> str:
    return "UTC" + ("-" if offset_h < 0 else "+") + _clock(abs(offset_h)).removesuffix(":00")


def _local_hours(run: FleetRun, hourly: Mapping[int, float]) -> str:
    """The devices figure's hours are UTC; the paper's (Fig. 5, sec. 9) are the devices' own. A
    sentence turning the busiest and quietest hours of available devices into the local time of the
    fleet's time zones (``availability.time_zones``), empty without a config, with a replayed trace
    (its own clock) or with fewer than two hours."""
    config = run.config
    if config is None or config.availability.trace is not None or len(hourly) < 2:
        return ""
    offsets = sorted({zone.utc_offset_h for zone in config.availability.time_zones})
    busiest, quietest = max(hourly, key=hourly.__getitem__), min(hourly, key=hourly.__getitem__)

    def local(hour: int) -> str:
        if len(offsets) == 1:
            return f"{_clock(hour + offsets[0])} ({_zone(offsets[0])})"
        return (
            f"{_clock(hour + offsets[0])} ({_zone(offsets[0])}) to {_clock(hour + offsets[-1])} ({_zone(offsets[-1])})"
        )

    return (
        " Hours are UTC; on the devices' own clocks (availability.time_zones) the busiest hour of available"
        f" devices, {busiest}:00 UTC, is {local(busiest)}, and the quietest, {quietest}:00 UTC, {local(quietest)}."
    )


def plot_devices(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
    """Devices available / checking in / participating over time and by hour of day (Fig. 5-6)."""
    fig, (ax_t, ax_h) = _new_figure(2)
    tl = run.timeline
    caption = (
        "Devices available, checking in and participating (paper, Fig. 5-6). Participating: devices seated in a"
        " round and not yet done with their session, including those still training or reporting for a round"
        " that has closed (the server refuses their late report), so the line can stay above 0 between rounds."
    )
    if tl:
        t = [r.t_s / 3600.0 for r in tl]
        ax_t.plot(t, [r.available for r in tl], color=_AVAILABLE, label="available")
        ax_t.plot(t, [r.checking_in for r in tl], color=_CHECKING_IN, label="checking in / waiting")
        ax_t.plot(t, [r.participating for r in tl], color=_PARTICIPATING, label="participating")
        _legend(ax_t)
        start_h = _start_hour_utc(run)
        arc = hour_arc(sample_hour(r.t_s, start_h, run.span_s) for r in tl)
        position = {h: i for i, h in enumerate(arc)}
        for name, colour, label in (
            ("available", _AVAILABLE, "available"),
            ("checking_in", _CHECKING_IN, "checking in / waiting"),
            ("participating", _PARTICIPATING, "participating"),
        ):
            groups: dict[int, list[int]] = {}
            for r in tl:
                groups.setdefault(sample_hour(r.t_s, start_h, run.span_s), []).append(getattr(r, name))
            hours = sorted(groups, key=position.__getitem__)
            means = [statistics.fmean(groups[h]) for h in hours]
            ax_h.plot([position[h] for h in hours], means, marker="o", color=colour, label=label)
        _hour_of_day_axis(ax_h, arc)
        _legend(ax_h)
        if len(arc) < 24:
            caption += (
                f" The hour-of-day axis spans the UTC hours the run covers, {arc[0]}:00 to {arc[-1]}:59"
                f" ({len(arc)} of 24: the run is {_hours(run.span_s, 'simulated ')} long)."
            )
        caption += _local_hours(run, available_by_hour(tl, start_h, run.span_s))
    else:
        _no_data(ax_t, "timeline")
        _no_data(ax_h, "timeline")
    ax_t.set_title("Devices over time")
    ax_t.set_ylabel("devices")
    _hours_axis(ax_t, run.span_s)
    ax_h.set_title("Devices by hour of day (mean over the run)")
    ax_h.set_xlabel("hour of day (UTC)")
    ax_h.set_ylabel("devices")
    ax_h.grid(True, alpha=0.3)
    for ax in (ax_t, ax_h):
        _integer_ticks(ax.yaxis)
    return Figure("devices.png", caption, _png(fig), fig)


def plot_rounds(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
    """Round completions per hour and round durations over time (Fig. 6 bottom, Fig. 8)."""
    fig, (ax_r, ax_d) = _new_figure(2)
    rounds = run.rounds
    if rounds:
        span = run.span_s
        for closed, colour, label in (
            ([r for r in rounds if r.committed], _COMMITTED, "committed"),
            ([r for r in rounds if r.abandoned], _ABANDONED, "abandoned"),
        ):
            ends = [r.end_s for r in closed]
            edges, per_hour = _per_hour(ends, [1.0] * len(ends), span)
            ax_r.stairs(per_hour, edges, color=colour, linewidth=1.5, label=label)
            ax_d.scatter(
                [r.start_s / 3600.0 for r in closed],
                [r.duration_s / 60.0 for r in closed],
                s=14,
                alpha=0.7,
                linewidths=0,
                color=colour,
                label=label,
            )
        open_ = [r for r in rounds if r.unfinished]  # no completion to count; its duration so far
        if open_:
            ax_d.scatter(
                [r.start_s / 3600.0 for r in open_],
                [r.duration_s / 60.0 for r in open_],
                s=18,
                marker="o",
                facecolors="none",
                edgecolors=_ABANDONED_ROUND,
                label="unfinished (open at the end)",
            )
        _legend(ax_r)
        _legend(ax_d)
    else:
        _no_data(ax_r, "rounds")
        _no_data(ax_d, "rounds")
    ax_r.set_title("Rounds per hour")
    ax_r.set_ylabel("rounds")
    _integer_ticks(ax_r.yaxis)
    _hours_axis(ax_r, run.span_s)
    ax_d.set_title("Round duration")
    ax_d.set_ylabel("minutes")
    _hours_axis(ax_d, run.span_s)
    caption = "Round completions per hour and round durations (paper, Fig. 5, 6 and 8)."
    if any(r.unfinished for r in rounds):
        caption += (
            " A hollow circle is the round still open when the run ended: it completed neither way, and its"
            " duration runs from its first seated check-in to the end of the run."
        )
    return Figure("rounds.png", caption, _png(fig), fig)


def round_outcomes(rounds: list[RoundRow]) -> dict[str, list[int]]:
    """What each round's selected devices did, as the outcome chart stacks it: ``aggregated``,
    ``rejected`` (reported after the window) and ``dropped`` per round, all zero for an abandoned
    round, which published nothing and is drawn as one mark at ``abandoned_selected`` instead
    (its selected devices; 0 for a committed round) over ``abandoned_summed``, the reports it took
    and summed all the same (its ``accepted``: under Secure Aggregation the masked inputs of its
    groups that completed, which the server unmasked), and for the round still open when the run
    ended (outcome unfinished), drawn as one mark at ``unfinished_selected``."""
    out: dict[str, list[int]] = {
        "aggregated": [],
        "rejected": [],
        "dropped": [],
        "abandoned_selected": [],
        "abandoned_summed": [],
        "unfinished_selected": [],
    }
    for r in rounds:
        out["aggregated"].append(r.accepted if r.committed else 0)
        out["rejected"].append(max(0, r.reported - r.accepted) if r.committed else 0)
        out["dropped"].append(r.dropped if r.committed else 0)
        out["abandoned_selected"].append(r.selected if r.abandoned else 0)
        out["abandoned_summed"].append(r.accepted if r.abandoned else 0)
        out["unfinished_selected"].append(r.selected if r.unfinished else 0)
    return out


#: The most steps a per-round line draws: past it (a run of days with rounds every few minutes) a
#: step per round is narrower than a pixel and two lines fill the axes as a solid band, so each step
#: is the mean of as many consecutive rounds as keep the steps within it.
MAX_ROUND_STEPS = 300


def round_bins(count: int) -> list[range]:
    """Rounds 1 to ``count`` in consecutive groups, at most ``MAX_ROUND_STEPS`` of them and all of one
    size but the last (one round each when they fit)."""
    size = max(1, math.ceil(count / MAX_ROUND_STEPS))
    return [range(start, min(start + size, count + 1)) for start in range(1, count + 1, size)]


def plot_dropout(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
    """How each round's selected devices ended (Fig. 7; past ``MAX_ROUND_STEPS`` rounds, the means of
    groups of consecutive rounds, ``round_bins``) and drop-out by local hour of day."""
    fig, (ax_o, ax_h) = _new_figure(2)
    rounds = run.rounds
    caption = (
        "Outcomes of each committed round's selected devices and drop-out by hour (paper, Fig. 7). "
        "An abandoned round published nothing: it is an x at the number of devices it selected, over the "
        "reports it had summed in grey (under Secure Aggregation, the masked inputs of its groups that completed)."
    )
    if any(r.unfinished for r in rounds):
        caption += (
            " The round still open when the run ended (outcome unfinished) is a hollow circle at the number"
            " of devices it had selected."
        )
    if rounds:
        outcomes = round_outcomes(rounds)
        # Stacked steps, not bars: a polygon per outcome whatever the number of rounds (a day of a
        # large fleet has thousands, and a bar each took matplotlib seconds).
        # round i spans [i - 0.5, i + 0.5]; past MAX_ROUND_STEPS rounds a step is a group's mean
        bins = round_bins(len(rounds))
        edges = [b[0] - 0.5 for b in bins] + [len(rounds) + 0.5]
        per = "" if len(bins) == len(rounds) else f" (mean of {len(bins[0])} rounds)"
        bottom: list[float] = [0.0] * len(bins)
        for key, colour, label in (
            ("aggregated", _COMMITTED, "reported, aggregated"),
            ("rejected", _LATE, "reported, rejected (late)"),
            ("dropped", _ABANDONED, "dropped out"),
            ("abandoned_summed", _ABANDONED_SUMMED, "reported, summed, round abandoned"),
        ):
            if key == "abandoned_summed" and not any(outcomes[key]):
                continue  # no abandoned round had summed reports: no grey in the legend
            counts = [statistics.fmean(outcomes[key][i - 1] for i in b) for b in bins]
            top = [b + c for b, c in zip(bottom, counts)]
            ax_o.fill_between(
                edges, bottom + bottom[-1:], top + top[-1:], step="post", color=colour, linewidth=0, label=label + per
            )
            bottom = top
        if per:
            caption += (
                f" With {len(rounds):,} rounds, each step of the outcomes is the mean of {len(bins[0])} consecutive rounds"
                " (rounds.csv has each); the marks are each round's own."
            )
        abandoned = [
            (i, n) for i, (r, n) in enumerate(zip(rounds, outcomes["abandoned_selected"]), start=1) if r.abandoned
        ]
        still_open = [
            (i, n) for i, (r, n) in enumerate(zip(rounds, outcomes["unfinished_selected"]), start=1) if r.unfinished
        ]
        if still_open:
            ax_o.scatter(
                [i for i, _ in still_open],
                [n for _, n in still_open],
                marker="o",
                facecolors="none",
                edgecolors=_ABANDONED_ROUND,
                s=24,
                zorder=3,
                label="unfinished round: devices selected, open at the run's end",
            )
        if abandoned:
            ax_o.scatter(
                [i for i, _ in abandoned],
                [n for _, n in abandoned],
                marker="x",
                color=_ABANDONED_ROUND,
                linewidths=1.2,
                s=24,
                zorder=3,
                label="abandoned round: devices selected, nothing published",
            )
        ax_o.set_xlim(edges[0], edges[-1])
        ax_o.set_ylim(bottom=0)
        _legend(ax_o)
    else:
        _no_data(ax_o, "rounds")
    ax_o.set_title("Selected devices per round, by outcome")
    ax_o.set_xlabel("round")
    ax_o.set_ylabel("devices")
    _integer_ticks(ax_o.xaxis)
    _integer_ticks(ax_o.yaxis)
    ax_o.grid(True, alpha=0.3)
    accepted_s = [s for s in run.sessions if ended(s)]  # a session the run's end cut is neither
    if accepted_s:
        by_hour: dict[int, list[bool]] = {}
        for s in accepted_s:
            by_hour.setdefault(int(s.local_hour) % 24, []).append(is_dropout(s))
        arc = hour_arc(by_hour)
        position = {h: i for i, h in enumerate(arc)}
        hours = [h for h in arc if h in by_hour]
        bars = ax_h.bar(
            [position[h] for h in hours], [100.0 * statistics.fmean(by_hour[h]) for h in hours], color=_ABANDONED
        )
        ax_h.bar_label(bars, labels=[f"{len(by_hour[h])}" for h in hours], fontsize=7, color="0.35", padding=2)
        overall = 100.0 * statistics.fmean(is_dropout(s) for s in accepted_s)
        ax_h.axhline(overall, color="0.3", linestyle="--", label=f"whole run {overall:.1f}%")
        _hour_of_day_axis(ax_h, arc)
        ax_h.margins(y=0.12)
        _legend(ax_h)
        caption += (
            " Above each bar, the accepted sessions that started in that hour of the devices' own day"
            " (a bar of few sessions is noisy)."
        )
        if len(arc) < 24:
            caption += (
                f" The axis spans local hours {arc[0]} to {arc[-1]}, the hours in which sessions started:"
                f" a run of {_hours(run.span_s, 'simulated ')} reaches only those hours of the devices' days."
            )
        empty = [h for h in arc if h not in by_hour]
        if empty:
            caption += f" No session started in local hour {_hour_list(empty)}, so there is no bar there."
    else:
        _no_data(ax_h, "sessions")
        ax_h.set_xticks([])
    ax_h.set_title("Drop-out rate by the device's local hour of day")
    ax_h.set_xlabel("local hour of day")
    ax_h.set_ylabel("drop-out (% of accepted sessions)")
    ax_h.grid(True, alpha=0.3)
    return Figure("dropout.png", caption, _png(fig), fig)


def plot_shapes(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
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
    _integer_ticks(ax.xaxis)
    ax.grid(True, axis="x", alpha=0.3)
    return Figure("shapes.png", "Session shapes of accepted check-ins (paper, Table 1).", _png(fig), fig)


def plot_traffic(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
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
    _hours_axis(ax, run.span_s)
    return Figure("traffic.png", "Bytes down and up per hour (paper, Fig. 9).", _png(fig), fig)


def accuracy_series(rounds: list[RoundRow]) -> dict[str, list[tuple[float, float]]]:
    """The committed model's quality as the report draws it: ``accuracy`` and ``loss`` against
    simulated hours (each committed round's end) and against committed rounds (1, 2, ...: the
    model's version), for the rounds that measured them."""
    committed = [r for r in rounds if r.committed]
    out: dict[str, list[tuple[float, float]]] = {}
    for metric in ("accuracy", "loss"):
        measured = [(i, r) for i, r in enumerate(committed, start=1) if math.isfinite(getattr(r, metric))]
        out[f"{metric}_by_hour"] = [(r.end_s / 3600.0, float(getattr(r, metric))) for _, r in measured]
        out[f"{metric}_by_round"] = [(float(i), float(getattr(r, metric))) for i, r in measured]
    return out


def _quality_axes(ax: Any, series: dict[str, list[tuple[float, float]]], by: str) -> list[Any]:
    """Accuracy on ``ax`` and loss on a twin axis to its right; the lines drawn."""
    lines = []
    acc, loss = series[f"accuracy_{by}"], series[f"loss_{by}"]
    if acc:
        lines += ax.plot([x for x, _ in acc], [a for _, a in acc], marker=".", color=_PARTICIPATING, label="accuracy")
        ax.set_ylabel("accuracy")
    if loss:
        ax_l = ax.twinx()  # loss on its own scale, to the right
        lines += ax_l.plot([x for x, _ in loss], [v for _, v in loss], color=_LATE, label="loss")
        ax_l.set_ylabel("loss")
    return lines


def plot_accuracy(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
    """The committed model's accuracy and loss against simulated hours and against rounds; with
    the summary's ``time_to_target_accuracy_s``, where the target was first reached."""
    fig, (ax_t, ax_r) = _new_figure(2)
    series = accuracy_series(run.rounds)
    caption = (
        "Model accuracy and loss of each committed round's model, against simulated hours and against committed rounds."
    )
    if series["accuracy_by_round"] or series["loss_by_round"]:
        lines = _quality_axes(ax_t, series, "by_hour")
        _quality_axes(ax_r, series, "by_round")
        reached = (summary or {}).get("time_to_target_accuracy_s")
        target = (summary or {}).get("target_accuracy")
        if isinstance(target, (int, float)) and series["accuracy_by_hour"]:
            lines.append(ax_t.axhline(float(target), color="0.4", linestyle=":", label=f"target {target:g}"))
        if isinstance(reached, (int, float)) and math.isfinite(reached):
            lines.append(
                ax_t.axvline(
                    reached / 3600.0,
                    color=_COMMITTED,
                    linestyle="--",
                    label=f"target reached at {reached / 3600.0:.2f} h",
                )
            )
            caption += (
                f" The dashed line marks the first committed model at the target accuracy ({reached / 3600.0:.2f} h)."
            )
        elif summary is not None and "time_to_target_accuracy_s" in summary and not no_target(summary):
            caption += " No committed model reached the target accuracy."
        fig.legend(handles=lines, loc="upper right", fontsize="small")  # _fit keeps room for it
    else:
        _no_data(ax_t, "measured rounds")
        _no_data(ax_r, "measured rounds")
    ax_t.set_title("Model quality over simulated time")
    _hours_axis(ax_t, run.span_s)
    ax_r.set_title("Model quality over committed rounds")
    ax_r.set_xlabel("committed round")
    _integer_ticks(ax_r.xaxis)
    ax_r.grid(True, alpha=0.3)
    return Figure("accuracy.png", caption, _png(fig), fig)


def privacy_series(rounds: list[RoundRow]) -> dict[str, list[tuple[float, float]]]:
    """A DP run's privacy as the report draws it: each committed round's model's ``accuracy``
    against the task's epsilon after that round, and ``epsilon`` against committed rounds (finite
    values only: a run without noise has no finite epsilon to draw)."""
    committed = [r for r in rounds if r.committed]
    return {
        "accuracy_by_epsilon": [
            (float(r.epsilon), float(r.accuracy))
            for r in committed
            if math.isfinite(r.epsilon) and math.isfinite(r.accuracy)
        ],
        "epsilon_by_round": [
            (float(i), float(r.epsilon)) for i, r in enumerate(committed, 1) if math.isfinite(r.epsilon)
        ],
    }


def plot_privacy(run: FleetRun, summary: Mapping[str, Any]) -> Figure | None:
    """Accuracy against epsilon (what each committed model cost in privacy) and epsilon against
    committed rounds; ``None`` for a run without DP (the summary's ``delta`` is null)."""
    if summary.get("delta") is None:
        return None
    series = privacy_series(run.rounds)
    fig, (ax_e, ax_r) = _new_figure(2)
    acc, eps = series["accuracy_by_epsilon"], series["epsilon_by_round"]
    if acc:
        ax_e.plot([e for e, _ in acc], [a for _, a in acc], marker=".", color=_PARTICIPATING)
        ax_e.set_ylabel("accuracy")
    else:
        _no_data(ax_e, "rounds with a finite epsilon and a measured accuracy")
    ax_e.set_xlabel(f"epsilon (delta = {summary['delta']:g})")
    ax_e.set_title("Model accuracy against the privacy spent")
    ax_e.grid(True, alpha=0.3)
    if eps:
        ax_r.plot([i for i, _ in eps], [e for _, e in eps], marker=".", color=_COMMITTED)
    else:
        _no_data(ax_r, "rounds with a finite epsilon")
    ax_r.set_title("Epsilon over committed rounds")
    ax_r.set_xlabel("committed round")
    ax_r.set_ylabel("epsilon")
    _integer_ticks(ax_r.xaxis)
    ax_r.grid(True, alpha=0.3)
    z = summary.get("noise_multiplier")
    caption = (
        "Each committed model's accuracy against the task's epsilon after its round (the accountant's, at the "
        f"run's delta, noise multiplier {_fmt(z)}, no amplification by sampling), and epsilon over committed rounds."
    )
    if z == 0:
        caption += " Without noise epsilon is unbounded: nothing to draw."
    return Figure("privacy.png", caption, _png(fig), fig)


def plot_bytes(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
    """Bytes down and up per round (from ``rounds.csv``'s byte columns: the sessions of each
    round's selected devices), abandoned rounds marked; past ``MAX_ROUND_STEPS`` rounds each step
    is the mean of a group of consecutive rounds (``round_bins``)."""
    fig, (ax,) = _new_figure(1)
    rounds = run.rounds
    caption = "Bytes down and up per round: what the sessions of each round's selected devices received and sent."
    if rounds:
        x = list(range(1, len(rounds) + 1))
        bins = round_bins(len(rounds))
        centres = [(b[0] + b[-1]) / 2.0 for b in bins]
        per = "" if len(bins) == len(rounds) else f", mean of {len(bins[0])} rounds"
        for side, color, label in (
            ("bytes_down", _DOWN, "down (server to devices)"),
            ("bytes_up", _UP, "up (devices to server)"),
        ):
            values = [statistics.fmean(getattr(rounds[i - 1], side) for i in b) / 1e6 for b in bins]
            ax.plot(centres, values, drawstyle="steps-mid", color=color, label=label + per)
        if per:
            caption += f" Each step is the mean of {len(bins[0])} consecutive rounds (of {len(rounds):,}; rounds.csv has each)."
        abandoned = [(i, r) for i, r in zip(x, rounds) if r.abandoned]
        if abandoned:
            ax.scatter(
                [i for i, _ in abandoned],
                [r.bytes_down / 1e6 for _, r in abandoned],
                marker="x",
                s=24,
                color=_ABANDONED_ROUND,
                zorder=3,
                label="abandoned round",
            )
        ax.set_xlim(0.5, len(rounds) + 0.5)
        ax.set_ylim(bottom=0)
        _legend(ax)
        committed = [r for r in rounds if r.committed and r.selected]
        if committed:
            per_device_down = statistics.median(r.bytes_down / r.selected for r in committed)
            per_device_up = statistics.median(r.bytes_up / r.selected for r in committed)
            caption += (
                f" A committed round's selected device received {per_device_down / 1e3:,.1f} kB and sent"
                f" {per_device_up / 1e3:,.1f} kB (medians)."
            )
        unattributed = sum(s.bytes_down + s.bytes_up for s in run.sessions) - sum(
            r.bytes_down + r.bytes_up for r in rounds
        )
        if unattributed > 0:
            caption += (
                f" Check-ins the server turned away carried {unattributed / 1e6:,.2f} MB that belong to no round."
            )
    else:
        _no_data(ax, "rounds")
    ax.set_title("Traffic per round")
    ax.set_xlabel("round")
    ax.set_ylabel("MB")
    _integer_ticks(ax.xaxis)
    ax.grid(True, alpha=0.3)
    return Figure("bytes.png", caption, _png(fig), fig)


def _percentile_marks(percentiles: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The ``pNN`` entries of a ``client_accuracy_percentiles`` mapping, by NN."""
    marks = []
    for key, value in percentiles.items():
        if (
            key[:1] == "p"
            and key[1:].replace(".", "", 1).isdigit()
            and isinstance(value, (int, float))
            and math.isfinite(value)
        ):
            marks.append((key, float(value)))
    return sorted(marks, key=lambda kv: float(kv[0][1:]))


def plot_client_accuracy(summary: Mapping[str, Any]) -> Figure | None:
    """Per-client accuracy of the last evaluation, as percentile marks over clients (LEAF, FedScale);
    ``None`` when the summary holds no ``client_accuracy_percentiles``."""
    percentiles = summary.get("client_accuracy_percentiles")
    if not isinstance(percentiles, Mapping):
        return None
    marks = _percentile_marks(percentiles)
    if not marks:
        return None
    fig, (ax,) = _new_figure(1, height=2.6)
    ax.plot([v for _, v in marks], [0] * len(marks), color="0.6", linewidth=6, solid_capstyle="butt", zorder=1)
    ax.scatter(
        [v for _, v in marks], [0] * len(marks), color=_PARTICIPATING, s=60, zorder=2, label="percentiles over clients"
    )
    for key, value in marks:
        ax.annotate(
            f"{key}\n{value:.3f}", (value, 0), textcoords="offset points", xytext=(0, 10), ha="center", fontsize=9
        )
    weighted = percentiles.get("accuracy")
    if isinstance(weighted, (int, float)) and math.isfinite(weighted):
        ax.axvline(float(weighted), color=_COMMITTED, linestyle="--", label=f"all clients' examples {weighted:.3f}")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(-1.0, 1.5)
    ax.set_yticks([])
    ax.set_xlabel("accuracy on the client's own test examples")
    ax.set_title("Per-client accuracy of the last evaluation")
    ax.grid(True, axis="x", alpha=0.3)
    _legend(ax)
    clients = percentiles.get("clients")
    who = f" over {clients:,} clients" if isinstance(clients, int) else ""
    caption = (
        f"Per-client accuracy{who}: the 10th percentile is the accuracy nine in ten clients reach; a wide"
        " spread means the model serves some clients' data poorly."
    )
    return Figure("client_accuracy.png", caption, _png(fig), fig)


def plot_durations(run: FleetRun, summary: Mapping[str, Any] | None = None) -> Figure:
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
            ax.hist(
                participation, bins=bins, weights=weights, color=_PARTICIPATING, alpha=0.6, label="device participation"
            )
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
    return Figure("durations.png", "Round run time and device participation time (paper, Fig. 8).", _png(fig), fig)


PLOTS: tuple[Callable[..., Figure], ...] = (
    plot_devices,
    plot_rounds,
    plot_dropout,
    plot_shapes,
    plot_traffic,
    plot_accuracy,
    plot_bytes,
    plot_durations,
)


def report_figures(run: FleetRun, summary: Mapping[str, Any]) -> list[Figure]:
    """Every figure of the report: :data:`PLOTS`, then those the summary has data for."""
    with collector_paused():
        figures = [plot(run, summary) for plot in PLOTS]
        extra = [plot_client_accuracy(summary), plot_privacy(run, summary)]
    return figures + [f for f in extra if f is not None]


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


def script_json(value: Any, **dumps: Any) -> str:
    """``value`` as JSON to put in a ``<script type="application/json">`` element: every '<', '>'
    and '&' is a JSON escape, so that no value can close the element or, with '<!--<script', turn
    the page's own '</script>' into text (escaping '</' alone left that open)."""
    text = json.dumps(value, **dumps)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


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
    ("sessions_unfinished", "accepted sessions still under way at the run's end"),
    ("checkins_rejected", "rejected check-ins"),
    ("errors", "sessions ended in an error, by kind"),
    ("reports_refused", "reports refused, by the server's code"),
    ("checkins_rejected_by", "check-ins turned away, by the server's reason"),
    ("sessions_interrupted", "sessions interrupted, by reason"),
    ("sessions_per_wall_s", "accepted sessions per wall second"),
    ("completed_sessions_per_wall_s", "completed sessions per wall second"),
    ("dropout_rate", "drop-out rate"),
    ("availability_swing", "availability swing (peak / trough)"),
    ("available_peak", "available devices, peak hour (mean)"),
    ("available_trough", "available devices, trough hour (mean)"),
    ("participating_peak", "participating devices, busiest hour (mean)"),
    ("participating_trough", "participating devices, quietest hour (mean)"),
    ("rounds", "rounds"),
    ("rounds_committed", "rounds committed"),
    ("rounds_abandoned", "rounds abandoned"),
    ("rounds_unfinished", "rounds still open at the run's end"),
    ("round_goal", "reports a round commits with at once (task.goal_count)"),
    ("round_reports_to_commit", "reports a round needs to commit once no more can come"),
    ("round_completion_rate", "round completion rate"),
    ("round_completion_note", "why (round completion)"),
    ("cannot_fill", "rounds that cannot fill"),
    ("round_duration_median_s", "median committed round duration (s)"),
    ("bytes_down", "bytes down"),
    ("bytes_up", "bytes up"),
    ("devices_short_of_memory", "devices short of the plan's memory (took no part)"),
    ("plan_cost", "plan cost per device"),
    ("accuracy", "accuracy (last measured committed round)"),
    ("loss", "loss (last measured committed round)"),
)

#: Summary rows that are rates or ratios: each gets a sentence saying what it measures, from the run's figures.
RATE_KEYS = (
    "sim_s_per_wall_s",
    "sessions_per_wall_s",
    "completed_sessions_per_wall_s",
    "dropout_rate",
    "availability_swing",
    "round_completion_rate",
)

#: Below this share of committed rounds the report says why rounds were abandoned and what to change.
LOW_COMPLETION = 0.9

#: Rows shown only when the summary holds them (other parts of the simulator add these keys).
_OPTIONAL_ROWS = (
    ("tasks_completed_s", "every task completed by (simulated s)"),
    ("target_accuracy", "target accuracy"),
    ("time_to_target_accuracy_s", "time to target accuracy (simulated s)"),
    ("client_accuracy_percentiles", "per-client accuracy (last evaluation)"),
    ("chance_accuracy", "accuracy at chance (always the test set's most frequent class)"),
    ("audit_epsilon", "audit: one-shot estimate of epsilon"),
    ("secure_groups", "Secure Aggregation groups (formed, completed, aborted by protocol round, inputs summed)"),
    ("versions", "made with (the digest depends on these releases)"),
)

#: Optional rows of a secure run only (null in a plain run's summary, and not shown in its report).
_SECURE_ROWS = ("secure_groups",)

#: A DP run's rows (its summary's ``delta`` is set; without DP these keys are null and not shown).
_DP_ROWS = (
    ("epsilon", "epsilon (the accountant's, after the last round that spent privacy)"),
    ("delta", "delta"),
    ("dp_rounds", "DP rounds spent"),
    ("noise_multiplier", "noise multiplier"),
)


def _hours(seconds: float, kind: str = "") -> str:
    """``seconds`` as hours in words: '1 simulated hour', '2.5 simulated hours'; under 18 s, which
    would round to '0 hours', as seconds: '0.36 simulated seconds'."""
    hours = round(seconds / 3600.0, 2)
    if hours == 0 and seconds > 0:
        return f"{seconds:.3g} {kind}second{'' if seconds == 1 else 's'}"
    return f"{hours:g} {kind}hour{'' if hours == 1 else 's'}"


def _completion_sentence(summary: Mapping[str, Any], rounds: list[RoundRow]) -> str:
    """What the round completion rate measures and, when it is low, why rounds were abandoned and what
    to change (the summary's ``round_completion_note``, see :func:`completion_note`)."""
    closed = [r for r in rounds if not r.unfinished]
    n, committed = len(closed), sum(1 for r in closed if r.committed)
    if not n:
        return "Share of the rounds that closed that committed a model; none closed: " + _unfinished_sentence(
            rounds, summary
        )
    rate = committed / n
    goal, needed = summary.get("round_goal"), summary.get("round_reports_to_commit")
    enough = (
        f"{goal} (task.goal_count), or {needed} once no more can come (task.goal_count x task.min_fraction, rounded up)"
        if goal is not None and needed is not None
        else "goal_count, or goal_count x min_fraction once no more can"
    )
    text = (
        f"{committed} of {n} rounds committed ({100.0 * rate:.1f}%): a round commits once enough of its selected devices"
        f" report in time ({enough}), and is abandoned otherwise."
    )
    if any(r.unfinished for r in rounds):
        text += " " + _unfinished_sentence(rounds, summary)
    if rate >= LOW_COMPLETION:
        return text
    note = summary.get("round_completion_note")
    if note:
        return f"{text} {note[0].upper()}{note[1:]}."
    return text + " See the rounds table for how many devices each selected and how many reported in time."


def _unfinished_sentence(rounds: list[RoundRow], summary: Mapping[str, Any]) -> str:
    """The rounds still open when the run ended, in a sentence: what they had when it did, and
    that the rate leaves them out."""
    still = [r for r in rounds if r.unfinished]
    needed = summary.get("round_reports_to_commit")
    of = f" of the {needed} a commit needs" if needed is not None else ""
    parts = ", ".join(
        f"{r.round_id} (open {r.duration_s / 60.0:.1f} min: {r.selected} selected, {r.accepted} reported in time{of})"
        for r in still
    )
    return (
        f"{'The round' if len(still) == 1 else f'The {len(still)} rounds'} {parts} {'was' if len(still) == 1 else 'were'}"
        " still open when the run ended: outcome unfinished in rounds.csv, neither committed nor abandoned, and"
        " not in the rate."
    )


def explain_rates(summary: Mapping[str, Any], rounds: list[RoundRow]) -> dict[str, str]:
    """One sentence (or a few) per rate of the summary: what it measures, with the run's figures, and
    when it is low or off, what to change. Keys: :data:`RATE_KEYS` and the optional rows present."""
    out: dict[str, str] = {}
    sim_s, wall_s = float(summary.get("simulated_s") or 0.0), float(summary.get("wall_s") or 0.0)
    speed = summary.get("sim_s_per_wall_s")
    out["sim_s_per_wall_s"] = (
        f"Simulated seconds per second of wall time: {_hours(sim_s, 'simulated ')} took {wall_s:.1f} s"
        f" ({speed:,.0f}x real time)."
        if speed is not None
        else "Simulated seconds per second of wall time (no wall time measured)."
    )
    if speed is not None and speed < 1.0:
        out["sim_s_per_wall_s"] += (
            " The run was slower than real time: fewer devices, fewer hours or --ray shards run faster."
        )
    out["sessions_per_wall_s"] = (
        "Sessions the simulator ran for devices selected into a round, per second of wall time:"
        " how fast the simulator runs, not a property of the fleet."
    )
    out["completed_sessions_per_wall_s"] = (
        "Sessions whose upload completed per second of wall time: the simulator's"
        " throughput, as the fleet_day benchmark reports it."
    )
    drop = summary.get("dropout_rate")
    if drop is None:
        out["dropout_rate"] = (
            "Share of accepted sessions that never got their report to the server; no session was accepted."
        )
    else:
        accepted = summary.get("sessions_accepted", 0)
        unfinished = summary.get("sessions_unfinished") or 0
        out["dropout_rate"] = (
            f"{100.0 * drop:.1f}% of the {accepted - unfinished:,} accepted sessions that ended never got their"
            " report to the server (interrupted, app killed, network lost); the paper saw 6-10%."
        )
        if unfinished:
            many = f"The {unfinished:,} sessions" if unfinished > 1 else "The one session"
            out["dropout_rate"] += (
                f" {many} still under way when the run ended {'are' if unfinished > 1 else 'is'} not counted"
                " (outcome unfinished in sessions.csv)."
            )
        if summary.get("secure_groups"):
            out["dropout_rate"] += (
                " Under Secure Aggregation a device interrupted after its group took its masked input is not"
                " counted when the group summed it (summed in sessions.csv): its peers' shares recover its"
                " masks, and the server counts it as reported."
            )
        if drop > 0.10:
            out["dropout_rate"] += (
                " Above that, the [faults] hazards of the config drive it; rounds absorb drop-out by"
                " selecting more devices than the goal (task.over_selection)."
            )
    swing = summary.get("availability_swing")
    if swing is None:
        out["availability_swing"] = "Busiest over quietest hour's available devices; the run has no timeline."
    else:
        out["availability_swing"] = (
            f"Devices available to train (idle, charging, unmetered) ranged from {_fmt(summary.get('available_trough', 0))}"
            f" in the quietest hour to {_fmt(summary.get('available_peak', 0))} in the busiest (hourly means), a"
            f" {_fmt(swing)}x swing."
        )
        high, low = summary.get("participating_peak"), summary.get("participating_trough")
        if isinstance(high, (int, float)) and isinstance(low, (int, float)):
            out["availability_swing"] += (
                " The paper's 4x over a day (sec. 9) counts participating devices: here those seated in a round"
                f" ranged from {_fmt(low)} in their quietest hour to {_fmt(high)} in their busiest (hourly means)."
                " A round seats at most its goal times its over-selection: while more devices are available"
                " than that, the rounds set how many take part, not the hour, and the day's swing shows in the"
                " devices available and waiting to check in (the devices figure)."
            )
        else:
            out["availability_swing"] += " The paper saw about 4x over a day, of participating devices (sec. 9)."
        if 0 < sim_s < 86400.0:
            out["availability_swing"] += (
                f" This run covers {_hours(sim_s)} of a day's 24, so it sees part of the swing."
            )
    if rounds:
        out["round_completion_rate"] = _completion_sentence(summary, rounds)
        done = summary.get("tasks_completed_s")
        if isinstance(done, (int, float)) and sim_s - done >= 60.0:
            out["round_completion_rate"] += (
                f" Every task had completed (its max_rounds, or its privacy budget) {_hours(done)} into the run:"
                f" the last {_hours(sim_s - done)} ran no round and only turned check-ins away."
            )
        gap = summary.get("round_gap_note")
        if gap:
            out["round_completion_rate"] += f" {gap[0].upper()}{gap[1:]}."
    else:
        out["round_completion_rate"] = (
            "Share of rounds that committed a model; no round ran (a run needs a few simulated"
            " minutes for its first round to close: simulate more --hours)."
        )
    if no_target(summary):
        out["time_to_target_accuracy_s"] = (
            "No target accuracy was set, so none was measured: give one with --target-accuracy (or [task]"
            " target_accuracy) for the simulated time to the first committed model that reaches it."
        )
    elif "time_to_target_accuracy_s" in summary:
        reached = summary["time_to_target_accuracy_s"]
        if isinstance(reached, (int, float)):
            out["time_to_target_accuracy_s"] = (
                f"Simulated time to the first committed model at or above the target accuracy:"
                f" {reached / 3600.0:.2f} hours into the run."
            )
        else:
            last = summary.get("accuracy")
            came = f" (the last committed model's accuracy is {last:.3f})" if isinstance(last, float) else ""
            out["time_to_target_accuracy_s"] = (
                f"No committed model reached the target accuracy in {_hours(sim_s, 'simulated ')}"
                f"{came}: simulate more --hours, or commit more rounds (see the round"
                " completion rate)."
            )
    errors = summary.get("errors")
    if isinstance(errors, Mapping) and errors:
        total = sum(int(n) for n in errors.values())
        out["errors"] = (
            f"{total:,} session{'s' if total != 1 else ''} ended in an error, by its kind (outcome"
            " error in sessions.csv)"
            + (
                ": ServerUnreachable is a device whose network failed mid-request, one of the fleet's simulated"
                " faults, not the server down."
                if "ServerUnreachable" in errors
                else "."
            )
        )
    percentiles = summary.get("client_accuracy_percentiles")
    if isinstance(percentiles, Mapping):
        marks = dict(_percentile_marks(percentiles))
        if {"p10", "p50", "p90"} <= set(marks):
            out["client_accuracy_percentiles"] = (
                "Accuracy of the last model on each client's own test examples: one client in ten is at or below"
                f" {marks['p10']:.3f}, half are at or below {marks['p50']:.3f}, nine in ten at or below"
                f" {marks['p90']:.3f}; a wide spread means the model serves some clients' data poorly."
            )
        else:
            out["client_accuracy_percentiles"] = (
                "Percentiles over clients of the last model's accuracy on each client's own test examples."
            )
    return out


def no_target(summary: Mapping[str, Any]) -> bool:
    """The run set no target accuracy (its summary's ``target_accuracy`` is null), so its null
    ``time_to_target_accuracy_s`` means nothing was asked, not that no model got there. A summary
    written before the key existed reads as having had a target."""
    return "target_accuracy" in summary and summary["target_accuracy"] is None


def _headline(summary: Mapping[str, Any]) -> str:
    """Time-to-accuracy and per-client accuracy first, when the run measured them."""
    parts = []
    if "time_to_target_accuracy_s" in summary and not no_target(summary):
        reached = summary["time_to_target_accuracy_s"]
        parts.append(
            (
                f"Target accuracy reached after {reached / 3600.0:.2f} simulated hours."
                if reached >= 18.0
                else f"Target accuracy reached after {_hours(reached, 'simulated ')}."  # not "0.00 hours"
            )
            if isinstance(reached, (int, float))
            else "Target accuracy not reached."
        )
    percentiles = summary.get("client_accuracy_percentiles")
    if isinstance(percentiles, Mapping):
        marks = _percentile_marks(percentiles)
        if marks:
            parts.append("Per-client accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in marks) + ".")
    if summary.get("accuracy") is not None:
        parts.append(f"Last committed model's accuracy {summary['accuracy']:.3f}.")
    parts.extend(_privacy_sentences(summary))
    return f'<p class="headline">{html.escape(" ".join(parts))}</p>' if parts else ""


def _failures(summary: Mapping[str, Any]) -> str:
    """The summary's ``failure_notes`` as a list under "Why sessions failed": each cause the run's
    sessions ended by (a server's code, a device's typed error), its count and the option to change;
    nothing when none failed but by the fleet's ordinary life."""
    notes = summary.get("failure_notes") or []
    if not notes:
        return ""
    items = "".join(f"<li>{html.escape(n[0].upper() + n[1:])}.</li>" for n in notes)
    return (
        '<h2>Why sessions failed</h2><ul id="failures">'
        f"{items}</ul><p>The code column of sessions.csv names what ended each session.</p>"
    )


def _privacy_sentences(summary: Mapping[str, Any]) -> list[str]:
    """A DP run's epsilon and what it covers (``dp.counts``), and, with canaries, the audit's estimate
    beside it, in words."""
    if summary.get("delta") is None:
        return []
    eps, delta, rounds = summary.get("epsilon"), summary["delta"], summary.get("dp_rounds")
    spent = f"{eps:.3g}" if isinstance(eps, (int, float)) else "unbounded (no noise)"
    covers = (
        "a device's data and whether it took part (the server published no counts)"
        if summary.get("dp_counts") == "withheld"
        else "a device's data, not whether it took part (the rounds' counts are published)"
    )
    out = [f"Privacy: epsilon {spent} at delta {delta:g} after {rounds} DP rounds, covering {covers}."]
    if "audit_epsilon" in summary:
        est = summary["audit_epsilon"]
        k = summary.get("audit_canaries")
        if est is None:
            out.append(f"Audit ({k} canaries): no committed model to audit.")
        else:
            verdict = ""
            if isinstance(eps, (int, float)):
                verdict = (
                    ", within the accountant's epsilon"
                    if est <= eps
                    else ", ABOVE the accountant's epsilon: check the DP"
                )
            heard = summary.get("audit_reports")
            reports = f", {heard} of their reports summed" if heard is not None else ""
            out.append(f"Audit ({k} canaries{reports}): one-shot estimate epsilon {est:.3g}{verdict}.")
    return out


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
    "bytes_down",
    "bytes_up",
    "outcome",
)

#: Every table sits in a ``table-wrap`` box that scrolls sideways when the table is wider than the
#: page, and no box caps a table's height: every row is on the page. Long values (the digest) wrap.
_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;padding:0 1em;color:#222}
.table-wrap{overflow-x:auto;margin:1em 0}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right;overflow-wrap:anywhere}
th{background:#f3f3f3;position:sticky;top:0}td:first-child,th:first-child{text-align:left}code,.shape{font-family:monospace}
td.why{text-align:left;color:#444;min-width:20em}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}.headline{font-size:1.15em}
"""


def render_html(summary: Mapping[str, Any], figures: list[Figure], run: FleetRun) -> str:
    """The self-contained report: summary, figures (PNG as base64), shapes and rounds tables."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Fleet run {html.escape(str(summary['digest'])[:12])}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Fleet simulation report</h1>",
        f"<p>Run digest <code>{html.escape(str(summary['digest']))}</code>.</p>",
        _headline(summary),
        _failures(summary),
        '<h2>Summary</h2><div class="table-wrap"><table id="summary">',
        "<tr><th>figure</th><th>value</th><th>what it means</th></tr>",
    ]
    why = explain_rates(summary, run.rounds)
    dp_rows = _DP_ROWS if summary.get("delta") is not None else ()
    rows = [
        *_SUMMARY_ROWS,
        *dp_rows,
        *((k, label) for k, label in _OPTIONAL_ROWS if k in summary and not (k in _SECURE_ROWS and summary[k] is None)),
    ]
    for key, label in rows:
        note = (
            f'<td class="why" data-explains="{html.escape(key)}">{html.escape(why[key])}</td>'
            if key in why
            else "<td></td>"
        )
        out.append(f"<tr><th>{html.escape(label)}</th>{_td(summary[key], key)}{note}</tr>")
    out.append("</table></div>")

    out.append("<h2>Figures</h2>")
    for fig in figures:
        data = base64.b64encode(fig.png).decode("ascii")
        out.append(
            f'<figure id="{html.escape(fig.name)}"><img alt="{html.escape(fig.caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(fig.caption)}</figcaption></figure>"
        )

    out.append(
        '<h2>Session shapes</h2><div class="table-wrap"><table id="shapes">'
        "<tr><th>shape</th><th>sessions</th><th>share</th></tr>"
    )
    for shape, count in summary["shapes"].items():
        share = summary["shape_shares"][shape]
        out.append(
            f'<tr><td class="shape" data-value="{html.escape(_exact(shape))}">{html.escape(shape)}</td>'
            f'{_td(count)}<td data-value="{_exact(share)}">{100.0 * share:.1f}%</td></tr>'
        )
    out.append("</table></div>")
    legend = ", ".join(
        f"<code>{html.escape(sym)}</code> {html.escape(kind.replace('_', ' '))}" for kind, sym in SHAPE_SYMBOLS.items()
    )
    out.append(f"<p>Legend: {legend}.</p>")

    out.append(
        f"<h2>Rounds</h2><p>All {len(run.rounds):,} rounds, in the order they opened; bytes are those of the round's"
        " selected devices' sessions.</p>"
    )
    out.append('<div class="table-wrap"><table id="rounds"><tr>')
    columns = (*_ROUND_COLUMNS, "epsilon") if summary.get("delta") is not None else _ROUND_COLUMNS
    out.extend(f"<th>{c}</th>" for c in columns)
    out.append("</tr>")
    for r in run.rounds:
        out.append("<tr>" + "".join(_td(getattr(r, c)) for c in columns) + "</tr>")
    out.append("</table></div>")

    # The summary as JSON too, for tools.
    payload = script_json(summary, indent=1, allow_nan=False)
    out.append(f'<script type="application/json" id="summary-json">{payload}</script>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def build_report(run: FleetRun) -> tuple[dict[str, Any], list[Figure], str]:
    """The run's summary, figures and HTML page, in memory (:func:`write_report` writes them)."""
    summary = summarize(run)
    figures = report_figures(run, summary)
    return summary, figures, render_html(summary, figures, run)


def write_report(run: FleetRun, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Write the run's tables (``sessions.csv``, ``rounds.csv``, ``timeline.csv``),
    ``summary.json``, the PNG plots and ``report.html`` into ``out_dir``; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if run.config is not None:
        write_config(run.config, out)
    run.write_tables(out)
    summary = summarize(run)  # before the figures, which take longest: a run stopped then has its summary
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    figures = report_figures(run, summary)
    page = render_html(summary, figures, run)
    for fig in figures:
        (out / fig.name).write_bytes(fig.png)
    (out / REPORT_HTML).write_text(page, encoding="utf-8")
    return summary


def read_run_summary(folder: Path, needs: Sequence[str], error: type[Exception], hint: str) -> dict[str, Any]:
    """The recorded summary of the run in ``folder``, which must hold the files ``needs`` (its
    summary first); else ``error`` says what the folder is and what to give instead of it: the runs
    a folder of runs holds (a ``--seeds``/``--sweep`` folder), the rerun of a run stopped before its
    tables were written, or ``hint``."""
    from server_stub.errors import did_you_mean_path

    if not folder.is_dir():
        what = "it is a file, not a folder" if folder.exists() else f"no such folder{did_you_mean_path(folder)}"
        raise error(f"{folder} is not a fleet run: {what}; {hint}")
    missing = [name for name in needs if not (folder / name).is_file()]
    if missing:
        runs = sorted(p for p in folder.iterdir() if all((p / name).is_file() for name in needs))
        if runs:  # a folder of runs: name them, where the hint would bury them
            more = f" and {len(runs) - 4} more" if len(runs) > 4 else ""
            named = ", ".join(p.name for p in runs[:4])
            hint = f"it holds {len(runs)} run{'s' if len(runs) > 1 else ''} ({named}{more}): name each, as {runs[0]}"
        elif (folder / CONFIG_TOML).is_file():  # stopped before its tables were all written
            hint = f"run it again: fedfleet simulate {folder / CONFIG_TOML} --out {folder}"
        listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} or {missing[-1]}"
        raise error(f"{folder} is not a fleet run: it has no {listed}; {hint}")
    summary_path = folder / needs[0]
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{summary_path} is not a run's summary (not JSON: {exc}); {hint}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("digest"), str):
        raise error(f"{summary_path} is not a run's summary (no digest); {hint}")
    return summary


def _kind(value: object) -> str | None:
    """The JSON kind of a summary's value ('number', 'text', 'list', 'table', 'yes/no'); None for null."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "yes/no"
    if isinstance(value, (int, float)):
        return "number"
    kinds: dict[type, str] = {str: "text", list: "list", dict: "table"}
    return kinds.get(type(value), type(value).__name__)


def redraw_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw a run's plots and ``report.html`` again from what it left in ``run_dir``: its tables,
    ``summary.json`` and ``config.toml`` (a run stopped while its plots were drawn, or one an older
    release drew). The recorded summary is the page's; figures it predates are computed from the
    tables. Without ``config.toml`` (an older run) the hours of day are counted from 0:00 UTC. With
    ``out`` only the page is written there (its plots are inline); else the plots and
    ``report.html`` go into ``run_dir``. Returns the page's path; :class:`FleetReportError` says
    what a folder that is not a run lacks."""
    from .config import FleetConfig, FleetConfigError
    from .tables import ROUNDS_CSV, SESSIONS_CSV, TIMELINE_CSV, FleetTableError, SessionRow, TimelineRow

    folder = Path(run_dir)
    names = (SUMMARY_JSON, ROUNDS_CSV, SESSIONS_CSV, TIMELINE_CSV)
    recorded = read_run_summary(
        folder, names, FleetReportError, "give a run folder (what fedfleet simulate --out wrote)"
    )
    try:
        config = FleetConfig.load(folder / CONFIG_TOML) if (folder / CONFIG_TOML).is_file() else None
    except FleetConfigError as exc:
        raise FleetReportError(f"{folder / CONFIG_TOML} is not the run's config: {exc}") from None
    try:
        run = FleetRun(
            sessions=SessionRow.from_csv(folder / SESSIONS_CSV),
            rounds=RoundRow.from_csv(folder / ROUNDS_CSV),
            timeline=TimelineRow.from_csv(folder / TIMELINE_CSV),
            digest=recorded["digest"],
            config=config,
            wall_s=float(recorded.get("wall_s") or 0.0),
            simulated_s=recorded.get("simulated_s"),
            errors=dict(recorded.get("errors") or {}),
            devices_short_of_memory=recorded.get("devices_short_of_memory"),
            plan_cost=recorded.get("plan_cost"),
        )
    except (FleetTableError, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise FleetReportError(f"{folder} is not a fleet run: its tables cannot be read ({exc})") from None
    wrong = f"{folder / SUMMARY_JSON} is not the run's summary"
    try:
        computed = summarize(run)
    except (TypeError, ValueError) as exc:  # simulated_s, wall_s: read from the summary
        raise FleetReportError(f"{wrong}: {exc}; give a run folder (what fedfleet simulate --out wrote)") from None
    if "versions" not in recorded:  # this install's releases did not make an older run
        computed.pop("versions")
    for key, value in recorded.items():  # a value of another kind than the run's (a hand-edited file)
        if _kind(value) not in (None, _kind(computed.get(key)) or _kind(value)):
            raise FleetReportError(
                f"{wrong}: its {key} is {type(value).__name__} {json.dumps(value)[:40]}, "
                f"where a run writes a {_kind(computed[key])}"
            )
    summary = {**computed, **recorded}
    try:
        figures = report_figures(run, summary)
        page = render_html(summary, figures, run)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise FleetReportError(f"{wrong}: a value of it cannot be drawn ({type(exc).__name__}: {exc})") from None
    target = Path(out) if out is not None else folder / REPORT_HTML
    if out is None:
        for fig in figures:
            (folder / fig.name).write_bytes(fig.png)
    target.write_text(page, encoding="utf-8")
    return target
