"""A fleet run's headline figures (:func:`summarize`: drop-out rate, availability swing, session
shapes, round completion, traffic, time to accuracy), pure functions of its tables.

It reads the rows of :mod:`.rows` and a run through :class:`RunTables` (which
:class:`emulator.fleet.tables.FleetRun` is): ``FleetRun.summary()`` returns :func:`summarize` of the
run and :mod:`.report` draws the figures, so the tables and the report need not import each other.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from server_stub.secure_rounds import ROUND_ABANDONED

from .rows import UNFINISHED, RoundRow, SessionRow, TimelineRow

if TYPE_CHECKING:
    from server_stub.rounds import RoundConfig

    from .config import FleetConfig


class RunTables(Protocol):
    """What the figures read of a run: :class:`emulator.fleet.tables.FleetRun` (see its fields)."""

    sessions: list[SessionRow]
    rounds: list[RoundRow]
    timeline: list[TimelineRow]
    digest: str
    config: FleetConfig | None
    wall_s: float
    errors: dict[str, int]
    extra: dict[str, Any]
    devices_short_of_memory: int | None
    plan_cost: dict[str, Any] | None

    @property
    def span_s(self) -> float: ...


def _finite(x: float) -> float | None:
    """JSON has no NaN: an unmeasured value is null."""
    return float(x) if math.isfinite(x) else None


def _ratio(num: float, den: float) -> float | None:
    """``num / den``, or ``None`` when that is undefined or overflows (a wall time of 1e-320 s)."""
    return _finite(num / den) if den else None


def versions() -> dict[str, str | None]:
    """What a run's digest depends on besides its config: fedfleet's release (the server, the runtime
    and the simulator), onnxruntime's (training and the plans' bytes), numpy's (the population and
    the data drawn from the seed) and Python's. A run folder records them, so that who reruns it knows
    whether a different digest is a different install."""
    import importlib.metadata
    import platform

    import numpy
    import onnxruntime

    try:
        fedfleet: str | None = importlib.metadata.version("fedfleet")
    except importlib.metadata.PackageNotFoundError:  # the sources on sys.path, not installed
        fedfleet = None
    return {
        "fedfleet": fedfleet,
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def _start_hour_utc(run: RunTables) -> float:
    """The UTC hour of day simulated time 0 falls at (0 when the run carries no config)."""
    return 0.0 if run.config is None else float(run.config.fleet.start_utc_hour)


def hour_of_day(t_s: float, start_hour_utc: float = 0.0) -> int:
    """The UTC hour of day (0-23) of simulated time ``t_s``."""
    return int(math.floor(start_hour_utc + t_s / 3600.0)) % 24


def sample_hour(t_s: float, start_hour_utc: float = 0.0, span_s: float | None = None) -> int:
    """The UTC hour of day a timeline sample at ``t_s`` speaks for: its own, except the sample a run
    takes at its end (``t_s`` at ``span_s``), which closes the hour it ends rather than opening the
    next: a run of one hour from 0:00 covers hour 0 alone, not 0:00 to 1:59 with a lone sample in 1."""
    if span_s is not None and span_s > 0 and t_s >= span_s:
        t_s = span_s - 1e-3
    return hour_of_day(t_s, start_hour_utc)


def available_by_hour(
    timeline: list[TimelineRow], start_hour_utc: float = 0.0, span_s: float | None = None, column: str = "available"
) -> dict[int, float]:
    """Mean number of available devices (or of the timeline's ``column``: ``participating``, ...) in
    each UTC hour of day the timeline covers (the sample at the run's end ``span_s`` in the hour it
    closes, see :func:`sample_hour`)."""
    sums: dict[int, list[float]] = {}
    for row in timeline:
        sums.setdefault(sample_hour(row.t_s, start_hour_utc, span_s), []).append(getattr(row, column))
    return {h: statistics.fmean(v) for h, v in sorted(sums.items())}


def availability_swing(
    timeline: list[TimelineRow], start_hour_utc: float = 0.0, span_s: float | None = None
) -> tuple[float | None, float, float]:
    """(swing, peak, trough) of available devices over the day (paper, Fig. 5-6).

    Peak and trough are hourly means (the samples of each UTC hour of day averaged over every day
    the run covers), so one noisy sample does not make the swing. The swing is peak over trough
    with both floored at one device: a trough of zero available devices reads as the peak count
    itself instead of infinity (JSON has no infinity), a fleet that never had a device available
    reads as 1 (no swing), and the swing is never below 1. It is ``None`` without a timeline.
    """
    hourly = available_by_hour(timeline, start_hour_utc, span_s)
    if not hourly:
        return None, 0.0, 0.0
    peak, trough = max(hourly.values()), min(hourly.values())
    return max(peak, 1.0) / max(trough, 1.0), peak, trough


def participating_range(
    timeline: list[TimelineRow], start_hour_utc: float = 0.0, span_s: float | None = None
) -> tuple[float | None, float | None]:
    """(peak, trough) of the devices participating in a round (the timeline's ``participating``),
    hourly means as :func:`availability_swing` takes them; ``(None, None)`` without a timeline.

    The paper's 4x over a day (sec. 9) is of participating devices: a round seats at most its goal
    times its over-selection, so with devices to spare their number follows the rounds, not the
    hour, while the available devices follow the day."""
    hourly = available_by_hour(timeline, start_hour_utc, span_s, column="participating")
    if not hourly:
        return None, None
    return max(hourly.values()), min(hourly.values())


def is_dropout(session: SessionRow) -> bool:
    """A selected device that never got its report to the server: no completed (``^``) or
    rejected (``#``) upload, and no report the server counted (``summed``) (paper, section 9:
    drop-out from computation errors, network failures or changes in eligibility). A late report
    that the server rejected is not a drop-out: the device finished, the round had closed. Nor is a
    session the run's end cut (``unfinished``): it had not ended. Nor, under Secure Aggregation, is
    a device interrupted after its group took its masked input, when the group summed it (shape
    ``-v[]+!``, ``summed``): it contributed, its masks recovered from its peers' shares, and the
    server counts it as reported, as the paper's protocol does (Bonawitz et al. 2017)."""
    return ended(session) and not session.summed and not session.shape.endswith(("^", "#"))


def ended(session: SessionRow) -> bool:
    """An accepted session that ended within the run (not cut by its end: ``unfinished``)."""
    return session.accepted and session.outcome != UNFINISHED


def shape_counts(sessions: list[SessionRow]) -> dict[str, int]:
    """Counts of the shapes of training sessions (accepted check-ins that ended within the run, as
    in the paper's Table 1), most frequent first (ties by shape, so the order is stable)."""
    counts = Counter(s.shape for s in sessions if ended(s))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


#: The device's Secure Aggregation outcomes that leave its masked input out of its group's sum
#: (``device_runtime.secure_client.SecureOutcome``: ``SECAGG_`` and the outcome's name).
SECAGG_LOST = ("SECAGG_ABORTED", "SECAGG_EXCLUDED", "SECAGG_TIMED_OUT")

#: A check-in turned away for one of these reasons met the server's pace steering or a round's own
#: turn (full, not open yet, no task, already seated, its policies' verdict first asked for): the
#: fleet's ordinary life, not a cause the run failed by.
PACING = frozenset({"ROUND_FULL", "ROUND_NOT_OPEN", "NO_TASK", "ALREADY_SELECTED", "ELIGIBILITY_REQUIRED"})


def _most_first(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def ended_by(sessions: list[SessionRow]) -> dict[str, dict[str, int]]:
    """What ended the sessions that did not complete, by the code of each (``SessionRow.code``),
    most frequent first: ``reports_refused`` (the server's code for each report it refused, the
    device's own refusal of an update that is not valid as ``INVALID_UPDATE``),
    ``checkins_rejected_by`` (the server's reason for each check-in it turned away, pace steering's
    ``ROUND_FULL`` and ``ROUND_NOT_OPEN`` included) and ``sessions_interrupted`` (the reason each
    interrupted session was stopped). Empty in tables written before ``code``, whose rows carry none."""
    refused: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    interrupted: Counter[str] = Counter()
    for s in sessions:
        if not s.code:
            continue
        if s.outcome == "report_rejected":
            refused[s.code] += 1
        elif s.outcome == "rejected":
            rejected[s.code] += 1
        elif s.outcome == "interrupted":
            interrupted[s.code] += 1
    return {
        "reports_refused": _most_first(refused),
        "checkins_rejected_by": _most_first(rejected),
        "sessions_interrupted": _most_first(interrupted),
    }


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def _num(x: float) -> str:
    """``x`` as a command line takes it, short: 1e9 rather than 1e+09."""
    return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _which(sessions: list[SessionRow], column: str) -> str:
    """The values of ``column`` among ``sessions``, most frequent first (at most five named)."""
    counts = Counter(getattr(s, column) for s in sessions)
    names = [name for name, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def majority_share(labels: Any) -> float | None:
    """The accuracy of a model that always answers the most frequent class of ``labels`` (the
    test set's class ids): what "at chance" means for the run's accuracy. None without labels, or
    for labels that are not class ids (a regression's numbers)."""
    import numpy as np

    if labels is None:
        return None
    y = np.asarray(labels).reshape(-1)
    if not y.size or y.dtype.kind not in "iuf" or (y.dtype.kind == "f" and not np.all(np.mod(y, 1) == 0)):
        return None
    _, counts = np.unique(y, return_counts=True)
    return float(counts.max() / y.size)


#: A model whose accuracy is within this much of ``majority_share`` learned nothing the noise left.
AT_CHANCE = 0.05


def _at_chance(run: RunTables, summary_accuracy: float | None) -> str | None:
    """Why a DP run's model is no better than chance: the noise the server (central) or the
    devices (distributed) add, with the noise multiplier, the clip and the reports a round sums;
    None without DP, without a measured model, or with one clearly above chance."""
    dp = run.extra.get("dp")
    chance = run.extra.get("chance_accuracy")
    if not dp or dp.get("noise_multiplier") is None or summary_accuracy is None or chance is None:
        return None
    if summary_accuracy > chance + AT_CHANCE:
        return None
    config = run.config
    z = dp["noise_multiplier"]
    clip = f", dp.clip {config.dp.clip:g}" if config is not None else ""
    goal = f" (task.goal_count {config.task.goal_count})" if config is not None else ""
    return (
        f"the last committed model's accuracy {summary_accuracy:.3f} is at chance (always answering the test set's most "
        f"frequent class scores {chance:.3f}): the DP noise (noise multiplier {z:g}{clip}) swamps the reports a round "
        f"sums{goal}; lower --noise-multiplier, or sum more reports a round (a larger --goal: the noise on their mean "
        "falls as they grow), each at a cost in epsilon or devices"
    )


#: The server's codes for a report that came after its round's window: ``REPORT_LATE``, and
#: ``BAD_SESSION_TOKEN`` for one so late that the server no longer kept its session (it keeps those
#: of the open rounds and of the last closed one); a fleet has no other device that sends a token
#: the server does not know.
LATE = ("REPORT_LATE", "BAD_SESSION_TOKEN")


def failure_notes(run: RunTables, unfillable: bool = False) -> list[str]:
    """Why the run's sessions failed, one sentence per cause with its count and the option to
    change, from what the run knows: the code each session ended with (``SessionRow.code``: the
    server's error code of a refused report or its reason for a rejected check-in, the device's
    typed error, the reason an interruption gives) and the devices the plan's memory left out.
    Empty when no session failed but by the fleet's ordinary life: pace steering, a device whose
    conditions broke now and then, its network lost, a few of its reports late (``[faults]``; fewer
    than a quarter of the reports sent, or of the sessions accepted), its slowest devices stopped at
    their training time limit (fewer than one in twenty sessions accepted). ``unfillable``: no round can
    fill (:func:`cannot_fill`), so a report comes "late" to a round abandoned for want of devices,
    which that sentence explains and a longer report window would not change."""
    sessions: list[SessionRow] = run.sessions
    config = run.config
    task = config.task if config is not None else None
    builtin = task is not None and task.file is None and run.extra.get("task_file") in (None, "built-in")
    # the windows the server ran: a task file's RoundConfig where the fleet config leaves them out
    rounds = run.extra.get("round_config") or task
    notes: list[str] = []
    by_code: dict[tuple[str, str], list[SessionRow]] = {}
    for s in sessions:
        if s.code:
            by_code.setdefault((s.outcome, s.code), []).append(s)
    accepted = sum(1 for s in sessions if s.accepted)

    def refused(code: str) -> list[SessionRow]:
        return by_code.get(("report_rejected", code), [])

    if invalid := refused("INVALID_UPDATE"):
        lr = (
            f"lower task.learning_rate ({_num(task.learning_rate)} now: --sweep learning_rate={_num(task.learning_rate / 1000)}, "
            "or [task] learning_rate in a fleet config)"
            if builtin and task is not None
            else "lower the task file's learning rate (its client optimizer's)"
        )
        notes.append(
            f"{_plural(len(invalid), 'session')} trained an update that is not valid (not finite, as training that "
            f"diverges leaves it, or not of the model's shapes), refused as INVALID_UPDATE; {lr}"
        )
    late = [s for code in LATE for s in refused(code)]
    forgotten = len(refused("BAD_SESSION_TOKEN"))
    sent = sum(1 for s in sessions if s.shape.endswith(("^", "#")))
    if (
        late and len(late) >= sent / 4 and not unfillable
    ):  # fewer are the fleet's late devices ([faults] late_report_prob)
        window = f" (task.report_timeout_s = {rounds.report_timeout_s:g} s from check-in)" if rounds is not None else ""
        notes.append(
            f"{_plural(len(late), 'report')} came after their round's window had closed{window} and "
            "{} refused (REPORT_LATE{}); lengthen the window, or make sessions cheaper (task.reference_flops_per_s, "
            "task.compute_s_per_example, fewer examples or epochs)".format(
                "was" if len(late) == 1 else "were",
                f"; BAD_SESSION_TOKEN for {forgotten}, whose rounds had closed before the last one, so that the "
                "server no longer kept their sessions"
                if forgotten
                else "",
            )
        )
    lost = {
        code: len(rows)
        for (outcome, code), rows in by_code.items()
        if outcome == "report_rejected" and code in SECAGG_LOST
    }
    if lost:
        total = sum(lost.values())
        codes = ", ".join(f"{code} {k}" for code, k in _most_first(Counter(lost)).items())
        notes.append(
            f"{_plural(total, 'masked input')} {'was' if total == 1 else 'were'} never summed ({codes}): the device's Secure "
            "Aggregation group aborted (SECAGG_ABORTED: too few masked inputs in time, more than two thirds of the group "
            "and at least task.secagg_group_size), went on without it (SECAGG_EXCLUDED), or it waited past the protocol's "
            "time (SECAGG_TIMED_OUT); round_completion_note says what to change for the rounds lost"
        )
    for (outcome, code), rows in sorted(by_code.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if outcome == "report_rejected" and code not in ("INVALID_UPDATE", *LATE, *SECAGG_LOST):
            notes.append(
                f"{_plural(len(rows), 'report')} {'was' if len(rows) == 1 else 'were'} refused by the server ({code}); "
                "sessions.csv's code column names each"
            )
    for code in ("RUNTIME_VERSION_UNSUPPORTED", "RUNTIME_VERSION_NOT_CLAIMED"):
        if turned := by_code.get(("rejected", code)):
            devices = len({s.device_id for s in turned})
            notes.append(
                f"{_plural(devices, 'device')} on onnxruntime {_which(turned, 'runtime_version')} "
                f"{'was' if devices == 1 else 'were'} turned away {_plural(len(turned), 'time')} ({code}): "
                + (
                    "their release is outside the plan's runtime versions (its opset sets the oldest release that "
                    "runs it); build the task at a lower opset (a task file's Task.opset), or serve each release its "
                    "own versioned plan ([fleet] real_runtimes = true)"
                    if code == "RUNTIME_VERSION_UNSUPPORTED"
                    else "the task's versioned plans cover no plan for their release; add it to the task's "
                    "release tests (a task file's Task.runtimes)"
                )
            )
    ineligible = [
        rows for (outcome, code), rows in by_code.items() if outcome == "rejected" and code.startswith("INELIGIBLE")
    ]
    if ineligible:
        rows = [s for group in ineligible for s in group]
        reasons = ", ".join(sorted({s.code for s in rows}))
        devices = len({s.device_id for s in rows})
        notes.append(
            f"{_plural(devices, 'device')} {'was' if devices == 1 else 'were'} turned away as ineligible "
            f"{_plural(len(rows), 'time')} ({reasons}): they fail the policies the server names (min_examples: fewer "
            "examples in their stores than the task asks for); give the devices more examples ([data] examples_min, "
            "examples_median), or deploy the task with less asked of them (the task file's Task.eligibility)"
        )
    for (outcome, code), rows in sorted(by_code.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if outcome == "rejected" and code not in PACING and not code.startswith(("INELIGIBLE", "RUNTIME_VERSION_")):
            notes.append(
                f"{_plural(len(rows), 'check-in')} {'was' if len(rows) == 1 else 'were'} turned away by the server ({code})"
            )
    errors = {code: rows for (outcome, code), rows in by_code.items() if outcome == "error"}
    for code, rows in sorted(errors.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        n = _plural(len(rows), "session")
        where = f"on onnxruntime {_which(rows, 'runtime_version')} ({_which(rows, 'device_class')} devices)"
        if code == "PlanError":
            notes.append(
                f"{n} failed {where} with PlanError: the device could not load or run the plan, or feed it its "
                "examples (a feature of another shape or type than the plan's inputs); check the task file against the "
                "data (fedfleet plan test on the releases named)"
            )
        elif code == "OverBudget":
            notes.append(
                f"{n} ended on {_which(rows, 'device_class')} devices with OverBudget: the plan needs more memory or training time than those devices "
                "give; make the model or task.batch_size smaller, or leave the classes out (a higher fleet.min_memory_mb)"
            )
        elif code == "NoExamples":
            notes.append(
                f"{n} ended {where} with NoExamples: the plan's example selector matched none of the device's "
                "examples; check its collection and criteria against the data"
            )
        elif code == "ServerUnreachable":  # the devices' network outages: [faults] network_lost_per_h
            continue
        else:
            notes.append(f"{n} ended {where} with {code}; sessions.csv's code column names each")
    over = [
        rows
        for (outcome, code), rows in by_code.items()
        if outcome == "interrupted" and code.startswith(("over the device's training time", "over time budget"))
    ]
    rows = [s for group in over for s in group]
    if rows and len(rows) >= accepted / 20:  # fewer are the fleet's slowest devices at their limit
        limits = "; ".join(sorted({s.code for s in rows}))
        longer = (
            "or give the plan a longer time budget"
            if any(s.code.startswith("over time budget") for s in rows)
            else "or lengthen task.report_timeout_s (the devices' max_training_s is the longer of 600 s and the "
            "report window)"
        )
        notes.append(
            f"{_plural(len(rows), 'session')} trained past {'its' if len(rows) == 1 else 'their'} time limit and "
            f"{'was' if len(rows) == 1 else 'were'} stopped, reporting nothing ({limits}); make sessions cheaper "
            f"(task.reference_flops_per_s, task.compute_s_per_example, fewer examples or epochs), {longer}"
        )
    broke = len(by_code.get(("interrupted", "interrupted"), []))
    if broke and broke >= accepted / 4:
        notes.append(
            f"{_plural(broke, 'session')} of {accepted:,} accepted {'was' if broke == 1 else 'were'} interrupted when "
            "their devices' conditions stopped holding (idle, charging, unmetered: [availability], [faults] "
            "conditions_change_per_h); shorter sessions (fewer examples or epochs) finish more often"
        )
    chance = _at_chance(run, _last_accuracy(run.rounds))
    if chance is not None:
        notes.append(chance)
    if run.devices_short_of_memory:
        notes.append(
            f"{_plural(run.devices_short_of_memory, 'device')} above fleet.min_memory_mb cannot hold the plan in "
            "memory and took no part; make the model or task.batch_size smaller"
        )
    return notes


def round_config(task: Any) -> RoundConfig:
    """The server's round configuration of ``task``: a ``RoundConfig`` as it is, or the fleet's
    ``[task]`` (a ``TaskSection``) as the simulated server is given it."""
    from server_stub.rounds import RoundConfig

    from .workload import task_round_config

    return task if isinstance(task, RoundConfig) else task_round_config(task)


def reports_to_commit(task: Any) -> int:
    """The reports a round of ``task`` (a ``RoundConfig`` or a ``TaskSection``) needs to commit once
    no more can come: the server's own ``RoundConfig.commit_threshold`` (``goal_count`` x
    ``min_fraction``, rounded up), so what a run says is what its server decides by."""
    return round_config(task).commit_threshold


def cannot_fill(devices: int, peak_available: int, task: Any) -> str | None:
    """Why no round of ``task`` (a ``RoundConfig`` or a ``TaskSection``) can fill when at most
    ``peak_available`` of ``devices`` are available at once, with the figures and the options to
    change; None when the peak reaches a round's seats (``goal_count`` x ``over_selection`` devices
    selected). It names the reports a commit needs (:func:`reports_to_commit`)."""
    rounds = round_config(task)
    seats, needed = rounds.selection_target, rounds.commit_threshold
    if peak_available >= seats:
        return None
    peak = max(0, int(peak_available))
    each = f"each selects {seats} devices and needs {needed} of their reports to commit"
    if not peak:  # no device at all: more of the same may still be none, so the advice is where availability comes from
        return (
            f"no round can fill: {each}, and none of the "
            f"{devices:,} devices is available (idle, charging, unmetered) at any of the run's samples "
            "(every 5 simulated minutes); check [availability] (its night and day windows, or its trace) and [fleet] start_utc_hour "
            "against --hours, or simulate more --devices if only a few devices ever are"
        )
    more = f"simulate about {math.ceil(devices * seats / peak):,} --devices"
    from .workload import smallest_goal

    goal, floor = math.floor(peak / rounds.over_selection + 1e-9), smallest_goal(rounds)
    # a goal below the server's floor is refused before a run: no --goal to offer then, and why
    fewer = (
        f", or a --goal (task.goal_count) of at most {goal}"
        if goal >= floor
        else f" (no smaller --goal would do: the server refuses a goal below {floor}, whose rounds could commit with "
        f"fewer than {rounds.min_reports} reports, RoundConfig.min_reports)"
    )
    return (
        f"no round can fill: each selects {seats} devices (task.goal_count {rounds.goal_count} x task.over_selection "
        f"{rounds.over_selection:g}) and needs {needed} of their reports to commit (task.goal_count x task.min_fraction "
        f"{rounds.min_fraction:g}), and at most {peak} of the {devices:,} devices are available at once; {more}{fewer}"
    )


def slow_sessions(
    median_s: float,
    examples: float,
    epochs: int,
    seconds_per_example: float,
    task: Any,
    window_s: float,
    max_training_s: float = math.inf,
    budgeted: bool = False,
) -> str | None:
    """Why most reports will come late when the median device's session outlasts the report window
    ``window_s``, or why most sessions will report nothing when its training is stopped first, with
    the figures and the options to change; None when it fits. ``median_s``: the median device's
    training to its end in simulated seconds (``examples`` x ``epochs`` x ``seconds_per_example`` x
    its class's speed); a device stops training at ``max_training_s`` (``device_runtime.training_limit``:
    the plan's time budget when ``budgeted``, else the devices' ``max_training_s``), so a session
    lasts the shorter of the two, and one stopped reports nothing.
    ``task``: the fleet's ``[task]``, whose ``reference_flops_per_s`` or ``compute_s_per_example``
    set the seconds per example."""
    session_s = min(median_s, max_training_s)
    stopped = median_s > max_training_s
    if session_s <= window_s and not stopped:
        return None
    rate = (
        f"task.compute_s_per_example = {task.compute_s_per_example:g}"
        if task.compute_s_per_example is not None
        else f"the plan's FLOPs at task.reference_flops_per_s = {task.reference_flops_per_s:.3g}, which makes the "
        "default digits MLP train one example per second"
    )
    limit = (
        f"the plan's time budget of {max_training_s:g} s"
        if budgeted
        else f"the devices' {max_training_s:g} s of training (their max_training_s, the longer of 600 s and the report window)"
    )
    outcome = (
        f"most sessions will be stopped at {limit} and report nothing" if stopped else "most reports will come late"
    )
    longer = (
        f"longer than the {window_s:g} s report window (task.report_timeout_s)"
        if session_s > window_s
        else f"longer than {limit}"
    )
    cheaper = (
        "lower task.compute_s_per_example (it overrides the plan's cost)"
        if task.compute_s_per_example is not None
        else "for a phone's real pace set task.reference_flops_per_s = 1e9 (a mid-range phone sustains 1e9 to 1e10 "
        "FLOP/s), or set task.compute_s_per_example"
    )
    keys = "(each a fleet config's [task] key, or --sweep KEY=VALUE for one run)"
    options = (
        f"{cheaper} {keys}, or give the plan a longer time_budget_s in its task file"
        if budgeted and stopped
        else f"{cheaper}, or lengthen task.report_timeout_s {keys}"
    )
    return (
        f"a session's training takes about {median_s:,.0f} s on the median device ({examples:,.0f} examples x "
        f"{epochs} epoch{'s' if epochs != 1 else ''} x {seconds_per_example:.3g} s per example, {rate}), {longer}: "
        f"{outcome}; {options}"
    )


def completion_note(
    summary: dict[str, Any], rounds: list[Any], task: Any, secure: dict[str, dict] | None = None
) -> str | None:
    """The round completion rate in a sentence: which rounds were abandoned, why, and the option
    to change. Rounds whose selection closed with fewer devices than a commit needs lacked
    check-ins (the fleet, the goal or the selection window); under Secure Aggregation, rounds whose
    groups aborted lost every report of those groups (see :func:`secure_note`); the others lost
    their reports to drop-outs and to reports after the window (``task.report_timeout_s``).
    ``task``: the rounds' configuration (a ``RoundConfig`` or the fleet's ``[task]``), None when
    unknown; ``secure``: each secure round's Secure Aggregation statistics (the round metrics'
    ``secagg``) by round id. None without rounds; a run whose only round was still open when it
    ended says so (its rate is of no round)."""
    open_rounds = [r for r in rounds if getattr(r, "unfinished", False)]
    rounds = [r for r in rounds if not getattr(r, "unfinished", False)]  # the attempt the run's end cut: neither
    if not rounds:
        if not open_rounds:
            return None
        ended, cut = summary.get("simulated_s"), open_rounds[0]
        window = f" (task.report_timeout_s = {task.report_timeout_s:g} s from check-in)" if task is not None else ""
        head = (
            f"the run ended{f' at {ended / 3600:.3g} simulated hours' if ended else ''} with its first round still "
            f"open, {cut.selected} device{'' if cut.selected == 1 else 's'} selected and {cut.reported} reported"
        )
        why = summary.get("cannot_fill")  # the round could not have filled in any run's length
        return f"{head}: {why}" if why else f"{head}{window}; simulate more --hours"
    total, committed = len(rounds), sum(1 for r in rounds if r.committed)
    if committed == total:
        return f"all {total} rounds committed" if total > 1 else "the one round committed"
    head = f"{total - committed} of {total} rounds were abandoned"
    if task is None:
        return f"{head}; see rounds.csv"
    threshold = reports_to_commit(task)
    short = sum(1 for r in rounds if not r.committed and r.selected < threshold)
    reasons = []
    if summary.get("cannot_fill"):
        reasons.append(summary["cannot_fill"])
    elif short:
        reasons.append(
            f"{short} closed their selection window (task.selection_timeout_s = {task.selection_timeout_s:g} s) "
            f"with fewer than the {threshold} devices a commit needs, for lack of check-ins"
            f"{_failed_by(summary, checkins=True)}; simulate more "
            f"--devices, a smaller --goal, or a longer window (--sweep selection_timeout_s={4 * task.selection_timeout_s:g}, "
            "or [task] selection_timeout_s in a fleet config)"
        )
    rest = total - committed - (total - committed if summary.get("cannot_fill") else short)
    filled = [r for r in rounds if not r.committed and r.selected >= threshold]
    if rest > 0 and secure:
        why = secure_note(filled, secure, task)
        if why is not None:
            reasons.append(why[1])
            rest -= why[0]
            filled = [r for r in filled if not _lost_groups(secure.get(r.round_id))]
    if rest > 0:
        counts = _report_counts(filled, secure=bool(secure))
        shapes = summary.get("shapes", {})
        trained = {shape: n for shape, n in shapes.items() if shape.startswith("-v[]+")}
        late = sum(n for shape, n in trained.items() if shape.endswith("#"))  # of those that trained
        refused = summary.get("reports_refused") or {}
        if refused:  # the server's codes say which refusals were late ones (INVALID_UPDATE is not)
            late = min(late, sum(refused.get(code, 0) for code in LATE))
        trained_n = sum(trained.values())
        if trained_n and late >= trained_n / 4:
            reasons.append(
                f"{rest} had too few reports in time ({counts}): {late} of the {trained_n} sessions that trained reported after "
                f"their round's window closed (task.report_timeout_s = {task.report_timeout_s:g} s from check-in); "
                "lengthen it, or make sessions cheaper (raise task.reference_flops_per_s or set task.compute_s_per_example)"
                f"{_failed_by(summary)}"
            )
        else:
            stopped = shapes.get("-v[!", 0)  # interrupted while training
            interrupted = (
                f"; {stopped} of the run's {summary.get('sessions_accepted', 0)} accepted sessions were interrupted "
                "while training (shape -v[!: their conditions broke, or they trained "
                "for the plan's time budget or the devices' max_training_s, the longer of 600 s and the report "
                "window, and were stopped)"
                if stopped and stopped >= summary.get("sessions_accepted", 0) / 4
                else ""
            )
            reasons.append(
                f"{rest} had too few reports in time (each needs {threshold}; {counts}{interrupted}"
                f"{_failed_by(summary)}); see rounds.csv and sessions.csv"
            )
    return f"{head}: " + "; ".join(reasons)


def _failed_by(summary: dict[str, Any], checkins: bool = False) -> str:
    """The causes beyond the fleet's ordinary life that sessions ended by, as a clause of
    :func:`completion_note` ("; the server turned away 40 check-ins as RUNTIME_VERSION_UNSUPPORTED
    (failure_notes say why)"), "" when there are none: with ``checkins``, the server's reasons for
    the check-ins it turned away (not pace steering's, ``PACING``); else the codes of the reports it
    refused (not the late ones, ``LATE``, which the note names itself) and the devices' errors (not
    ``ServerUnreachable``, the fleet's network faults)."""

    def each(counts: dict[str, int], what: str) -> list[str]:
        return [f"{n} {what}{'' if n == 1 else 's'} as {code}" for code, n in counts.items()]

    if checkins:
        turned = {c: n for c, n in (summary.get("checkins_rejected_by") or {}).items() if c not in PACING}
        parts = [f"the server turned away {p}" for p in [", ".join(each(turned, "check-in"))] if turned]
    else:
        refused = {c: n for c, n in (summary.get("reports_refused") or {}).items() if c not in LATE}
        errors = {c: n for c, n in (summary.get("errors") or {}).items() if c != "ServerUnreachable"}
        parts = [f"the server refused {', '.join(each(refused, 'report'))}"] if refused else []
        parts += (
            [
                ", ".join(
                    f"{n} session{'' if n == 1 else 's'} ended in {code}"
                    for code, n in _most_first(Counter(errors)).items()
                )
            ]
            if errors
            else []
        )
    return f"; {', and '.join(parts)} (failure_notes say why)" if parts else ""


def _lost_groups(stats: dict | None) -> bool:
    """A secure round's statistics say it lost a group or formed none (what :func:`secure_note` explains)."""
    return stats is not None and bool(stats.get("aborted") or not stats.get("groups"))


def _report_counts(rounds: list[Any], secure: bool = False) -> str:
    """What became of the devices ``rounds`` selected, from their rows: reported in time, late,
    dropped out, and the rest (still training or reporting when the round closed, which the
    server counts as neither), so that the figures add up to the selected devices. Under Secure
    Aggregation (``secure``) the server counts a device whose masked input missed its group's
    collection as dropped, not late: the clause says so."""
    selected = sum(r.selected for r in rounds)
    in_time = sum(r.accepted for r in rounds)
    late = sum(r.reported - r.accepted for r in rounds)
    dropped = sum(r.dropped for r in rounds)
    busy = selected - in_time - late - dropped
    still = f", {busy:,} still at work when the round closed" if busy > 0 else ""
    which = "it" if len(rounds) == 1 else "they"
    return (
        f"{which} selected {selected:,} devices: {in_time:,} reported in time, {late:,} late, "
        f"{dropped:,} dropped out{' or sent their masked input too late for their group' if secure else ''}{still}"
    )


#: The Secure Aggregation rounds from the devices' masked inputs on, as ``secagg.Round`` names them.
_INPUT_ROUNDS = ("MaskedInputCollection", "ConsistencyCheck", "Unmasking")


def secure_note(rounds: list[Any], secure: dict[str, dict], task: Any) -> tuple[int, str] | None:
    """How many of ``rounds`` (abandoned rounds that selected enough devices) lost Secure
    Aggregation groups, and why in a clause with the options to change; None if none did. A group
    releases its sum only when more than two thirds of its devices (its threshold, and at least
    ``task.secagg_group_size``) send their masked inputs in time and answer the rounds after: a
    device's privacy floor, which no option lowers. The groups of those rounds that completed are
    said too, with the masked inputs they summed: the server counted those devices as reported,
    and the round published nothing of them. A round whose groups never formed (fewer than k
    devices, or distributed-DP parameters that do not fit) says so."""
    stats = [(r, secure.get(r.round_id)) for r in rounds]
    lost = [st for _, st in stats if st and st.get("aborted")]
    unformed = [st for _, st in stats if st is not None and not st.get("groups")]
    if not lost and not unformed:
        return None
    parts = []
    if lost:
        aborted = sum(st["aborted"] for st in lost)
        groups = sum(st["groups"] for st in lost)
        late = sum(n for st in lost for where, n in st.get("aborted_in", {}).items() if where in _INPUT_ROUNDS)
        k = getattr(task, "secagg_group_size", None) or getattr(task, "secagg_min_group_size", None)
        floor = f", and at least task.secagg_group_size = {k}," if k else ""
        # these rounds were abandoned: their completed groups are among the dropped (their sums went unused)
        completed = sum(1 for st in lost for d in st.get("dropped", []) if d.get("reason") == ROUND_ABANDONED)
        kept = (
            f"; their {completed} other group{'s' if completed != 1 else ''} completed, and the "
            f"{sum(st.get('summed_devices', 0) for st in lost)} masked inputs {'they' if completed != 1 else 'it'} "
            f"summed count as reported (rounds.csv accepted), short of the {reports_to_commit(task)} a round needs "
            "to commit, and were not published"
            if completed
            else ""
        )
        parts.append(
            f"{len(lost)} lost {aborted} of their {groups} Secure Aggregation groups ({late} short of masked inputs or "
            f"of answers after them{kept}): a group releases its sum only when more than two thirds of its devices{floor} "
            f"send their masked inputs within task.report_timeout_s = {task.report_timeout_s:g} s of the round's "
            "selection closing (the devices' privacy floor, which no option lowers); lengthen task.report_timeout_s, "
            "or make sessions cheaper (raise task.reference_flops_per_s or set task.compute_s_per_example)"
        )
    if unformed:
        errors = sorted({st["ddp_error"] for st in unformed if st.get("ddp_error")})
        k = getattr(task, "secagg_group_size", None) or getattr(task, "secagg_min_group_size", None) or 0
        few = [r for r, st in stats if st is not None and not st.get("groups") and r.selected < k]
        if errors:
            why = f": {errors[0]}"
        elif len(few) == len(unformed):
            why = " (fewer selected devices than task.secagg_group_size)"
        else:  # it seated enough, and some gave their seats up before the window closed
            why = (
                f" (devices it had selected dropped out while its selection window was open, so fewer than the "
                f"{reports_to_commit(task)} a commit needs were still in it when the window closed; a longer "
                "task.selection_timeout_s or more --devices seats more)"
            )
        parts.append(f"{len(unformed)} formed no Secure Aggregation group{why}")
    return len(lost) + len(unformed), "; ".join(parts)


#: The Secure Aggregation protocol's rounds in their order, as ``secagg.Round`` names them.
_PROTOCOL_ROUNDS = ("AdvertiseKeys", "ShareKeys", "ShareCheck", *_INPUT_ROUNDS)


def secure_groups(secure: dict[str, dict]) -> dict[str, Any]:
    """A secure run's Secure Aggregation groups over its rounds (``secure``: each round's ``secagg``
    statistics by round id): ``rounds`` that ran the protocol, ``groups`` formed, ``completed`` (their
    sums used), ``aborted`` and, by the protocol round each aborted in, ``aborted_in``,
    ``refused`` (completed, but the server refused their sum: ``dropped`` in a round's statistics)
    and ``cut`` (still running when their round closed, which another group's abort, or the run's
    end, had decided): together the groups formed; and ``summed_devices``, the masked inputs the
    completed groups summed."""
    aborted_in: Counter[str] = Counter()
    for st in secure.values():
        aborted_in.update(st.get("aborted_in", {}))
    order = {name: i for i, name in enumerate(_PROTOCOL_ROUNDS)}
    groups = sum(st.get("groups", 0) for st in secure.values())
    completed = sum(st.get("completed", 0) for st in secure.values())
    aborted = sum(st.get("aborted", 0) for st in secure.values())
    refused = sum(len(st.get("dropped", [])) for st in secure.values())
    return {
        "rounds": len(secure),
        "groups": groups,
        "completed": completed,
        "aborted": aborted,
        "aborted_in": dict(sorted(aborted_in.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))),
        "refused": refused,
        "cut": groups - completed - aborted - refused,
        "summed_devices": sum(st.get("summed_devices", 0) for st in secure.values()),
    }


#: A stretch without an open round shorter than this many selection windows (and 10 minutes) is the
#: server gathering devices for the next selection as it does every round; a longer one is explained.
GAP_WINDOWS = 3.0


def round_gaps(
    rounds: list[RoundRow],
    timeline: list[TimelineRow],
    span_s: float,
    task: Any,
    until_s: float | None = None,
    sessions: list[SessionRow] | None = None,
) -> list[dict[str, Any]]:
    """The stretches of the run in which no round was open, of at least ``GAP_WINDOWS`` selection
    windows of ``task`` (and 600 s), up to ``until_s`` (when every task had completed: after that
    no round opens by design) or the run's end: each ``from_s``, ``to_s``, ``samples`` (timeline
    samples within), and their mean ``available`` devices and ``resting`` (available, waiting out
    their participation interval after taking part: see ``TimelineRow.resting``), and
    ``gathered``: the check-ins of ``sessions`` in it that the server turned away as
    ``ROUND_NOT_OPEN``, its pace steering gathering the population for its next selection. None
    of them without a config (``task`` None)."""
    if task is None:
        return []
    end = span_s if until_s is None else min(span_s, until_s)
    shortest = max(600.0, GAP_WINDOWS * float(task.selection_timeout_s))
    spans = sorted((r.start_s, r.end_s) for r in rounds)
    gaps, free_from = [], 0.0
    for start, stop in [*spans, (end, end)]:
        if min(start, end) - free_from >= shortest:
            gaps.append((free_from, min(start, end)))
        free_from = max(free_from, stop)
    samples = sorted(timeline, key=lambda row: row.t_s)
    times = [row.t_s for row in samples]
    gathering = sorted(s.start_s for s in sessions or () if s.outcome == "rejected" and s.code == "ROUND_NOT_OPEN")
    out = []
    for lo, hi in gaps:  # the samples within each by bisection: a scan of the whole timeline per gap
        inside = samples[bisect.bisect_left(times, lo) : bisect.bisect_right(times, hi)]  # grew as a run's square
        out.append(
            {
                "from_s": lo,
                "to_s": hi,
                "samples": len(inside),
                "available": statistics.fmean(r.available for r in inside) if inside else None,
                "resting": statistics.fmean(r.resting for r in inside) if inside else None,
                "gathered": bisect.bisect_right(gathering, hi) - bisect.bisect_left(gathering, lo),
            }
        )
    return out


def gap_note(gaps: list[dict[str, Any]], task: Any, span_s: float, interval_s: float | None) -> str | None:
    """The longest stretch without an open round (see :func:`round_gaps`) in a sentence, with the
    devices available and those waiting out their participation interval (``interval_s``) then,
    set against the devices a round selects; None without one."""
    if not gaps:
        return None
    gap = max(gaps, key=lambda g: g["to_s"] - g["from_s"])
    lo, hi = gap["from_s"], gap["to_s"]
    more = f" (and {len(gaps) - 1} shorter stretch{'es' if len(gaps) > 2 else ''})" if len(gaps) > 1 else ""
    text = (
        f"no round was open from {lo / 3600.0:.2f} h to {hi / 3600.0:.2f} h"
        f"{' (the end of the run)' if hi >= span_s else ''}, {hi - lo:,.0f} s{more}"
    )
    if not gap["samples"] or gap["available"] is None:
        return text
    available, resting = gap["available"], gap["resting"]
    free = max(0.0, available - resting)
    rounds = round_config(task)
    seats = rounds.selection_target
    wait = f"{interval_s:,.0f} s" if interval_s else "an interval"
    text += (
        f": at its {gap['samples']} timeline samples about {available:,.0f} devices were available and about "
        f"{resting:,.0f} of them had taken part in a round and were waiting out their participation job's interval "
        f"(the devices' TrainingInterval min_interval_s, {wait} after a session) before checking in again"
    )
    from server_stub.pace import RENDEZVOUS_MARGIN

    needed = RENDEZVOUS_MARGIN * seats  # what the server waits for before it opens a selection
    if free < needed:
        shown = round(free) if round(free) < needed else math.floor(free)  # never "about 10, fewer than 10"
        text += (
            f", so at most about {shown:,} could check in, fewer than the {needed:,.4g} the server "
            f"expects before it opens a selection ({RENDEZVOUS_MARGIN:g} times the {seats} devices a round selects, "
            "task.goal_count x task.over_selection)"
        )
    else:
        text += (
            f", which left about {free:,.0f} free to check in, no fewer than the {needed:,.4g} a selection waits for,"
            " so the devices waiting out their interval do not explain the stretch"
        )
    gathered = gap.get("gathered") or 0
    if gathered:
        text += (
            f"; the server turned {gathered:,} check-in{'s' if gathered != 1 else ''} in it away as ROUND_NOT_OPEN:"
            " its pace steering gathered the devices for a later selection, as it gathers a population whose"
            " check-ins come too slowly to fill a selection window (task.selection_timeout_s) of themselves"
        )
    return text


def summarize(run: RunTables) -> dict[str, Any]:
    """The run's headline figures, as JSON-ready values (``None`` where a figure is undefined).

    - ``digest``: the run's digest (round history and committed models); ``devices`` and
      ``seed`` from its config (``None`` without one);
    - ``dropout_rate``: drop-outs (see :func:`is_dropout`) over the accepted sessions that ended
      within the run;
    - ``availability_swing``, ``available_peak``, ``available_trough``: see :func:`availability_swing`;
    - ``participating_peak``, ``participating_trough``: see :func:`participating_range` (null
      without a timeline);
    - ``shapes`` and ``shape_shares``: the shapes of the training sessions that ended, counts and
      shares (Table 1);
    - ``rounds`` (the rows of ``rounds.csv``: ``rounds_committed`` + ``rounds_abandoned`` +
      ``rounds_unfinished``, the attempt still open when the run ended, neither committed nor
      abandoned), ``round_completion_rate`` (committed over the rounds that closed: committed and
      abandoned), ``round_duration_median_s`` (committed rounds); ``round_completion_note``: the rate in a
      sentence (see :func:`completion_note`); ``cannot_fill``: why no round can fill when at most
      fewer devices than a round's seats were available at once (see :func:`cannot_fill`), else None;
      ``round_gaps`` (see :func:`round_gaps`) and ``round_gap_note``: the longest stretch without an
      open round, with the devices available and those waiting out their participation interval
      then (see :func:`gap_note`), None without one; ``secure_groups`` (None in a plain run): a secure run's
      Secure Aggregation groups, completed and aborted by protocol round (see :func:`secure_groups`);
      ``round_goal`` (``task.goal_count``: a round commits as soon as that many report) and
      ``round_reports_to_commit`` (the reports a round needs to commit once no more can come, as the
      server decides: see :func:`reports_to_commit`), null without the run's config;
    - ``sessions`` (every check-in), ``sessions_accepted`` (as many as the rounds' ``selected``),
      ``sessions_completed`` (upload completed), ``sessions_unfinished`` (accepted, cut by the
      run's end: still training or reporting), ``checkins_rejected``; ``errors``: sessions that ended in an error, by kind;
      ``reports_refused``, ``checkins_rejected_by``, ``sessions_interrupted``: the sessions by the code
      that ended them (see :func:`ended_by`); ``failure_notes``: why sessions failed, one sentence per
      cause with its count and the option to change (see :func:`failure_notes`);
      ``bytes_down``, ``bytes_up``;
    - ``devices_short_of_memory``: devices whose memory cannot hold a plan the fleet serves (a training or an evaluation task's; they took no part);
      ``plan_cost``: the plan's FLOPs per example, parameters (the trained values, as the toolchain
      prints them) and the checkpoint's untrained values (running statistics, optimizer state), peak
      memory estimate, plan, checkpoint and update bytes, and the simulated seconds per example on
      the reference phone;
    - ``accuracy``, ``loss``: of the last committed round that measured them;
    - ``epsilon``, ``delta``, ``dp_rounds``, ``noise_multiplier`` (null without DP), and with the
      audit's canaries ``audit_canaries`` and ``audit_epsilon``: see :func:`privacy`;
    - ``tasks_completed_s``: the simulated time every task of the fleet had completed by (its
      ``max_rounds`` or its privacy budget reached: later check-ins were only turned away), null
      while one still ran at the end;
    - ``target_accuracy``: the run's ``[task] target_accuracy`` (``--target-accuracy``), null without one;
      ``time_to_target_accuracy_s``: see :func:`time_to_target_accuracy_s` (null without a target);
      ``chance_accuracy`` (the accuracy of always answering the test set's most frequent class, see
      :func:`majority_share`), ``client_accuracy_percentiles`` (p10/p50/p90 over the test clients of the last measured
      model), ``task_file``, ``tasks``, ``data``, ``data_clients``, ``devices_per_client``: from the
      simulator (``FleetRun.extra``; null when it did not measure them);
    - ``simulated_s``, ``wall_s``, ``sim_s_per_wall_s``, ``sessions_per_wall_s`` (accepted
      sessions), ``completed_sessions_per_wall_s``.
    """
    sessions: list[SessionRow] = run.sessions
    rounds = run.rounds
    accepted = [s for s in sessions if s.accepted]
    finished = sum(1 for s in accepted if ended(s))
    completed = sum(1 for s in accepted if s.shape.endswith("^"))
    dropouts = sum(1 for s in accepted if is_dropout(s))
    shapes = shape_counts(sessions)
    committed = [r for r in rounds if r.committed]
    unfinished = sum(1 for r in rounds if r.unfinished)
    swing, peak, trough = availability_swing(run.timeline, _start_hour_utc(run), run.span_s)
    participating_peak, participating_trough = participating_range(run.timeline, _start_hour_utc(run), run.span_s)
    measured_acc = [r for r in committed if math.isfinite(r.accuracy)]
    measured_loss = [r for r in committed if math.isfinite(r.loss)]
    wall_s = float(run.wall_s)
    span_s = float(run.span_s)
    fleet = run.config.fleet if run.config is not None else None
    most = max((r.available for r in run.timeline), default=0)
    task = run.extra.get("round_config") or (run.config.task if run.config is not None else None)
    unfillable = cannot_fill(fleet.devices, most, task) if fleet is not None and run.timeline else None
    summary = {
        "digest": run.digest,
        "devices": fleet.devices if fleet else None,
        "seed": fleet.seed if fleet else None,
        "dropout_rate": _ratio(dropouts, finished),
        "availability_swing": swing,
        "available_peak": peak,
        "available_trough": trough,
        "participating_peak": participating_peak,
        "participating_trough": participating_trough,
        "shapes": shapes,
        "shape_shares": {k: v / finished for k, v in shapes.items()},
        "rounds": len(rounds),
        "rounds_committed": len(committed),
        "rounds_abandoned": len(rounds) - len(committed) - unfinished,
        "rounds_unfinished": unfinished,
        "round_completion_rate": _ratio(len(committed), len(rounds) - unfinished),
        "round_completion_note": None,
        "cannot_fill": unfillable,
        "round_goal": task.goal_count if task is not None else None,
        "round_reports_to_commit": reports_to_commit(task) if task is not None else None,
        "round_duration_median_s": _finite(statistics.median(r.duration_s for r in committed)) if committed else None,
        "sessions": len(sessions),
        "sessions_accepted": len(accepted),
        "sessions_completed": completed,
        "sessions_unfinished": len(accepted) - finished,
        "checkins_rejected": len(sessions) - len(accepted),
        "errors": dict(run.errors),
        **ended_by(sessions),
        "bytes_down": sum(s.bytes_down for s in sessions),
        "bytes_up": sum(s.bytes_up for s in sessions),
        "devices_short_of_memory": run.devices_short_of_memory,
        "plan_cost": run.plan_cost,
        "accuracy": _finite(measured_acc[-1].accuracy) if measured_acc else None,
        "loss": _finite(measured_loss[-1].loss) if measured_loss else None,
        "target_accuracy": _target_accuracy(run),
        "time_to_target_accuracy_s": time_to_target_accuracy_s(rounds, _target_accuracy(run)),
        **privacy(run),
        **{
            key: run.extra.get(key)
            for key in (
                "tasks_completed_s",
                "chance_accuracy",
                "client_accuracy_percentiles",
                "task_file",
                "tasks",
                "data",
                "data_clients",
                "devices_per_client",
            )
        },
        "simulated_s": span_s,
        "wall_s": wall_s,
        "sim_s_per_wall_s": _ratio(span_s, wall_s),
        "sessions_per_wall_s": _ratio(len(accepted), wall_s),
        "completed_sessions_per_wall_s": _ratio(completed, wall_s),
        "versions": versions(),
    }
    summary["round_completion_note"] = completion_note(summary, rounds, task, run.extra.get("secure_rounds"))
    summary["failure_notes"] = failure_notes(run, unfillable is not None)
    secure = run.extra.get("secure_rounds")
    summary["secure_groups"] = secure_groups(secure) if secure else None
    gaps = (
        round_gaps(rounds, run.timeline, span_s, task, run.extra.get("tasks_completed_s"), sessions) if rounds else []
    )
    summary["round_gaps"] = gaps
    summary["round_gap_note"] = gap_note(gaps, task, span_s, run.extra.get("device_min_interval_s"))
    return summary


def privacy(run: RunTables) -> dict[str, Any]:
    """``epsilon`` (at ``delta``, after the ``dp_rounds`` DP rounds that spent privacy: the committed
    ones and, under distributed DP, those abandoned after a group's sum was unmasked; null when unbounded,
    without noise), ``delta``, ``dp_rounds``, ``noise_multiplier``: all null without DP; with the
    audit's canaries, ``audit_canaries``, ``audit_reports`` (their reports summed into committed
    rounds) and ``audit_epsilon`` (the one-shot estimate; null with fewer than two canaries heard) too;
    ``dp_counts`` "withheld" when the task's ``dp.counts`` kept the rounds' counts out of what the
    server published (its epsilon then covers participation: the fleet's tables, which measure the
    fleet, still count every round's devices)."""
    dp = run.extra.get("dp")
    out: dict[str, Any] = {
        key: None if dp is None else dp.get(key) for key in ("epsilon", "delta", "dp_rounds", "noise_multiplier")
    }
    if dp is not None and dp.get("counts") == "withheld":  # published without counts; the fleet's tables have them
        out["dp_counts"] = "withheld"
    if run.extra.get("audit_canaries"):
        out["audit_canaries"] = run.extra["audit_canaries"]
        out["audit_reports"] = run.extra.get("audit_reports")
        out["audit_epsilon"] = run.extra.get("audit_epsilon")
    return out


def _last_accuracy(rounds: list[RoundRow]) -> float | None:
    """The accuracy of the last committed round that measured one (the summary's ``accuracy``)."""
    measured = [r.accuracy for r in rounds if r.committed and math.isfinite(r.accuracy)]
    return float(measured[-1]) if measured else None


def _target_accuracy(run: RunTables) -> float | None:
    task = run.config.task if run.config is not None else None
    return getattr(task, "target_accuracy", None)


def time_to_target_accuracy_s(rounds: list[RoundRow], target: float | None) -> float | None:
    """Simulated seconds from the start to the end of the first committed round whose model's test
    accuracy is at least ``target`` (rounds in the order they ended); None without a target or if none did."""
    if target is None:
        return None
    reached = [r.end_s for r in rounds if r.committed and math.isfinite(r.accuracy) and r.accuracy >= target]
    return _finite(min(reached)) if reached else None
