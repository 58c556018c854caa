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
from typing import Any

import numpy as np

from device_runtime.plan import Plan
from emulator.releases.envs import KNOWN_RELEASES, measured_release
from example_store import ExampleSelector
from server_stub.errors import did_you_mean_path
from server_stub.rounds import RoundConfig
from server_stub.schemas import NAME_RULE, is_name

__all__ = [
    "Budget",
    "Predicate",
    "ProxyData",
    "Task",
    "TaskError",
    "TaskGroup",
    "Tolerance",
    "Trial",
    "accuracy_after_rounds",
    "evaluation_of",
    "load_tasks",
    "loss_after_rounds",
    "loss_decreases",
    "loss_is_finite",
    "measured_as",
    "predicate",
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
    # ONNX models: the tensor the loss reads (None: the model's first float output)
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

    def build_plan(self) -> Plan:
        """The unversioned plan."""
        if self.evaluates is not None:
            return self._evaluation_plan()
        if callable(self.model):
            plan = self.model(dict(self.hyperparameters))
            if not isinstance(plan, Plan):
                raise TaskError(f"task {self.name!r}: its model function returned {type(plan).__name__}, not a Plan")
            return dataclasses.replace(plan, name=self.name)
        return dataclasses.replace(plan_from_onnx(self._model_source(), self), name=self.name)

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

    def _evaluation_plan(self) -> Plan:
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

        try:
            return evaluation_plan_from_onnx(
                self._model_source(),
                label=self.label,
                loss=self.loss,
                training_plan=trained,
                example_selector=self.selector,
                batch_size=self.batch_size,
                output=self.output,
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


def plan_from_onnx(model: Any, task: Task) -> Plan:
    """A training plan from an ONNX inference model through the toolchain's autodiff."""
    return onnx_import(model, task).plan


def onnx_import(model: Any, task: Task) -> Any:
    """The task's :class:`~emulator.toolchain.OnnxTrainingPlan`: the plan and the tensors it trains."""
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
    try:
        return onnx_training_plan(
            model,
            trainable=None if task.trainable is None else list(task.trainable),
            frozen=list(task.frozen),
            frozen_rows=dict(task.frozen_rows),
            output=task.output,
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
) -> Task:
    """An evaluation task for ``task``'s model, named ``<task>_eval`` by default; it reads
    ``selector``'s examples (default: the training task's) and claims the same runtimes unless
    told otherwise. ``model`` replaces the plan source (a function returning an evaluation plan)."""
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
