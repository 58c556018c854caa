"""A trained checkpoint back into the ONNX inference model its bundle was made from (``fedfleet model --onnx``).

A bundle of ``plan from-onnx`` or ``plan from-torch`` keeps the model as it came (``DIR/model.onnx``);
its plan trains the model's initializers under their own names, except where the toolchain gave a
parameter an initializer of its own first: a parameter an exporter merged with an equal-valued one
(``split_deduplicated``: read through an ``Identity``, or named in the dynamo exporter's node
metadata) trains as its own weight, and a tied weight whose transpose the exporter folded into a
constant is read through a ``Transpose`` again (``refold_tied_transposes``). Writing the trained
values into the model as it came would give each merged pair one value, and leave a folded
transpose at its initial value. So the model is read into the same form the plan was made from
(:func:`~emulator.toolchain.training.as_trained`, the steps ``read_model`` takes), in its inference
form (a train-mode export's Dropout and BatchNormalization as evaluation runs them), and each
initializer the checkpoint holds takes its trained value; frozen and untrained initializers keep
theirs, and the optimizer's state is left out. A dilated ``Conv`` of ``SAME`` padding, which
onnxruntime refuses to run, gets the pads it stands for, as in the plan. The graph's inputs,
outputs and opset are the model's own: ``onnxruntime.InferenceSession`` runs the app's inference
on the trained weights.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from device_runtime.executor import PlanExecutor
from device_runtime.plan import PlanError, load_plan

from . import onnx_import
from .bundle import MANIFEST
from .model_bundle import MODEL_FILE
from .tasks import TaskError
from .training import as_trained

__all__ = ["TrainedModel", "trained_onnx", "write_trained_onnx"]

#: Above this many bytes of initializers the model is written with its weights in ``FILE.data``
#: beside it (protobuf refuses a message over 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30
#: The suffix of that file's name (``FILE.onnx.data``).
DATA_SUFFIX = "data"


@dataclass(frozen=True)
class TrainedModel:
    """What went into the model: the task whose plan it was, the initializers that took a trained
    value (split copies among them) and how many kept theirs."""

    task: str
    trained: tuple[str, ...]
    split: dict[str, str]  # a split copy -> the initializer the exporter had merged it into
    unchanged: int


def _bundle_plan(bundle: Path, task: str | None):
    """The bundle's training plan: of ``task`` where the bundle has it, else its only training task's."""
    plans = {}
    for manifest_path in sorted(bundle.glob(f"*/{MANIFEST}")):
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            plan = load_plan((manifest_path.parent / manifest["plan"]["file"]).read_bytes())
        except (OSError, ValueError, KeyError, TypeError, PlanError) as exc:
            raise TaskError(f"{manifest_path.parent}: its plan does not read ({exc}); build the bundle again") from None
        if plan.kind == "train":
            plans[str(manifest.get("task", manifest_path.parent.name))] = plan
    if not plans:
        raise TaskError(f"{bundle} holds no built training task; give the folder `plan from-onnx -o DIR` wrote")
    if task is not None and task in plans:
        return task, plans[task]
    if len(plans) == 1:
        return next(iter(plans.items()))
    raise TaskError(f"{bundle} has the tasks {', '.join(plans)}; give --task with the one the model is of")


def trained_onnx(
    bundle: str | Path, weights: Mapping[str, np.ndarray], *, task: str | None = None
) -> tuple[onnx.ModelProto, TrainedModel]:
    """The bundle's model with ``weights`` (a checkpoint of its plan) in place of its initializers."""
    bundle = Path(bundle)
    source = bundle / MODEL_FILE
    if not source.is_file():
        raise TaskError(
            f"{bundle} has no {MODEL_FILE}: --onnx takes a bundle folder `plan from-onnx` or `plan from-torch` wrote "
            "(a task file's bundle keeps no ONNX model of its own)"
        )
    name, plan = _bundle_plan(bundle, task)
    spec = PlanExecutor(plan).weight_spec()
    missing = [w for w in plan.weight_names if w not in weights]
    wrong = [
        f"{w} {tuple(np.shape(weights[w]))}"
        for w in plan.weight_names
        if w in weights and tuple(np.shape(weights[w])) != tuple(spec[w][0])
    ]
    typed = [
        f"{w} of {np.asarray(weights[w]).dtype}"
        for w in plan.weight_names
        if w in weights and np.asarray(weights[w]).dtype != spec[w][1]
    ]
    if missing or wrong or typed:
        said = (
            f"lacks {', '.join(missing[:4])}"
            if missing
            else f"has {', '.join(wrong[:4])} of another shape"
            if wrong
            else f"has {', '.join(typed[:4])}, where the plan trains another type"
        )
        raise TaskError(
            f"the model does not fit task {name} of {bundle}: it {said}; give the bundle the task was deployed from"
        )
    try:
        model = onnx.load(str(source))  # with its external data, read beside it
    except (OSError, ValueError, DecodeError, onnx.checker.ValidationError) as exc:
        raise TaskError(
            f"{source} does not read as an ONNX model ({str(exc).splitlines()[0][:200]}): put back the model the "
            "bundle was made from, with its data file, or build the bundle again"
        ) from None
    split = as_trained(model)
    onnx_import.inference_form(model)
    onnx_import.dilated_same_padding_written_out(model)  # else onnxruntime refuses the model's first run
    trained: list[str] = []
    kept = 0
    for i, init in enumerate(model.graph.initializer):
        if init.name in weights and init.name in plan.weight_names:
            if tuple(init.dims) != tuple(np.shape(weights[init.name])):  # else reshaped into it, a transposed weight
                raise TaskError(
                    f"{source}'s initializer {init.name} is {tuple(init.dims)}, the trained one "
                    f"{tuple(np.shape(weights[init.name]))}: the plan was not made from this model as it is; put back "
                    "the model the bundle was made from"
                )
            dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
            value = np.asarray(weights[init.name]).astype(dtype).reshape(tuple(init.dims))
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, init.name))
            trained.append(init.name)
        else:
            kept += 1
    unplaced = [w for w in plan.weight_names if w not in trained and not _optimizer_state(w, trained)]
    if unplaced:
        raise TaskError(
            f"{source} has no initializer for the trained {', '.join(unplaced[:4])}"
            f"{' and more' if len(unplaced) > 4 else ''}: the plan was not made from this model as it is "
            "(an ai.onnx.ml model's coefficients, a weight inside a Loop); use the checkpoint with the plan"
        )
    return model, TrainedModel(name, tuple(trained), {c: o for c, o in split.items() if c in trained}, kept)


def _optimizer_state(name: str, trained: list[str]) -> bool:
    """A weight of the plan that is the optimizer's state (``w.momentum``, ``w.adam_m``, ``adam_step``),
    not the model's."""
    base, _, slot = name.rpartition(".")
    return (base in trained and slot.split("_")[0] in ("momentum", "adam")) or name.split("_")[:2] == ["adam", "step"]


def write_trained_onnx(
    bundle: str | Path, weights: Mapping[str, np.ndarray], out: str | Path, *, task: str | None = None
) -> TrainedModel:
    """:func:`trained_onnx` written to ``out`` (written aside and renamed into place); a large model's
    tensors to ``out.data`` beside it, written aside too: onnx appends them to a file of that name,
    and an earlier export's data file grew by the whole model each time it was written again."""
    model, made = trained_onnx(bundle, weights, task=task)
    out = Path(out)
    aside = out.with_name(f".{out.name}.part")
    large = sum(np.prod(i.dims, dtype=np.int64) * 4 for i in model.graph.initializer) > EXTERNAL_DATA_BYTES
    try:
        if large:
            aside.mkdir()
            onnx_import.save_onnx(model, aside / out.name, data_file=f"{out.name}.{DATA_SUFFIX}")
            os.replace(aside / f"{out.name}.{DATA_SUFFIX}", out.with_name(f"{out.name}.{DATA_SUFFIX}"))
            os.replace(aside / out.name, out)
        else:
            aside.write_bytes(model.SerializeToString())
            os.replace(aside, out)
    finally:
        if aside.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
    return made
