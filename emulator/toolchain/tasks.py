"""Tasks declared in Python (paper, section 7.1-7.2): the model engineer's unit of work.

A task file is ordinary Python that defines ``task`` (a :class:`Task`) or ``tasks`` (a
:class:`TaskGroup` or a list of tasks)::

    task = Task(
        name="digits",
        model=lambda hp: build_mlp_plan(64, (32,), 10, learning_rate=hp["lr"], ...),  # or an ONNX model
        hyperparameters={"lr": 0.2},
        runtimes=("1.15.1", "1.24.4", "1.32.0"),
        proxy=digits_proxy,
        predicates=(loss_decreases(epochs=3), accuracy_after_rounds(rounds=4, at_least=0.8)),
        budget=Budget(memory_mb=64, step_ms=5, session_s=30),
    )

The model is either a function of the hyperparameters that returns a :class:`~device_runtime.Plan`
or an ONNX inference model (a path or bytes) that ``training_plan_from_onnx`` turns into a
training plan with the task's loss, optimizer (``sgd``, ``momentum``, ``adam``; ``lr`` and
``momentum`` from the hyperparameters), label and batching. Test predicates are pure
functions of a :class:`Trial` (what a release run measured), so the same predicate judges every
claimed runtime; the numbers they read come from that real release (see ``release``).

An evaluation task measures a training task's model as the rounds go (paper, section 7.1: "model
evaluation" tasks beside training ones); the file lists both::

    evaluation = evaluation_of(task, selector=ExampleSelector("app:/digits_heldout"),
                               predicates=(accuracy_after_rounds(rounds=4, at_least=0.8),))
    tasks = [task, evaluation]

Its plan is the training plan's evaluation twin (same weights; ``build_eval_plan`` for the
builder's plans, ``evaluation_plan_from_onnx`` for an ONNX model); its release tests evaluate, on
each claimed release, the models the training task's simulated rounds produce, so its predicates
read ``accuracy_by_round`` / ``loss_by_round`` (an evaluation does not train: no local epochs).
It is deployed with its training task and takes that task's model each round.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import runpy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import Plan
from emulator.releases.envs import KNOWN_RELEASES, measured_release
from example_store import ExampleSelector
from server_stub.errors import did_you_mean_path
from server_stub.rounds import RoundConfig
from server_stub.schemas import NAME_RULE, is_name

if TYPE_CHECKING:
    import onnx

__all__ = [
    "Budget",
    "NamedOutput",
    "Predicate",
    "ProxyData",
    "Task",
    "TaskError",
    "TaskGroup",
    "Tolerance",
    "Trial",
    "accuracy_after_rounds",
    "evaluation_of",
    "graph_outputs",
    "load_tasks",
    "loss_after_rounds",
    "loss_decreases",
    "loss_is_finite",
    "loss_output",
    "measured_as",
    "onnx_output",
    "predicate",
    "task_output",
]

#: The oldest, a middle and the newest release: what a task claims when it names none.
DEFAULT_RUNTIMES: tuple[str, ...] = (KNOWN_RELEASES[0], KNOWN_RELEASES[len(KNOWN_RELEASES) // 2], KNOWN_RELEASES[-1])


def check_known_releases(task: Task) -> None:
    """Refuse a claimed release the release tests cannot install (``plan build --runtimes 9.9.9``)
    when the plans are built, not as a traceback when ``plan test`` tries to install it. A patch of
    a measured minor (1.24.1, measured as 1.24.4: :func:`~emulator.releases.envs.measured_release`)
    is claimed as it is: its versioned plan is its minor's, and its release tests run on it. The
    fleet simulator takes other releases and says itself which ones no plan can be written for."""
    for release in task.runtimes:
        try:
            measured_release(release)
        except ValueError as exc:
            raise TaskError(
                f"task {task.name!r} claims {release}, not an onnxruntime release the release tests know: {exc}"
            ) from None


def measured_as(release: str) -> str | None:
    """The measured release an earlier patch is claimed as ('1.24.1' -> '1.24.4'); None for a
    measured release itself, or one the release tests do not know."""
    try:
        measured = measured_release(release)
    except ValueError:
        return None
    return measured if measured != release else None


class TaskError(ValueError):
    """A task file or task declaration is unusable; the message says what to change."""


@dataclass(frozen=True)
class NamedOutput:
    """One value a model gives: a graph output, or one of the values a torch module's forward
    returns (its index, key or attribute name), with its dtype (for a value that is no tensor, its
    type's name) and shape, the batch axis written ``N``."""

    name: str
    dtype: str
    shape: tuple[int | str, ...] | None = None  # None where the file does not say, or no tensor
    tensor: bool = True
    batched: bool | None = None  # whether axis 0 is the batch's; None where the file does not say

    def __str__(self) -> str:
        if not self.tensor:
            return f"{self.name} ({self.dtype})"
        return f"{self.name} {self.dtype}" + ("" if self.shape is None else f" [{', '.join(map(str, self.shape))}]")

    @property
    def is_float(self) -> bool:
        return self.tensor and self.dtype.startswith(("float", "bfloat"))

    def fits(self, loss: str) -> bool:
        """Whether the loss could read it: a float tensor with a batch axis, and a class axis after
        it for ``cross_entropy``."""
        if not self.is_float or self.batched is False:
            return False
        return self.shape is None or len(self.shape) >= (2 if loss == "cross_entropy" else 1)


def loss_output(
    outputs: Sequence[NamedOutput],
    output: str | None,
    *,
    loss: str,
    source: str = "the model",
    in_task: bool = False,
) -> tuple[str, str | None]:
    """The output the loss reads, and a line to print where it was chosen for the person: ``output``
    where given (it must be one of ``outputs``, a tensor), the only one where there is one, else the
    only float one with a batch axis and the rank the loss needs. Several such outputs are refused in
    one line listing them: training the first of a model's (logits, hidden states) or (logits,
    auxiliary logits) silently is a model that learns something else than meant. The lines name
    ``--output``, or with ``in_task`` the task's ``output=`` (a Task written by hand)."""
    listing = ", ".join(map(str, outputs))
    which = "the index or name" if source == "forward" else "the name"
    if output is not None:
        found = next((o for o in outputs if o.name == output), None)
        if found is None or not found.tensor:
            gives = "forward returns" if source == "forward" else f"of {source}'s outputs"
            named = f"output={output!r}" if in_task else f"--output {output!r}"
            raise TaskError(f"{named} names no tensor {gives} ({listing}); give {which} of one")
        return found.name, None
    if len(outputs) == 1:
        return outputs[0].name, None
    candidates = [o for o in outputs if o.fits(loss)]
    given = f"{source} returns {len(outputs)} values" if source == "forward" else f"{source} has {len(outputs)} outputs"
    if len(candidates) == 1:
        axes = "a batch axis and a class axis" if loss == "cross_entropy" else "a batch axis"
        other = "output= in the Task" if in_task else "--output"
        return candidates[0].name, (
            f"{given} ({listing}): the loss reads {candidates[0].name!r}, the only float one with {axes} "
            f"({other} picks another)"
        )
    ask = "set output= in the Task to" if in_task else "give --output with"
    raise TaskError(f"{given} ({listing}); {ask} {which} of the one the loss reads")


def _np_dtype(elem_type: int) -> str:
    """The numpy name of an ONNX tensor element type (``float32``)."""
    import onnx

    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name


def graph_outputs(model: onnx.ModelProto) -> list[NamedOutput]:
    """The graph outputs of ``model`` as :class:`NamedOutput` (a ``ZipMap``'s sequence of maps as
    the probabilities it is given as), each batched where its first dimension is symbolic or the
    batch an input was exported at."""
    import onnx

    from . import ml_ops

    if any(n.domain == ml_ops.ML_DOMAIN for n in model.graph.node):
        model = onnx.ModelProto.FromString(model.SerializeToString())
        ml_ops.standard_form(model)
    initializers = {i.name for i in model.graph.initializer}
    batches = {
        dims[0].dim_value
        for vi in model.graph.input
        if vi.name not in initializers and len(dims := vi.type.tensor_type.shape.dim) and dims[0].HasField("dim_value")
    }
    found = []
    for vi in model.graph.output:
        if not vi.type.HasField("tensor_type"):
            found.append(
                NamedOutput(vi.name, (vi.type.WhichOneof("value") or "value").removesuffix("_type"), tensor=False)
            )
            continue
        t = vi.type.tensor_type
        dtype = _np_dtype(t.elem_type) if t.elem_type else "float32"
        if not t.HasField("shape"):
            found.append(NamedOutput(vi.name, dtype))
            continue
        dims = list(t.shape.dim)
        batched = bool(dims) and (not dims[0].HasField("dim_value") or dims[0].dim_value in batches)
        shape = tuple(
            "N" if k == 0 and batched else (d.dim_value if d.HasField("dim_value") else (d.dim_param or "?"))
            for k, d in enumerate(dims)
        )
        found.append(NamedOutput(vi.name, dtype, shape, batched=batched))
    return found


def onnx_output(
    model: onnx.ModelProto, output: str | None, *, loss: str, in_task: bool = False
) -> tuple[str | None, str | None]:
    """The tensor the loss of a plan from ``model`` reads (None: its only output) and the line
    saying which where it was chosen (:func:`loss_output`). An ``output`` naming a tensor inside the
    graph (the logits an ``ArgMax`` output is computed from) is taken as it is."""
    if output is not None and output in {o for n in model.graph.node for o in n.output}:
        return output, None
    outputs = graph_outputs(model)
    if output is None and (len(outputs) == 1 or not any(o.is_float for o in outputs)):
        return None, None  # one output, or no float one: the plan's own refusal says what to export
    return loss_output(outputs, output, loss=loss, in_task=in_task)


@dataclass(frozen=True)
class Budget:
    """What the target population's devices give one session: memory over the runtime's own
    baseline, time per training step, and time for a whole session (steps on a device's data)."""

    memory_mb: float | None = None
    step_ms: float | None = None
    session_s: float | None = None


@dataclass(frozen=True)
class Tolerance:
    """How close a release's work-graph outputs must be to the reference run's (numpy allclose)."""

    rtol: float = 1e-4
    atol: float = 1e-5


@dataclass(frozen=True)
class ProxyData:
    """Data that stands in for the devices' data: ``shards`` (one dict of example tensors per
    emulated device) for local training and simulated rounds, ``holdout`` for accuracy."""

    shards: tuple[Mapping[str, np.ndarray], ...]
    holdout: Mapping[str, np.ndarray]

    @classmethod
    def split(
        cls, examples: Mapping[str, np.ndarray], *, devices: int, holdout_fraction: float = 0.25, seed: int = 0
    ) -> ProxyData:
        """Shuffle ``examples`` (a dict of arrays sharing the first axis) and deal them to ``devices``
        shards and a holdout set."""
        n = len(next(iter(examples.values())))
        order = np.random.default_rng(seed).permutation(n)
        cut = int(round(n * (1 - holdout_fraction)))
        if devices < 1 or cut < devices or cut == n:
            raise TaskError(f"{n} proxy examples cannot make {devices} device shards and a holdout set")
        train, held = order[:cut], order[cut:]
        shards = tuple({k: np.asarray(v)[part] for k, v in examples.items()} for part in np.array_split(train, devices))
        return cls(shards, {k: np.asarray(v)[held] for k, v in examples.items()})

    @classmethod
    def random(cls, features: Mapping[str, tuple], *, examples: int = 64, devices: int = 2, seed: int = 0) -> ProxyData:
        """Stand-in examples drawn at random (the task stub ``plan from-onnx`` writes uses them): each
        feature is ``(dtype, shape)``, one example's shape without the batch axis, or ``(dtype,
        shape, high)`` for whole numbers drawn from [0, high) (class ids, token ids, 0/1 targets);
        floats without ``high`` are standard normal, booleans fair coins. Enough to show that a plan
        loads, runs and agrees on every release, not that it learns: real examples show that."""
        rng = np.random.default_rng(seed)
        drawn: dict[str, np.ndarray] = {}
        for name, spec in features.items():
            if len(spec) not in (2, 3):
                raise TaskError(f"proxy feature {name!r} is {spec!r}; give (dtype, shape) or (dtype, shape, high)")
            dtype, shape = np.dtype(spec[0]), (examples, *(int(d) for d in spec[1]))
            if len(spec) == 3:
                drawn[name] = rng.integers(0, int(spec[2]), size=shape).astype(dtype)
            elif dtype == np.bool_:
                drawn[name] = rng.integers(0, 2, size=shape).astype(bool)
            elif np.issubdtype(dtype, np.floating):
                drawn[name] = rng.standard_normal(shape).astype(dtype)
            else:
                drawn[name] = np.zeros(shape, dtype)
        return cls.split(drawn, devices=devices, seed=seed)


@dataclass(frozen=True)
class Trial:
    """What one run of a task on one runtime measured; predicates read it.

    ``loss_by_epoch``: mean loss of each local epoch on the first shard (pre-step weights of each
    batch); ``accuracy_by_round`` / ``loss_by_round``: on the holdout after each simulated round
    (index 0 is before the first round)."""

    runtime: str
    loss_by_epoch: tuple[float, ...]
    accuracy_by_round: tuple[float, ...]
    loss_by_round: tuple[float, ...]


@dataclass(frozen=True)
class Predicate:
    """A named check of a :class:`Trial`; ``check`` returns (passed, detail)."""

    name: str
    check: Callable[[Trial], tuple[bool, str]]
    local_epochs: int = 0
    rounds: int = 0


def predicate(name: str, *, local_epochs: int = 0, rounds: int = 0) -> Callable[[Callable[[Trial], bool]], Predicate]:
    """Decorate ``fn(trial) -> bool`` into a predicate; say how many local epochs and simulated
    rounds it needs to read."""

    def wrap(fn: Callable[[Trial], bool]) -> Predicate:
        def check(trial: Trial) -> tuple[bool, str]:
            return bool(fn(trial)), ""

        return Predicate(name, check, local_epochs, rounds)

    return wrap


def loss_decreases(epochs: int = 3) -> Predicate:
    """The loss of each local epoch is below the one before."""
    if epochs < 2:
        raise TaskError("loss_decreases needs at least 2 epochs to compare")

    def check(trial: Trial) -> tuple[bool, str]:
        losses = trial.loss_by_epoch[:epochs]
        ok = (
            len(losses) == epochs and all(b < a for a, b in zip(losses, losses[1:])) and all(map(math.isfinite, losses))
        )
        return ok, "losses " + ", ".join(f"{v:.4g}" for v in losses)

    return Predicate(f"loss_decreases_over_{epochs}_epochs", check, local_epochs=epochs)


def loss_is_finite(epochs: int = 1) -> Predicate:
    """Every local epoch's loss is a number (no NaN or infinity): what random proxy examples can
    show (the stub ``plan from-onnx`` writes claims it); real examples show that the loss falls."""
    if epochs < 1:
        raise TaskError("loss_is_finite needs at least 1 epoch")

    def check(trial: Trial) -> tuple[bool, str]:
        losses = trial.loss_by_epoch[:epochs]
        ok = len(losses) == epochs and all(map(math.isfinite, losses))
        return ok, "losses " + ", ".join(f"{v:.4g}" for v in losses)

    return Predicate(f"loss_is_finite_over_{epochs}_epochs", check, local_epochs=epochs)


def accuracy_after_rounds(rounds: int, at_least: float) -> Predicate:
    """After ``rounds`` simulated FedAvg rounds over the proxy shards, holdout accuracy >= ``at_least``."""
    if rounds < 1 or not 0 <= at_least <= 1:
        raise TaskError("accuracy_after_rounds needs rounds >= 1 and at_least in [0, 1]")

    def check(trial: Trial) -> tuple[bool, str]:
        if len(trial.accuracy_by_round) <= rounds:
            return False, f"only {len(trial.accuracy_by_round) - 1} rounds ran"
        value = trial.accuracy_by_round[rounds]
        return value >= at_least, f"accuracy {value:.4f} after {rounds} rounds (needs >= {at_least})"

    return Predicate(f"accuracy_after_{rounds}_rounds_at_least_{at_least:g}", check, rounds=rounds)


def loss_after_rounds(rounds: int, at_most: float) -> Predicate:
    """After ``rounds`` simulated rounds, the holdout's mean loss <= ``at_most`` (regression tasks,
    which have no accuracy, state their goal this way)."""
    if rounds < 1 or not math.isfinite(at_most):
        raise TaskError("loss_after_rounds needs rounds >= 1 and a finite at_most")

    def check(trial: Trial) -> tuple[bool, str]:
        if len(trial.loss_by_round) <= rounds:
            return False, f"only {len(trial.loss_by_round) - 1} rounds ran"
        value = trial.loss_by_round[rounds]
        return value <= at_most, f"loss {value:.4g} after {rounds} rounds (needs <= {at_most:g})"

    return Predicate(f"loss_after_{rounds}_rounds_at_most_{at_most:g}", check, rounds=rounds)


ModelSource = Callable[[Mapping[str, Any]], Plan] | str | Path | bytes


def fields_said(exc: ValidationError) -> str:
    """pydantic's refusal in one line: each field and what is wrong with it."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))[:300]


@dataclass(frozen=True)
class Task:
    """One task: model and how it trains, where its data comes from, how rounds run, what it
    may cost, which runtimes it claims, and what it must show on proxy data."""

    name: str
    model: ModelSource
    proxy: ProxyData | Callable[[], ProxyData]
    predicates: tuple[Predicate, ...] = ()
    hyperparameters: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.1})
    loss: str = "cross_entropy"
    optimizer: str = "sgd"
    label: str = "y"
    selector: ExampleSelector = field(default_factory=lambda: ExampleSelector("app:/examples"))
    batch_size: int = 32
    epochs: int = 1
    opset: int = 21
    rounds: RoundConfig = field(default_factory=RoundConfig)
    # which devices may take part: their examples, and how often one joins (``device_runtime.EligibilityPolicies``;
    # the device judges them on its own data, and a deploy or fleet run sends them with the task)
    eligibility: EligibilityPolicies = field(default_factory=EligibilityPolicies)
    budget: Budget = field(default_factory=Budget)
    runtimes: tuple[str, ...] = DEFAULT_RUNTIMES
    tolerance: Tolerance = field(default_factory=Tolerance)
    initial_weights: Callable[[Plan], Mapping[str, np.ndarray]] | None = None
    seed: int = 0
    server_optimizer: Any = None  # ONNX models: FedAvg() when None, or FedAvgM / FedAdam / FedYogi
    secure_aggregation: bool = False  # ONNX models: the client update goes through Secure Aggregation
    trainable: tuple[str, ...] | None = None  # ONNX models: initializer names or glob patterns to train (None: default)
    frozen: tuple[str, ...] = ()  # ONNX models: names or glob patterns kept constant
    # ONNX models: trained weights -> rows no gradient reaches (an embedding's padding_idx row)
    frozen_rows: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # ONNX models: the output the loss reads (None: the model's only output, or the only float one with a
    # batch axis where it has several; more such are refused, listing them)
    output: str | None = None
    evaluates: Task | None = None  # set by evaluation_of: this task measures that training task's model

    def __post_init__(self) -> None:
        if not is_name(self.name):  # a bundle keeps the task in a folder of its name: '..' would be its parent
            raise TaskError(f"task name {self.name!r} refused: {NAME_RULE}; the server takes no other")
        if not self.runtimes:
            raise TaskError(f"task {self.name!r} claims no runtime; name at least one onnxruntime release")
        if len(set(self.runtimes)) != len(self.runtimes):
            raise TaskError(f"task {self.name!r} claims a runtime twice: {self.runtimes}")
        minors = [r.rsplit(".", 1)[0] for r in self.runtimes]
        if len(set(minors)) != len(minors):
            raise TaskError(
                f"task {self.name!r} claims two patches of one minor release {self.runtimes}; devices are served per minor"
            )
        if self.batch_size < 1 or self.epochs < 1:
            raise TaskError(f"task {self.name!r}: batch_size and epochs must be >= 1")
        if not isinstance(self.eligibility, EligibilityPolicies):
            try:  # a mapping of its fields, as a manifest holds them
                object.__setattr__(self, "eligibility", EligibilityPolicies.from_dict(self.eligibility))
            except ValidationError as exc:
                raise TaskError(
                    f"task {self.name!r}: eligibility is invalid ({fields_said(exc)}); give "
                    "EligibilityPolicies(min_examples=..., min_separation_rounds=..., min_separation_s=..., "
                    "sampling_period_s=...)"
                ) from None
        if self.evaluates is not None:
            if self.evaluates.evaluates is not None:
                raise TaskError(
                    f"task {self.name!r} evaluates {self.evaluates.name!r}, itself an evaluation; evaluate a training task"
                )
            if self.evaluates.name == self.name:
                raise TaskError(f"the evaluation of {self.name!r} needs a name of its own")
            trains = [p.name for p in self.predicates if p.local_epochs]
            if trains:
                raise TaskError(
                    f"task {self.name!r} is an evaluation: it does not train, so {trains} cannot be judged; "
                    "use predicates over rounds such as accuracy_after_rounds or loss_after_rounds"
                )

    @property
    def kind(self) -> str:
        """``train``, or ``eval`` for a task made by :func:`evaluation_of`."""
        return "train" if self.evaluates is None else "eval"

    def build_plan(self, say: Callable[[str], None] | None = None) -> Plan:
        """The unversioned plan; ``say`` gets the line saying which output of an ONNX model with
        several the loss reads, where it was chosen (:func:`task_output`)."""
        if self.evaluates is not None:
            return self._evaluation_plan(say)
        if callable(self.model):
            plan = self.model(dict(self.hyperparameters))
            if not isinstance(plan, Plan):
                raise TaskError(f"task {self.name!r}: its model function returned {type(plan).__name__}, not a Plan")
            return dataclasses.replace(plan, name=self.name)
        return dataclasses.replace(onnx_import(self._model_source(), self, say=say).plan, name=self.name)

    def _model_source(self) -> Any:
        """The ONNX model as bytes or a loaded ModelProto: a path is loaded with its external data
        read from the model's folder (raw bytes would resolve it against the working directory)."""
        if isinstance(self.model, bytes):
            return self.model
        if callable(self.model):
            raise TaskError(f"task {self.name!r}: its model is a function that builds the plan, not an ONNX model")
        from emulator.toolchain.training import load_model

        try:
            return load_model(self.model)
        except FileNotFoundError:  # not the library's "pass ... its bytes, or a ModelProto"
            path = Path(self.model)
            relative = (
                "" if path.is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"
            )
            raise TaskError(
                f"task {self.name!r}: its model {os.fspath(path)!r} is no file{relative}; give the .onnx file's path, "
                "e.g. Path(__file__).parent / 'model.onnx' for one beside the task file"
            ) from None
        except (ValueError, OSError) as exc:  # PlanError is a ValueError
            raise TaskError(f"task {self.name!r}: {exc}") from None

    def _evaluation_plan(self, say: Callable[[str], None] | None = None) -> Plan:
        assert self.evaluates is not None
        trained = self.evaluates.build_plan()
        if callable(self.model):
            plan = self.model(dict(self.hyperparameters))
            if not isinstance(plan, Plan):
                raise TaskError(f"task {self.name!r}: its model function returned {type(plan).__name__}, not a Plan")
            if plan.kind == "train":
                from device_runtime import PlanError, build_eval_plan

                try:
                    plan = build_eval_plan(plan)
                except PlanError as exc:
                    raise TaskError(
                        f"task {self.name!r}: no evaluation twin of its training plan ({exc}); give the "
                        "evaluation a model function that returns an evaluation plan"
                    ) from None
            device = dataclasses.replace(plan.device, selector=self.selector, batch_size=self.batch_size)
            return dataclasses.replace(plan, name=self.name, device=device)
        from .evaluation import evaluation_plan_from_onnx

        model = self._model_source()
        output = task_output(self, model, say=say)
        try:
            return evaluation_plan_from_onnx(
                model,
                label=self.label,
                loss=self.loss,
                training_plan=trained,
                example_selector=self.selector,
                batch_size=self.batch_size,
                output=output,
                name=self.name,
            )
        except (TypeError, ValueError) as exc:
            raise TaskError(f"task {self.name!r}: no evaluation plan from its ONNX model: {exc}") from None

    def weights(self, plan: Plan) -> dict[str, np.ndarray]:
        """The initial model: the task's own function, else the ONNX model's initializers (and
        zeros for what they lack, such as optimizer state), else the builder's seeded init. An
        evaluation starts from its training task's initial model."""
        if self.evaluates is not None:
            trained = self.evaluates
            return trained.weights(trained.build_plan())
        if self.initial_weights is not None:
            return {k: np.asarray(v, dtype=np.float32) for k, v in self.initial_weights(plan).items()}
        if callable(self.model):
            from device_runtime import initial_weights

            return initial_weights(plan, seed=self.seed)
        from .training import initial_weights_from_onnx

        return initial_weights_from_onnx(self._model_source(), plan)

    def proxy_data(self) -> ProxyData:
        return self.proxy() if callable(self.proxy) else self.proxy

    @property
    def local_epochs(self) -> int:
        return max([1, *(p.local_epochs for p in self.predicates)])

    @property
    def simulated_rounds(self) -> int:
        return max([0, *(p.rounds for p in self.predicates)])


def task_output(task: Task, model: Any, *, say: Callable[[str], None] | None = None) -> str | None:
    """The tensor the loss of ``task``'s plan from the ONNX ``model`` reads, chosen as ``plan
    from-onnx`` chooses (:func:`onnx_output`): the task's ``output``, else the model's only output,
    else the only float one with a batch axis (``say`` gets a line saying so, the library saying
    nothing); several such, or an ``output`` that names no tensor of the model, are refused in one
    line listing the model's outputs. None where the model has one output or no float one (the
    plan's own refusal then says what to export)."""
    import onnx

    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, (bytes, bytearray, memoryview)):
            proto = onnx.ModelProto.FromString(bytes(model))
        else:
            proto = onnx.load(os.fspath(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - no ONNX model: the plan's own refusal says what it is
        return task.output
    try:
        output, line = onnx_output(proto, task.output, loss=task.loss, in_task=True)
    except TaskError as exc:
        raise TaskError(f"task {task.name!r}: {exc}") from None
    if line and say is not None:
        say(f"{task.name}: {line}")
    return output


def onnx_import(model: Any, task: Task, *, say: Callable[[str], None] | None = None) -> Any:
    """The task's :class:`~emulator.toolchain.OnnxTrainingPlan`: the plan and the tensors it trains,
    from the model output :func:`task_output` chooses (``say`` gets the line saying which)."""
    from .optimizers import SGD, Adam, Momentum
    from .training import onnx_training_plan

    hp = dict(task.hyperparameters)
    optimizers: dict[str, Callable[[], SGD | Momentum | Adam]] = {
        "sgd": lambda: SGD(hp.get("lr", 0.1)),
        "momentum": lambda: Momentum(hp.get("lr", 0.1), beta=hp.get("momentum", 0.9)),
        "adam": lambda: Adam(hp.get("lr", 0.001)),
    }
    if task.optimizer not in optimizers:
        raise TaskError(f"task {task.name!r}: optimizer {task.optimizer!r} is not one of {sorted(optimizers)}")
    server = {} if task.server_optimizer is None else {"server_optimizer": task.server_optimizer}
    output = task_output(task, model, say=say)
    try:
        return onnx_training_plan(
            model,
            trainable=None if task.trainable is None else list(task.trainable),
            frozen=list(task.frozen),
            frozen_rows=dict(task.frozen_rows),
            output=output,
            label=task.label,
            loss=task.loss,
            optimizer=optimizers[task.optimizer](),
            batch_size=task.batch_size,
            epochs=task.epochs,
            opset=task.opset,
            example_selector=task.selector,
            secure_aggregation=task.secure_aggregation,
            **server,
        )
    except (TypeError, ValueError) as exc:  # UnsupportedOpError and PlanError are ValueErrors
        raise TaskError(f"task {task.name!r}: no training plan from its ONNX model: {exc}") from None


def evaluation_of(
    task: Task,
    *,
    name: str | None = None,
    selector: ExampleSelector | None = None,
    batch_size: int | None = None,
    predicates: Sequence[Predicate] = (),
    rounds: RoundConfig | None = None,
    budget: Budget | None = None,
    runtimes: Sequence[str] | None = None,
    model: ModelSource | None = None,
    eligibility: EligibilityPolicies | None = None,
) -> Task:
    """An evaluation task for ``task``'s model, named ``<task>_eval`` by default; it reads
    ``selector``'s examples (default: the training task's) and claims the same runtimes and
    eligibility policies unless told otherwise. ``model`` replaces the plan source (a function
    returning an evaluation plan)."""
    if task.evaluates is not None:
        raise TaskError(f"task {task.name!r} is itself an evaluation; evaluate a training task")
    return dataclasses.replace(
        task,
        name=name or f"{task.name}_eval",
        model=task.model if model is None else model,
        selector=selector or task.selector,
        batch_size=batch_size or task.batch_size,
        epochs=1,
        predicates=tuple(predicates),
        rounds=rounds or task.rounds,
        budget=budget or task.budget,
        runtimes=tuple(runtimes) if runtimes is not None else task.runtimes,
        eligibility=task.eligibility if eligibility is None else eligibility,
        evaluates=task,
    )


@dataclass(frozen=True)
class TaskGroup:
    """Variants of one task over a grid of hyperparameters (every combination), each its own task
    named ``<name>-<key><value>-...``."""

    base: Task
    grid: Mapping[str, Sequence[Any]]

    def tasks(self) -> list[Task]:
        keys = sorted(self.grid)
        if not keys or any(not self.grid[k] for k in keys):
            raise TaskError(f"task group {self.base.name!r} needs at least one value for each grid key")
        variants = []
        for values in itertools.product(*(self.grid[k] for k in keys)):
            hp = {**self.base.hyperparameters, **dict(zip(keys, values))}
            suffix = "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in zip(keys, values))
            variants.append(dataclasses.replace(self.base, name=f"{self.base.name}-{suffix}", hyperparameters=hp))
        return variants


def load_tasks(path: str | Path) -> list[Task]:
    """The tasks a task file defines (``task``, or ``tasks``: a TaskGroup or a list of tasks)."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(
            f"task file {path} {'is a folder' if path.is_dir() else 'does not exist' + did_you_mean_path(path)}; "
            "give a task file's path"
        )
    # a file of another kind (a key, a text file, a data set) runs as Python and fails on its
    # content; without the .py of a task file, that is said first, not its NameError alone
    other = path.suffix.lower() != ".py"
    try:
        namespace = runpy.run_path(str(path), run_name="__fedfleet_task__")
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - the file is user code; say where it failed
        if other:
            raise TaskError(
                f"{path} is not a task file (Python, .py): it does not run as Python: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            ) from exc
        raise TaskError(f"task file {path} failed to run: {type(exc).__name__}: {exc}") from exc
    except SystemExit as exc:  # sys.exit() or argparse at the file's top level: the command ended there, as a success
        raise TaskError(
            f"task file {path} called sys.exit({exc.code!r}) while it was loaded; a task file defines `task` or "
            "`tasks` at its top level and runs nothing else there (put a script's part under "
            "`if __name__ == '__main__':`)"
        ) from None
    found = namespace.get("tasks", namespace.get("task"))
    if isinstance(found, Task):
        tasks = [found]
    elif isinstance(found, TaskGroup):
        tasks = found.tasks()
    elif isinstance(found, (list, tuple)) and found and all(isinstance(t, (Task, TaskGroup)) for t in found):
        tasks = [t for item in found for t in (item.tasks() if isinstance(item, TaskGroup) else [item])]
    else:
        raise TaskError(
            f"task file {path} defines no `task` (a Task) or `tasks` (a TaskGroup or a list of Task)"
            + (" (a task file is Python, named .py)" if other else "")
        )
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise TaskError(f"task file {path} defines two tasks with one name: {names}")
    for t in tasks:
        if t.evaluates is None:
            continue
        if t.evaluates.name not in names:
            raise TaskError(
                f"task file {path}: {t.name!r} evaluates {t.evaluates.name!r}, which the file does not list in "
                "`tasks`; list both, they are built, tested and deployed together"
            )
        claimed = {r.rsplit(".", 1)[0] for r in t.runtimes}
        uncovered = [r for r in t.evaluates.runtimes if r.rsplit(".", 1)[0] not in claimed]
        if uncovered:  # the server would refuse the pair: that release's devices could not evaluate
            raise TaskError(
                f"task file {path}: {t.name!r} does not claim onnxruntime {uncovered[0]}, which "
                f"{t.evaluates.name!r} claims; an evaluation claims every release of the task it measures"
            )
    return tasks
