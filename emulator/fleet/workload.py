"""What a fleet runs: the tasks of a task file, built as ``fedfleet plan build`` builds them, and
each device's examples in the collections those tasks' plans read.

The tasks come from ``[task] file`` (``fedfleet simulate --task``), or from the built-in task file
``digits_task.py`` (the digits MLP, sized to the data and set from ``[task]``). They are loaded with
the toolchain's ``load_tasks`` and built with its ``build_task``, the code ``plan build`` runs:
training and evaluation tasks, task groups, client and server optimizers, secure tasks.

Which RoundConfig the simulated server runs: a task file's own (``Task.rounds``), except for the
``[task]`` keys the fleet config sets (or ``--goal``/``--sweep``), which override it for every task
of the file (``config.ROUND_KEYS``, ``RETRY_KEYS``); the built-in task runs the fleet's ``[task]``
round keys, defaults included. The keys that shape the built-in model (``config.BUILT_IN_KEYS``) are
refused beside a task file: its model, hyperparameters and Secure Aggregation are what it deploys.

The data (``emulator.fleet.data``) must hold every feature the plans' inputs name, with their shape
(or as many values per example: a 28x28 image feeds a 784-input) and a numeric dtype (cast to the
plan's); a dataset that does not is refused with both lists of features.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from device_runtime.eligibility import EligibilityPolicies
from device_runtime.executor import lookup_tables
from device_runtime.plan import Plan, PlanError
from server_stub.rounds import RoundConfig
from server_stub.task_choice import Strategy

from .config import BUILT_IN_KEYS, RETRY_KEYS, ROUND_KEYS, FleetConfig, TaskSection
from .events import SimulationError

__all__ = ["BUILT_IN_TASK", "FleetTask", "InputSpec", "Workload", "WorkloadError", "load_workload", "task_round_config"]

#: The task a fleet runs when its config names no task file.
BUILT_IN_TASK = Path(__file__).with_name("digits_task.py")
#: The built-in task has one output per class id up to the largest label: a label of 10**12 asked
#: numpy for a weight matrix of 7 TiB (a MemoryError line). 100,000 classes of a 32-wide layer
#: are 3.2M weights, past any label set the field's federated datasets use (StackOverflow's 10,000 words).
MAX_BUILT_IN_CLASSES = 100_000


class WorkloadError(SimulationError):
    """A task file or dataset the fleet cannot run; one line that says what to do."""


def task_round_config(task: TaskSection) -> RoundConfig:
    """The server's round configuration of the fleet's ``[task]`` (every valid section gives one:
    the section's bounds are the server's)."""
    secure: dict[str, Any] = (
        {
            "secagg_min_group_size": task.secagg_group_size,
            "secagg_round_timeout_s": task.secagg_round_timeout_s,
            "secagg_target_group_size": task.secagg_target_group_size,
        }
        if task.secure
        else {}
    )
    return RoundConfig(
        goal_count=task.goal_count,
        over_selection=task.over_selection,
        min_fraction=task.min_fraction,
        selection_timeout_s=task.selection_timeout_s,
        report_timeout_s=task.report_timeout_s,
        retry_window_s=(task.retry_min_s, task.retry_max_s),
        max_rounds=task.max_rounds,
        **secure,
    )


def overridden_round_config(rounds: RoundConfig, section: TaskSection) -> RoundConfig:
    """A task file's RoundConfig with the ``[task]`` keys the fleet config set."""
    explicit = section.explicit
    update: dict[str, Any] = {ROUND_KEYS[k]: getattr(section, k) for k in ROUND_KEYS if k in explicit}
    if explicit & set(RETRY_KEYS):
        update["retry_window_s"] = [section.retry_min_s, section.retry_max_s]
    if not update:
        return rounds
    try:
        return RoundConfig.from_dict({**rounds.to_dict(), **update})
    except ValueError as exc:
        raise WorkloadError(f"the fleet's [task] {sorted(update)} do not fit the task's RoundConfig: {exc}") from None


@dataclass(frozen=True)
class InputSpec:
    """What a plan's work graph reads of one example tensor: dtype and one example's shape (-1 for
    a symbolic dimension)."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{[d if d >= 0 else '?' for d in self.shape]}"


def plan_inputs(plan: Plan) -> dict[str, InputSpec]:
    """Example tensor name -> what the plan's work graph reads of it."""
    import onnx

    work = onnx.ModelProto.FromString(plan.work)
    by_name = {vi.name: vi for vi in work.graph.input}
    out = {}
    for graph_input, example in plan.device.inputs.items():
        vi = by_name.get(graph_input)
        if vi is None:
            continue
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in t.shape.dim][1:]
        out[example] = InputSpec(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name, tuple(dims))
    return out


@dataclass(frozen=True)
class FleetTask:
    """One task of the fleet's deploy: what ``plan build`` made of it and the RoundConfig it runs;
    ``eval_plan`` (training tasks) measures its committed models on the test split."""

    build: Any  # emulator.toolchain.bundle.TaskBuild
    rounds: RoundConfig
    eval_plan: Plan | None

    @property
    def name(self) -> str:
        return self.build.task.name

    @property
    def plan(self) -> Plan:
        return self.build.plan

    @property
    def evaluates(self) -> str | None:
        return self.build.manifest["evaluates"]

    @property
    def eligibility(self) -> EligibilityPolicies:
        """The task's eligibility policies, as ``fedfleet deploy`` sends them."""
        from emulator.toolchain.bundle import manifest_eligibility

        return manifest_eligibility(self.build)

    @property
    def collection(self) -> str:
        return self.build.plan.device.selector.collection_uri


class Workload:
    """The fleet's tasks and data, checked against each other; ``device_examples(spec)`` gives a
    device's examples per collection, adapted to what the plans read."""

    def __init__(self, config: FleetConfig, source: str, tasks: list[FleetTask], data: Any, secure: bool) -> None:
        self.config = config
        self.source = source
        self.tasks = tasks
        self.data = data
        self.secure = secure
        self.strategy = Strategy(config.task.strategy)
        self.training = [t for t in tasks if t.evaluates is None]
        train_uris = {t.collection for t in self.training}
        self.collections = {t.collection: ("train" if t.collection in train_uris else "eval") for t in tasks}
        inputs: dict[str, InputSpec] = {}
        for t in tasks:
            for plan in (t.plan, t.eval_plan):
                if plan is not None:
                    for name, spec in plan_inputs(plan).items():
                        inputs.setdefault(name, spec)
        self.inputs = inputs
        self._shapes = _check_features(inputs, data.features, data.source, source, data.label)
        _check_class_ids(tasks, data, source)
        _check_lookup_ids(tasks, data, source)

    @property
    def collection(self) -> str:
        """The first training task's collection (where a plain ``(x, y)`` goes)."""
        return self.training[0].collection

    def adapt(self, examples: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The features the plans read, in their dtype (character and word ids, held as uint8 or uint16,
        become the int64 a plan reads here: the same values) and per-example shape."""
        out = {}
        for name, spec in self.inputs.items():
            array = np.asarray(examples[name])
            shape = self._shapes[name]
            if array.shape[1:] != shape:
                array = array.reshape((array.shape[0], *shape))
            out[name] = array.astype(spec.dtype, copy=False)
        return out

    def device_examples(self, spec: Any) -> dict[str, dict[str, np.ndarray]]:
        """Collection URI -> the device's examples: its client's training examples in the training
        tasks' collections, its held-out ones in an evaluation task's own collection."""
        out: dict[str, dict[str, np.ndarray]] = {}
        for uri, kind in self.collections.items():
            raw = self.data.train(spec) if kind == "train" else self.data.held_out(spec)
            if raw and len(next(iter(raw.values()))):
                out[uri] = self.adapt(raw)
        return out

    def central_test(self) -> dict[str, np.ndarray]:
        test = self.data.central_test()
        return self.adapt(test) if test and len(next(iter(test.values()))) else {}

    def test_clients(self) -> dict[str, dict[str, np.ndarray]]:
        return {c: self.adapt(e) for c, e in self.data.test_clients().items() if e and len(next(iter(e.values())))}

    def info(self) -> dict[str, Any]:
        """The summary's keys about what ran: the task file, the data and how clients map to devices."""
        clients = self.data.clients
        devices = self.config.fleet.devices
        return {
            "task_file": self.source,
            "tasks": [t.name for t in self.tasks],
            "data": self.data.source,
            "data_clients": clients,
            "devices_per_client": round(devices / clients, 3) if clients else None,
        }

    def cast_line(self) -> str | None:
        """One line on whole-number images (uint8, or [H, W] of integers: pixels 0 to 255) a plan reads
        as floats: cast, never scaled, where a model made for pixels in [0, 1] may learn nothing of
        them (None when there are none)."""
        features = self.data.features
        tokens = bool(getattr(self.data, "vocabulary", ()))  # uint8 [80] is character ids there, not pixels
        cast = sorted(
            name
            for name, spec in self.inputs.items()
            if np.dtype(spec.dtype).kind == "f"
            and name != self.data.label
            and features[name].dtype != "str"
            and np.dtype(features[name].dtype).kind in "iu"
            and (
                (features[name].dtype == "uint8" and not (tokens and len(features[name].shape) < 2))
                or len(features[name].shape) >= 2  # an image's [H, W]
            )
        )
        if not cast:
            return None
        one = len(cast) == 1
        described = ", ".join(f"{features[n].dtype} {n}" for n in cast)
        return (
            f"the data's {described} {'feeds' if one else 'feed'} the plan's float "
            f"{'input' if one else 'inputs'} cast, not scaled (pixels stay 0 to 255): a model made for pixels in "
            "[0, 1] needs the data saved divided by 255"
        )

    def mapping_line(self) -> str | None:
        """One line on how the dataset's clients map to the fleet's devices (None for the default data)."""
        clients = self.data.clients
        if not clients:
            return None
        devices = self.config.fleet.devices
        if devices == clients:
            how = "one client per device"
        elif devices > clients:
            how = f"each client is reused by about {devices / clients:.3g} devices (devices_per_client)"
        else:
            how = f"{devices} of them, drawn with the seed, one per device"
        note = getattr(getattr(self.data, "dataset", None), "test_note", "")  # a test split that is not there
        return f"data {self.data.source}: {clients} training clients for {devices} devices: {how}" + (
            f"; {note}" if note else ""
        )


#: A data set's features named in a one-line error: a CSV of 700 columns listed them all.
LISTED_FEATURES = 8


def describe_features(features: Mapping[str, Any]) -> str:
    """``name dtype[shape]`` of the first ``LISTED_FEATURES`` features by name, and how many more."""
    named = sorted(features.items())
    listed = ", ".join(f"{n} {f.dtype}{list(f.shape)}" for n, f in named[:LISTED_FEATURES])
    return listed + (f" and {len(named) - LISTED_FEATURES} more" if len(named) > LISTED_FEATURES else "")


def _stack_hint(features: Mapping[str, Any], label: str | None) -> str:
    """What a table of several numeric columns can do about a plan that reads one vector."""
    scalars = [n for n, f in features.items() if n != label and f.dtype != "str" and not f.shape]
    return (
        f"; a table's {len(scalars)} numeric columns become one vector feature NAME with the option stack=NAME"
        if len(scalars) > 1
        else ""
    )


def _rename_hint(missing: list[str], unread: set[str]) -> str:
    """The data spec's option that names one of the data's unread features as the plan reads it."""
    if not unread:
        return ""
    names = sorted(unread)
    listed = ", ".join(names[:LISTED_FEATURES]) + (" and more" if len(names) > LISTED_FEATURES else "")
    return (
        f"; or give the data's features ({listed} go unread) the names the plan reads, {', '.join(missing)}, "
        "with the data spec's option rename=OLD:NEW+OLD2:NEW2"
    )


def _label_hint(data_source: str, label: str | None) -> str:
    """A table or TFF file read without a label: the spec's option that names the column holding it."""
    if label is not None or not data_source.startswith(("table:", "tff-h5:")):
        return ""
    return (
        "; the data has no label (without the data spec's option label=NAME, a feature named label or y): "
        "name the one holding it with label=NAME, which stack= then leaves out of its vector"
    )


def _text_hint(
    data_source: str, features: Mapping[str, Any], label: str | None, inputs: Mapping[str, InputSpec]
) -> str:
    """What the data spec's options make of text features no plan reads as text: tff-h5's
    ``chars=`` cuts a text without a label into next-character examples, ``words=`` (tff-h5 and
    tables) reads texts as word ids."""
    texts = sorted(n for n, f in features.items() if f.dtype == "str" and n != label)
    if not texts or not data_source.startswith(("tff-h5:", "table:")):
        return ""
    words = f"words={'+'.join(texts)} reads {'it' if len(texts) == 1 else 'them'} as word ids"
    labelled = label is not None and label in features
    if not data_source.startswith("tff-h5:") or labelled:
        return (
            f"; plans read numbers, not text: the data spec's option {words}{'' if labelled else ', with label=NAME'}"
        )
    x = inputs.get("x")
    width = x.shape[0] if x is not None and len(x.shape) == 1 and x.shape[0] > 0 else None
    fits = (
        f"window={width} fits the plan's x"
        if width
        else f"chars={texts[0]},window=20 fits --task examples/tasks/shakespeare_task.py"
    )
    return (
        f"; plans read numbers, not text: the data spec's option chars={texts[0]} cuts it into next-character examples "
        f"x and y as LEAF cuts Shakespeare ({fits}), and {words} (with label=NAME)"
    )


def _check_features(
    inputs: Mapping[str, InputSpec],
    features: Mapping[str, Any],
    data_source: str,
    task_source: str,
    label: str | None = None,
) -> dict[str, tuple[int, ...]]:
    """Each input's per-example shape to feed; a WorkloadError naming both sides when the data lacks
    a feature, holds text for a number, or has another number of values per example."""
    described_inputs = ", ".join(f"{n} {s.describe()}" for n, s in sorted(inputs.items()))
    described_data = describe_features(features)
    missing = sorted(set(inputs) - set(features))
    if missing:
        hints = _text_hint(data_source, features, label, inputs) or (  # renaming a text would not feed a number
            f"{_stack_hint(features, label)}{_rename_hint(missing, set(features) - set(inputs))}"
            f"{_label_hint(data_source, label)}"
        )
        raise WorkloadError(
            f"the task's plans read features {described_inputs} but the data {data_source} has {described_data} "
            f"(missing: {', '.join(missing)}); use data with those features, or a task file whose plan inputs name "
            f"the data's features{hints}"
        )
    shapes = {}
    for name, want in inputs.items():
        have = features[name]
        problem = None
        if have.dtype == "str":
            problem = f"is text; the plan reads numbers (read it as word ids with the data spec's option words={name})"
        elif len(have.shape) == len(want.shape) and all(w < 0 or w == h for w, h in zip(want.shape, have.shape)):
            shapes[name] = tuple(have.shape)
        elif all(w >= 0 for w in want.shape) and math.prod(want.shape) == math.prod(have.shape):
            shapes[name] = tuple(want.shape)
        else:
            problem = f"has {list(have.shape)} values per example; the plan reads {want.describe()}"
            if not want.shape and len(have.shape) == 1 and np.dtype(want.dtype).kind in "iu":
                problem += (  # a Keras-style one-hot label, where the plan reads class ids
                    f" (a class id per example: one-hot labels are saved as ids with {name}.argmax(axis=1))"
                )
        if problem is not None:
            raise WorkloadError(
                f"feature {name!r} of the data {data_source} {problem} (the plans read {described_inputs}; the data has "
                f"{described_data}); use data that fits the task ({task_source}) or a task that fits the data"
            )
    return shapes


#: Ops that pass an integer input's values on unchanged to the op that reads them (a Gather's lookup, a loss's one-hot).
_PASS_IDS = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose"})


def _check_class_ids(tasks: list[FleetTask], data: Any, task_source: str) -> None:
    """A WorkloadError when the data's labels fall outside the classes a plan scores: every device
    would refuse its batches (``DeviceConfig.class_ids``, or for a plan that names none, the width
    of its loss's logits: :func:`graph_classes`), so the run says so before it starts."""
    label = data.label or "y"
    scoring = [
        (classes, plan.name)
        for task in tasks
        for plan in (task.plan, task.eval_plan)
        if plan is not None
        for graph_name, classes in {**graph_classes(plan), **plan.device.class_ids}.items()
        if plan.device.inputs[graph_name] == label
    ]
    if not scoring:
        return
    classes, name = min(scoring)  # the plan with the fewest classes refuses first
    ids = data.labels()  # every split's labels, read once
    if ids.dtype.kind == "f" and not np.all(np.mod(ids, 1) == 0):
        raise WorkloadError(
            f"the label {label!r} of {data.source} holds fractions, but the plan {name!r} ({task_source}) reads "
            f"class ids 0 to {classes - 1}; use whole-number labels, or a task with a loss for numbers (mse)"
        )
    outside = ids[(ids < 0) | (ids >= classes)]
    if outside.size:
        values, counts = np.unique(outside, return_counts=True)
        order = sorted(range(len(values)), key=lambda i: (-counts[i], -abs(float(values[i]))))
        named = [f"{values[i]:g} in {counts[i]:,} example{'s' if counts[i] != 1 else ''}" for i in order[:3]]
        rest = sum(int(counts[i]) for i in order[3:])
        more = f" and {len(order) - 3} more ids in {rest:,} examples" if len(order) > 3 else ""
        raise WorkloadError(
            f"the label {label!r} of {data.source} runs from {ids.min():g} to {ids.max():g}, but the plan "
            f"{name!r} ({task_source}) scores {classes} classes (ids 0 to {classes - 1}), and the data holds "
            f"{', '.join(named)}{more} outside them; use a task whose model has an output per class, or data "
            f"labelled 0 to {classes - 1}"
        )


def graph_classes(plan: Plan) -> dict[str, int]:
    """Graph input -> the classes the plan's loss scores it against, read from its work graph: the
    class ids a label is compared with (``Equal`` against ``arange(K)``, K the width of the loss's
    logits) to make its one-hot, as ``build_mlp_plan`` and the toolchain's cross-entropy write it;
    empty for a plan whose loss takes no class ids."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.ModelProto.FromString(plan.work).graph
    producer = {out: node for node in graph.node for out in node.output}
    constants = {init.name: init for init in graph.initializer}
    constants.update(
        {
            node.output[0]: a.t
            for node in graph.node
            if node.op_type == "Constant"
            for a in node.attribute
            if a.name == "value"
        }
    )
    out: dict[str, int] = {}
    for node in graph.node:
        if node.op_type != "Equal" or len(node.input) != 2:
            continue
        for side, other in (node.input, node.input[::-1]):
            while side in producer and producer[side].op_type in _PASS_IDS:
                side = producer[side].input[0]
            if side not in plan.device.inputs or other not in constants:
                continue
            ids = numpy_helper.to_array(constants[other]).ravel()
            if ids.size >= 2 and ids.dtype.kind in "iu" and np.array_equal(ids, np.arange(ids.size)):
                out[side] = max(out.get(side, 0), int(ids.size))
    return out


def _lookups(plan: Plan) -> list[tuple[str, str, int]]:
    """(example name, looked-up tensor, its rows) of each of the plan's integer inputs that a Gather
    reads as row ids (the device's own reading: ``lookup_tables``)."""
    import onnx

    tables = lookup_tables(onnx.ModelProto.FromString(plan.work).graph)
    return [
        (plan.device.inputs[name], table, rows) for name, (table, rows) in tables.items() if name in plan.device.inputs
    ]


def _check_lookup_ids(tasks: list[FleetTask], data: Any, task_source: str) -> None:
    """A WorkloadError when a feature's ids fall outside the rows a plan looks them up in (an
    embedding of 20 rows fed token 29): onnxruntime fails every session that meets one."""
    values = getattr(data, "values", None)
    if values is None:  # the default data: the digits, which no plan looks up
        return
    checked: dict[str, np.ndarray] = {}
    for task in tasks:
        for plan in (task.plan, task.eval_plan):
            if plan is None:
                continue
            for example, table, rows in _lookups(plan):
                if example not in data.features or data.features[example].dtype == "str":
                    continue
                ids = checked.setdefault(example, values(example))
                if not ids.size:
                    continue
                low, high = ids.min().item(), ids.max().item()  # Python numbers: uint8 ids + 1 would wrap
                if low < 0:
                    raise WorkloadError(
                        f"feature {example!r} of {data.source} runs from {low:g} to {high:g}, but the plan "
                        f"{plan.name!r} ({task_source}) looks its values up in {table!r}, of {rows} rows (ids 0 to "
                        f"{rows - 1}), and a device refuses a negative id (ONNX's Gather would read -1 as the last "
                        "row and train it): give padding an id of its own in the model's vocabulary"
                    )
                if high >= rows:
                    raise WorkloadError(
                        f"feature {example!r} of {data.source} runs from {low:g} to {high:g}, but the plan "
                        f"{plan.name!r} ({task_source}) looks its values up in {table!r}, of {rows} rows (ids 0 to "
                        f"{rows - 1}): every session meeting a larger id would fail; use a model with a row per id "
                        f"(a vocabulary of at least {high + 1:g}), or data whose ids are below {rows}"
                    )


# ----------------------------------------------------------------------------- building


def load_workload(config: FleetConfig) -> Workload:
    """The fleet's tasks (built) and data (read), checked against each other; the same config gives
    the same object (a sharded run's driver and shards in one process build it once) while its files
    are unchanged: the task file and the files beside it (its helper modules, the ``model.onnx`` of
    ``plan from-onnx``'s bundle), and the dataset (``data.files_stamp``)."""
    from .data import data_stamp, files_stamp

    task = config.task.file
    stamp = data_stamp(config.data)
    if task is not None:
        stamp += files_stamp([Path(task).parent], recursive=False)
    return _cached(json.dumps(config.dump(), sort_keys=True), stamp)


@lru_cache(maxsize=2)
def _cached(key: str, stamp: tuple[Any, ...]) -> Workload:
    return _build(FleetConfig.from_dict(json.loads(key)))


def _build(config: FleetConfig) -> Workload:
    from emulator.toolchain.tasks import TaskError, load_tasks

    from .data import fleet_data
    from .federated_data import FederatedDataError

    try:
        data = fleet_data(config)
    except FederatedDataError as exc:
        raise WorkloadError(f"the fleet's data cannot be read: {exc}") from None
    section = config.task
    built_in = section.file is None
    path = BUILT_IN_TASK if built_in else Path(section.file)  # type: ignore[arg-type]
    if not built_in:
        if not path.is_file():
            raise WorkloadError(
                f"no task file at {path}; give the path of a task file as `fedfleet plan build` takes "
                "(in a fleet config, relative to its folder)"
            )
        refused = [k for k in BUILT_IN_KEYS if k in section.explicit]
        if refused:
            named = ", ".join("secure (--secure)" if k == "secure" else k for k in refused)
            raise WorkloadError(
                f"[task] {named} {'shapes' if len(refused) == 1 else 'shape'} the built-in digits MLP only; with a "
                f"task file, set {'it' if len(refused) == 1 else 'them'} in {path} (its model, hyperparameters and "
                "secure_aggregation are what it deploys: Task(..., secure_aggregation=True) for Secure Aggregation)"
            )
    try:
        tasks = load_tasks(path)
    except TaskError as exc:
        raise WorkloadError(f"the task file does not load: {exc}") from None
    if built_in:
        tasks = [_built_in(task, config, data) for task in tasks]
    releases = [v.version for v in config.runtime_versions]
    fleet_tasks = []
    for task in tasks:
        if config.fleet.real_runtimes:  # versioned for the fleet's releases, as `plan build --runtimes` does
            task = _with_runtimes(task, releases)
        fleet_tasks.append(_build_task(task, path, section if not built_in else None, config))
    if not any(t.evaluates is None for t in fleet_tasks):
        raise WorkloadError(
            f"the task file {path} holds no training task; a fleet trains a model (list one in `tasks`)"
        )
    secure = section.secure if built_in else any(bool(t.plan.server.secure_sum) for t in fleet_tasks)
    _check_goal(fleet_tasks)
    _check_dp(config, fleet_tasks, path)
    return Workload(config, "built-in" if built_in else str(path), fleet_tasks, data, secure)


def smallest_goal(rounds: RoundConfig) -> int:
    """The smallest ``goal_count`` the server deploys ``rounds`` with: its commit threshold
    (``goal_count`` x ``min_fraction``, rounded up) at least ``min_reports``, so that what a round
    publishes never gives back a few devices' own values."""
    goal = max(1, math.floor((rounds.min_reports - 1) / rounds.min_fraction))  # the floor lies past it
    while dataclasses.replace(rounds, goal_count=goal).commit_threshold < rounds.min_reports:
        goal += 1
    return goal


def _check_goal(tasks: list[FleetTask]) -> None:
    """A goal whose rounds could commit with fewer than ``min_reports`` reports, which the server
    refuses at deploy: said before the run with the ``--goal`` that fixes it, where the server's own
    refusal names ``min_reports``, which no ``[task]`` key sets."""
    for task in tasks:
        rounds = task.rounds
        if rounds.commit_threshold < rounds.min_reports:
            raise WorkloadError(
                f"task {task.name!r}: a round of task.goal_count {rounds.goal_count} could commit with "
                f"{rounds.commit_threshold} report(s) (x task.min_fraction {rounds.min_fraction:g}), fewer than the "
                f"{rounds.min_reports} the server requires (RoundConfig.min_reports) so that what a round publishes "
                f"never gives back a few devices' own values; use a --goal of at least {smallest_goal(rounds)} "
                "(task.goal_count), or a larger task.min_fraction"
            )


def _check_dp(config: FleetConfig, tasks: list[FleetTask], path: Path) -> None:
    """Distributed DP runs only where Secure Aggregation does; the audit needs DP on (its canaries
    report at the clip, and its estimate is checked against the accountant)."""
    training = [t for t in tasks if t.evaluates is None]
    if config.dp.mode == "distributed" and not all(t.plan.server.secure_sum for t in training):
        raise WorkloadError(
            f"dp.mode = distributed adds the noise on devices under Secure Aggregation, and the tasks of {path} "
            "are not secure: give them secure_aggregation, or use --dp central"
        )
    if config.dp.audit_canaries and training[0].rounds.dp is None:
        raise WorkloadError(
            "dp.audit_canaries (--audit-canaries) audits a DP run: turn DP on with --dp central|distributed "
            "(or [dp] mode), or use a task file whose RoundConfig has dp"
        )


def _with_runtimes(task: Any, releases: list[str]) -> Any:
    from emulator.toolchain.tasks import TaskError

    try:
        evaluates = task.evaluates
        if evaluates is not None:
            evaluates = dataclasses.replace(evaluates, runtimes=tuple(releases))
        return dataclasses.replace(task, runtimes=tuple(releases), evaluates=evaluates)
    except TaskError as exc:
        raise WorkloadError(f"fleet.real_runtimes: {exc}") from None


def _build_task(task: Any, path: Path, section: TaskSection | None, config: FleetConfig) -> FleetTask:
    from emulator.toolchain.bundle import build_task
    from emulator.toolchain.tasks import evaluation_of

    try:
        built = build_task(task)
        eval_plan = evaluation_of(task).build_plan() if task.evaluates is None else None
    except SimulationError:
        raise
    except Exception as exc:  # noqa: BLE001 - the task file is user code: say where it failed, in one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        release = next((r for r in task.runtimes if r in first), None) if config.fleet.real_runtimes else None
        if isinstance(exc, PlanError) and release is not None:  # VersioningError, or a release outside the table
            raise WorkloadError(
                f"fleet.real_runtimes: no plan for onnxruntime {release} ({first}); remove it from runtime_versions"
            ) from None
        raise WorkloadError(
            f"task {task.name!r} of {path} does not build ({type(exc).__name__}: {first}); "
            f"`fedfleet plan build {path} -o DIR` shows the same"
        ) from None
    rounds = task_round_config(config.task) if section is None else overridden_round_config(task.rounds, section)
    dp = config.dp.config()
    if dp is not None and task.evaluates is None:  # [dp] / --dp: every training task's DP settings
        rounds = RoundConfig.from_dict({**rounds.to_dict(), "dp": dataclasses.asdict(dp)})
    return FleetTask(built, rounds, eval_plan)


def _built_in(task: Any, config: FleetConfig, data: Any) -> Any:
    """The built-in task sized to the data and set from the fleet's ``[task]`` and seed; its proxy
    data for release tests is the data's test split."""
    from emulator.toolchain.tasks import ProxyData, TaskError

    from .releases import PROXY_DEVICES

    label = data.label or "y"
    numeric = [n for n, f in data.features.items() if n != label and f.dtype != "str"]
    if label not in data.features or len(numeric) != 1:
        text = _text_hint(data.source, data.features, data.label, {})
        raise WorkloadError(
            f"the built-in task reads one numeric feature and an integer label, but {data.source} has "
            f"{describe_features(data.features)} ({f'label {data.label}' if data.label else 'no label: name it with label=NAME'}); "
            f"{text[2:] if text else 'name a task file that reads them (--task or [task] file)'}"
            f"{_stack_hint(data.features, data.label)}"
        )
    feature = numeric[0]
    labels = data.labels()
    whole = labels.dtype.kind == "f" and bool(np.all(np.mod(labels, 1) == 0))  # a CSV's 1.0, as LEAF's loader takes it
    if labels.dtype.kind not in "iub" and not whole:
        raise WorkloadError(
            f"the built-in task classifies, but the label {label!r} of {data.source} is "
            f"{labels.dtype}{' with fractions' if labels.dtype.kind == 'f' else ''}; name a task file for it (--task or "
            "[task] file)"
        )
    if labels.size and int(labels.min()) < 0:  # every device's training would refuse its examples
        raise WorkloadError(
            f"the built-in task classifies into class ids 0, 1, 2, ..., but the label {label!r} of {data.source} "
            f"goes down to {int(labels.min())}; number the classes from 0 or name a task file for it (--task or [task] file)"
        )
    if labels.size and int(labels.max()) >= MAX_BUILT_IN_CLASSES:
        raise WorkloadError(
            f"the built-in task has one output per class id up to the largest label, but the label {label!r} of "
            f"{data.source} goes up to {int(labels.max())}, past its limit of {MAX_BUILT_IN_CLASSES - 1}; number the "
            "classes 0, 1, 2, ... or name a task file for it (--task or [task] file)"
        )
    t = config.task
    hp = {
        "features": int(math.prod(data.features[feature].shape)),
        "classes": max(2, int(labels.max()) + 1),
        "hidden": tuple(t.hidden),
        "lr": t.learning_rate,
        "batch_size": t.batch_size,
        "epochs": t.epochs,
        "shuffle_seed": config.fleet.seed,
        "secure": t.secure,
        "x": feature,
        "y": label,
    }
    test = data.central_test()

    def proxy() -> Any:
        if not test or len(test[label]) < 2 * PROXY_DEVICES:
            raise TaskError(f"the data {data.source} has too small a test split for release tests")
        flat: dict[str, np.ndarray] = {
            "x": np.asarray(test[feature], np.float32).reshape(len(test[label]), -1),
            "y": np.asarray(test[label], np.int64),
        }
        named: dict[str, np.ndarray] = {feature: flat["x"], label: flat["y"]}
        return ProxyData.split(named, devices=PROXY_DEVICES, seed=config.fleet.seed)

    return dataclasses.replace(task, hyperparameters=hp, seed=config.fleet.seed, proxy=proxy)
