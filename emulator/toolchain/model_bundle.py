"""An exported model to a bundle that ``plan test`` and ``deploy`` take (``plan from-onnx|from-torch -o DIR``).

A newcomer has a model file, not a task file. The bundle is what ``plan build`` writes for a task
file, plus the model and the task file itself, written here as a stub a person can read and edit::

    DIR/model.onnx (and model.onnx.data)   a copy of the model (external data kept beside it)
    DIR/task.py                             Task(model=model.onnx, label, loss, selector, ...)
    DIR/source.json, DIR/<task>/...         what ``fedfleet plan build DIR/task.py -o DIR`` writes

so ``plan build`` of the stub reproduces the plans, and ``plan test DIR`` / ``deploy DIR`` work on
it at once. The stub's proxy examples are random (``ProxyData.random``), with the model's input
shapes and labels of the loss's kind: they show that every claimed release loads the plan, runs
its steps and agrees with the reference, not that the model learns; the stub says so and where to
put real examples and predicates.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from device_runtime.executor import PlanExecutor
from device_runtime.plan import Plan
from example_store import ExampleSelector, InvalidArgumentError
from server_stub.rounds import MAX_TIMEOUT_S
from server_stub.schemas import NAME_RULE, is_name

from . import ml_ops
from .bundle import MANIFEST, SOURCE, TASK_FILE, build_bundle
from .onnx_import import EVAL_MODE_WARNING
from .tasks import DEFAULT_RUNTIMES, Task, TaskError, _np_dtype, check_known_releases, onnx_import, onnx_output

__all__ = ["ModelBundle", "bundle_from_onnx", "example_features", "task_stub"]

MODEL_FILE = "model.onnx"
MODEL_DATA = "model.onnx.data"
#: The first line of a stub: a directory whose task.py starts with it may be written over.
STUB_HEADER = '"""A task written by `fedfleet plan {command}`'
#: The size given to a dimension an exporter left symbolic, other than the batch's.
SYMBOLIC_DIM = 8


@dataclass(frozen=True)
class ModelBundle:
    """What a person should see of a bundle just written: where, what it reads, what it trains."""

    directory: Path
    task: str
    inputs: dict[str, tuple[str, tuple[Any, ...]]]  # example tensor -> (dtype, shape with the batch axis "N")
    label: str
    collection: str
    trainable: dict[str, tuple[int, ...]]
    split: dict[str, str]
    shared: dict[str, int]
    warnings: tuple[str, ...]
    frozen_rows: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # rows no gradient reaches


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in vi.type.tensor_type.shape.dim]


def example_features(
    model: onnx.ModelProto | str | Path, plan: Plan, *, label: str, loss: str, output: str | None = None
) -> tuple[dict[str, tuple], str | None]:
    """Random-example specs for ``ProxyData.random``: each example tensor the plan reads, its dtype
    and one example's shape (a symbolic dimension other than the batch's gets ``SYMBOLIC_DIM``;
    integers are drawn below the rows of the tables they index, a token id's vocabulary, else from
    [0, 2), a valid mask or type id of any model), and the label's, read from the model's prediction
    on two such examples (class ids below the number of classes for ``cross_entropy``, 0/1 for
    ``binary_cross_entropy``). Returns the specs and, when the
    model does not run on random examples, why (the label's spec is then a guess to edit)."""
    work = onnx.ModelProto.FromString(plan.work)
    by_name = {vi.name: vi for vi in work.graph.input}
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    bounds = index_bounds(proto.graph)
    features: dict[str, tuple] = {}
    label_input = None
    for graph_input, example in plan.device.inputs.items():
        if example == label:
            label_input = by_name[graph_input]
            continue
        vi = by_name[graph_input]
        shape = tuple(d if isinstance(d, int) and d > 0 else SYMBOLIC_DIM for d in _dims(vi)[1:])
        dtype = _np_dtype(vi.type.tensor_type.elem_type)
        whole = not np.issubdtype(np.dtype(dtype), np.floating) and dtype != "bool"
        features[example] = (dtype, shape, bounds.get(graph_input, 2)) if whole else (dtype, shape)
    assert label_input is not None
    label_dtype = _np_dtype(label_input.type.tensor_type.elem_type)
    try:
        prediction = _prediction_shape(model, plan, features, output)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises many kinds; the stub is still written
        guess = tuple(d if isinstance(d, int) and d > 0 else SYMBOLIC_DIM for d in _dims(label_input)[1:])
        features[label] = (label_dtype, guess, 2)
        return features, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if loss == "cross_entropy":
        features[label] = (label_dtype, prediction[:-1], prediction[-1])
    elif loss == "binary_cross_entropy":
        features[label] = (label_dtype, prediction, 2)
    else:
        features[label] = (label_dtype, prediction)
    return features, None


#: ops an integer input goes through unchanged on its way to a Gather's indices
_INDEX_PASSTHROUGH = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand"})
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT32, onnx.TensorProto.INT64})


def index_bounds(graph: onnx.GraphProto) -> dict[str, int]:
    """The integer graph inputs that index Gathers from initializers (token ids into an embedding),
    each with the fewest rows of those tables: random examples drawn below it reach every row, where
    [0, 2) tried a language model on two tokens. An input no such Gather reads (a mask) is left out;
    other uses of one that is (its shape, a comparison with the padding id) take any valid id."""
    tables = {t.name: list(t.dims) for t in graph.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))

    def rows(name: str, depth: int = 0) -> int | None:
        found: list[int] = []
        for node, i in uses.get(name, []) if depth <= 16 else []:
            if node.op_type == "Gather" and i == 1 and node.input[0] in tables:
                table = tables[node.input[0]]
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if -len(table) <= axis < len(table) and table[axis] >= 1:
                    found.append(table[axis])
            elif node.op_type in _INDEX_PASSTHROUGH and i == 0 and (n := rows(node.output[0], depth + 1)):
                found.append(n)
        return min(found, default=None)

    return {
        vi.name: n
        for vi in graph.input
        if vi.type.tensor_type.elem_type in _INTEGER_TYPES and (n := rows(vi.name)) is not None
    }


def _prediction_shape(
    model: onnx.ModelProto | str | Path, plan: Plan, features: Mapping[str, tuple], output: str | None = None
) -> tuple[int, ...]:
    """One example's shape of ``output``, default the model's first float output (the tensor the
    plan's loss reads)."""
    import onnxruntime as ort

    from .forward import is_float

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)  # a path reads its data
    if any(n.domain == ml_ops.ML_DOMAIN for n in proto.graph.node):  # ZipMap's probabilities as the tensor a plan reads
        proto = onnx.ModelProto.FromString(proto.SerializeToString())
        ml_ops.standard_form(proto)
        source = proto.SerializeToString()
    if output is not None and output not in {o.name for o in proto.graph.output}:  # a tensor inside the graph
        proto = onnx.ModelProto.FromString(proto.SerializeToString())
        if not isinstance(model, onnx.ModelProto):
            onnx.load_external_data_for_model(proto, str(Path(model).parent))
        proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(output))
        source = proto.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # an exporter's unused initializers are not the person's concern here
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    outputs = [o for o in proto.graph.output if is_float(o.type.tensor_type.elem_type)]
    examples = _two_examples(features)
    feeds = {g: examples[e] for g, e in plan.device.inputs.items() if e in examples}
    for vi in proto.graph.input:  # a batch fixed at export: the Model Zoo's files take one example, torch's default 2+
        dims = vi.type.tensor_type.shape.dim
        if vi.name in feeds and len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            feeds[vi.name] = np.take(feeds[vi.name], np.arange(dims[0].dim_value) % len(feeds[vi.name]), axis=0)
    (value,) = session.run([output or outputs[0].name], feeds)
    return tuple(int(d) for d in np.shape(value)[1:])


def _two_examples(features: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    from .tasks import ProxyData

    shard = ProxyData.random(features, examples=4, devices=1).shards[0]
    return {k: np.asarray(v)[:2] for k, v in shard.items()}


#: The report window of a stub's rounds: ``REPORT_BASE_S`` and ``REPORT_S_PER_MIB`` seconds for each
#: MiB of the checkpoint, which a device downloads, trains and sends back as its update (as large): a
#: device on a link of 1 MiB/s each way takes 2 s a MiB for the transfers, and a step of a model of
#: that size about 1 s more. The default 60 s turned away every report of a ResNet-50 (98 MiB) as
#: late: a device's session of one step took 70 to 110 s on a busy machine (docs/howto/big-models.md).
REPORT_BASE_S = 60.0
REPORT_S_PER_MIB = 3.0


def report_timeout_for(checkpoint_bytes: int) -> float:
    """The report window (``RoundConfig.report_timeout_s``) a stub sets for a checkpoint of
    ``checkpoint_bytes``: whole seconds, at least the default 60 s, at most ``MAX_TIMEOUT_S``."""
    seconds = REPORT_BASE_S + REPORT_S_PER_MIB * checkpoint_bytes / (1 << 20)
    return float(min(math.ceil(seconds), MAX_TIMEOUT_S))


def task_stub(
    *,
    command: str,
    name: str,
    features: Mapping[str, tuple],
    label: str,
    loss: str,
    optimizer: str,
    hyperparameters: Mapping[str, Any],
    collection: str,
    batch_size: int,
    epochs: int,
    opset: int,
    trainable: Sequence[str] | None,
    frozen: Sequence[str],
    runtimes: Sequence[str],
    note: str = "",
    frozen_rows: Mapping[str, Sequence[int]] | None = None,
    output: str | None = None,
    checkpoint_bytes: int = 0,
) -> str:
    """The task file of a bundle, as the Task API takes it (every value a Python literal); its
    rounds' report window grows with the checkpoint (``report_timeout_for``)."""
    rows_line = (
        f"\n    frozen_rows={ {w: tuple(r) for w, r in frozen_rows.items()}!r},  # padding rows: no gradient"
        if frozen_rows
        else ""
    )
    output_line = f"\n    output={output!r},  # the model output the loss reads" if output is not None else ""
    rows = "".join(f"    {k!r}: {tuple(v)!r},\n" for k, v in features.items())
    guess = (
        f"\n# The model did not run on random examples ({note}): the label's entry is a guess; correct it.\n"
        if note
        else ""
    )
    return f'''{STUB_HEADER.format(command=command)} for {MODEL_FILE}: edit it, then build again with
`fedfleet plan build task.py -o DIR`, test with `fedfleet plan test DIR --signing-key KEY` and send with
`fedfleet deploy DIR --server URL --population P`.

The proxy examples are random, with the model's input shapes and labels of the loss's kind: the release
tests then show that every claimed onnxruntime release loads the plan, runs its steps with a finite loss and
agrees with the reference run, not that the model learns. Give real examples (``ProxyData.split({{"x": ..., "y": ...}},
devices=4)``) and predicates (``loss_decreases(epochs=3)``, ``accuracy_after_rounds(rounds=4,
at_least=0.8)``) to test that, a ``Budget`` for what devices give a session, ``EligibilityPolicies`` (from
``device_runtime``: the examples a device needs, how often it may join) and a ``RoundConfig``.
"""

from pathlib import Path

from emulator.toolchain.tasks import ProxyData, Task, loss_is_finite
from example_store import ExampleSelector
from server_stub import RoundConfig

MODEL = Path(__file__).with_name({MODEL_FILE!r})
# One example's tensors: dtype, shape without the batch axis, and for whole numbers the bound of the
# values drawn, [0, high): the number of classes of a cross-entropy label, the rows of the embedding a
# token id indexes.{guess}
EXAMPLES = {{
{rows}}}


def proxy():
    return ProxyData.random(EXAMPLES, examples=64, devices=2, seed=0)


task = Task(
    name={name!r},
    model=MODEL,
    proxy=proxy,
    predicates=(loss_is_finite(),),
    label={label!r},{output_line}
    loss={loss!r},
    optimizer={optimizer!r},
    hyperparameters={dict(hyperparameters)!r},
    selector=ExampleSelector({collection!r}),
    batch_size={batch_size!r},
    epochs={epochs!r},
    opset={opset!r},
    trainable={None if trainable is None else tuple(trainable)!r},
    frozen={tuple(frozen)!r},{rows_line}
    runtimes={tuple(runtimes)!r},
    # a device downloads the checkpoint ({checkpoint_bytes / (1 << 20):,.1f} MiB), trains and sends its update in this window
    rounds=RoundConfig(report_timeout_s={report_timeout_for(checkpoint_bytes)!r}),
)
'''


def _weight_bytes(plan: Plan) -> int:
    """The bytes of the plan's weights: what its checkpoint carries, less a few bytes a name."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in PlanExecutor(plan).weight_spec().values())


def _prepare(out: Path, command: str, keep: Path) -> None:
    """Make ``out`` ready: new, empty, or a bundle a from-command wrote (its own files are removed,
    so a task renamed since leaves nothing behind); anything else is refused."""
    if out.exists() and not out.is_dir():
        raise TaskError(
            f"{out} is a file; give a directory for the bundle (or a path ending in .fedplan for the plan alone)"
        )
    if out.is_dir() and any(out.iterdir()):
        stub = out / TASK_FILE
        head = stub.read_text(encoding="utf-8", errors="replace")[:80] if stub.is_file() else ""
        if not head.startswith(STUB_HEADER.split("{")[0]):
            raise TaskError(
                f"{out} is a directory that `plan from-onnx` or `plan from-torch` did not write; give a new "
                "or empty directory"
            )
        for child in out.iterdir():
            if child.is_dir() and (child / MANIFEST).is_file():
                shutil.rmtree(child)
            elif child.name in (TASK_FILE, SOURCE, MODEL_FILE, MODEL_DATA) and child.resolve() != keep.resolve():
                child.unlink()  # (not the model given, when it is the bundle's own: from-onnx DIR/model.onnx -o DIR)
    out.mkdir(parents=True, exist_ok=True)


def _copy_model(source: Path, loaded: onnx.ModelProto, out: Path) -> Path:
    """The model into ``out/model.onnx``: the file as it is, or, when it keeps its weights in
    external data, with them in ``model.onnx.data`` beside it."""
    target = out / MODEL_FILE
    from .training import _external_tensors

    if not _external_tensors(onnx.load(str(source), load_external_data=False)):
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        return target
    onnx.save_model(
        loaded,
        str(target),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=MODEL_DATA,
        size_threshold=0,
    )
    return target


def bundle_from_onnx(
    model: str | Path,
    out: str | Path,
    *,
    label: str,
    loss: str = "cross_entropy",
    optimizer: str = "sgd",
    lr: float = 0.1,
    batch_size: int = 32,
    epochs: int = 1,
    opset: int = 21,
    collection: str = "app:/examples",
    trainable: Sequence[str] | None = None,
    frozen: Sequence[str] = (),
    frozen_rows: Mapping[str, Sequence[int]] | None = None,
    runtimes: Sequence[str] | None = None,
    name: str | None = None,
    output: str | None = None,
    command: str = "from-onnx",
    say: Callable[[str], None] = lambda _m: None,
) -> ModelBundle:
    """Write the bundle of the ONNX model at ``model`` into ``out`` (see the module docstring):
    the plan is made first, so a model that cannot become one leaves nothing behind. ``output``
    names the graph output the loss reads, or a tensor inside the graph (the logits of a classifier
    exported with its ``ArgMax``), which the stub's label is drawn over; a model with several
    takes the only float one with a batch axis (and ``say`` says so), and is refused where it has
    more (:func:`~emulator.toolchain.tasks.loss_output`)."""
    model, out = Path(model), Path(out)
    if name is None and not is_name(model.stem):
        raise TaskError(f"the model file's name {model.stem!r} is no task name ({NAME_RULE}); give one with --name")
    name = name or model.stem
    try:
        selector = ExampleSelector(collection)
    except InvalidArgumentError as exc:
        raise TaskError(f"collection {collection!r} refused: {exc}") from None
    runtimes = tuple(runtimes or DEFAULT_RUNTIMES)
    hyperparameters = {"lr": lr}
    task = Task(
        name=name,
        model=model,
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        loss=loss,
        optimizer=optimizer,
        hyperparameters=hyperparameters,
        label=label,
        selector=selector,
        batch_size=batch_size,
        epochs=epochs,
        opset=opset,
        trainable=None if trainable is None else tuple(trainable),
        frozen=tuple(frozen),
        frozen_rows={w: tuple(r) for w, r in (frozen_rows or {}).items()},
        runtimes=runtimes,
    )
    check_known_releases(task)  # as build_bundle will, before anything is written
    loaded = task._model_source()
    output, chosen = onnx_output(loaded, output, loss=loss)
    if chosen:
        say(chosen)
    task = dataclasses.replace(task, output=output)
    made = onnx_import(loaded, task)
    plan = dataclasses.replace(made.plan, name=name)
    features, failed = example_features(model, plan, label=label, loss=loss, output=output)
    _prepare(out, command, keep=model)
    _copy_model(model, loaded, out)
    stub = task_stub(
        command=command,
        name=name,
        features=features,
        label=label,
        loss=loss,
        optimizer=optimizer,
        hyperparameters=hyperparameters,
        collection=collection,
        batch_size=batch_size,
        epochs=epochs,
        opset=opset,
        trainable=trainable,
        frozen=frozen,
        runtimes=runtimes,
        note=failed or "",
        frozen_rows=frozen_rows,
        output=output,
        checkpoint_bytes=_weight_bytes(plan),
    )
    (out / TASK_FILE).write_text(stub, encoding="utf-8")
    build_bundle(out / TASK_FILE, out, say=say)
    warnings = made.warnings
    if command == "from-torch":  # its own export keeps training mode: no BatchNorm was folded
        warnings = tuple(w for w in warnings if w != EVAL_MODE_WARNING)
    if failed:
        warnings += (
            f"the model did not run on random examples ({failed}); the label's entry of EXAMPLES in "
            f"{out / TASK_FILE} is a guess: correct it before `plan test`",
        )
    inputs = {
        features_name: (spec[0], ("N", *spec[1])) for features_name, spec in features.items() if features_name != label
    }
    return ModelBundle(
        out, name, inputs, label, collection, made.trainable, made.split, made.shared, warnings, dict(task.frozen_rows)
    )
