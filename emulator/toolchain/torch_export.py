"""A PyTorch module to a deployable bundle in one step (``fedfleet plan from-torch``, :func:`from_torch`).

torch is an optional extra (``pip install 'fedfleet[torch]'``): it is needed to export a model, not
to run plans, so it is imported only here and only when called.

How the module is exported, and why (measured with torch 2.13 on a CNN with BatchNorm, Dropout,
LayerNorm and zero biases, comparing one SGD step of the plan with torch autograd's):

* the dynamo exporter (``dynamo=True``, torch's default since 2.9; the classic TorchScript one is
  deprecated) with ``optimize=False``: its default optimizer merges parameters of equal values (two
  fresh LayerNorms' gains become one weight), drops zero biases and, in train mode, dropped a
  BatchNorm layer entirely; without it every parameter and running statistic keeps its own
  initializer under its ``state_dict`` name, and the plan's step matches torch's to 2e-7;
* the module in train mode, so that ``Dropout`` is exported (an eval-mode export leaves an
  ``Identity``) and ``BatchNormalization`` is kept with its running statistics (not folded into
  the convolution); the file is then made an inference model again (``Dropout`` inactive, as
  evaluation plans and other runtimes read it), which the training plan rewrites for training;
* a dynamic batch axis on every input (the last batch of an epoch is short), traced at batch 2, in
  the structure of ``forward``'s signature (one tuple for ``*inputs``: :func:`dynamic_batch`); of a
  forward returning several values (a transformers model's output, holding its key-value cache;
  GoogLeNet's auxiliary logits), the one the loss reads alone, chosen as :func:`export_torch` says;
* the module's own weights and buffers as the initial checkpoint: its state is restored after the
  export and written over any initializer of the same name, so nothing the tracing ran moves the
  running statistics (the classic exporter's train-mode trace updated them by one batch);
* where torch.export cannot trace the module, the classic exporter in training mode (``notes``
  says so), and what the export drops read from the module: each ``nn.Embedding``'s
  ``padding_idx`` row (``padding_rows``: no gradient there, as in torch), the float buffers torch
  never trains (``constant_buffers``) and the parameters whose ``requires_grad`` is off
  (``untrained_parameters``): frozen;
* each ``nn.EmbeddingBag`` given one bag per row traced as its rows gathered and reduced
  (:func:`_bags_as_embeddings`), where both exporters write a ``Loop`` over the bags that a plan
  cannot unroll with the batch dynamic;
* the file held to the module: run in onnxruntime on random examples and compared with the
  module's outputs in eval mode (:func:`export_mismatch`), a note where an exporter traced something else.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from server_stub.errors import install_hint

from .model_bundle import ModelBundle, bundle_from_onnx
from .onnx_import import inference_form, save_onnx
from .tasks import NamedOutput, TaskError, loss_output

__all__ = [
    "TorchInput",
    "constant_buffers",
    "dynamic_batch",
    "export_mismatch",
    "export_torch",
    "forward_choice",
    "forward_outputs",
    "from_torch",
    "load_factory",
    "padding_rows",
    "parse_input",
    "untrained_parameters",
]

INSTALL_HINT = f"{install_hint('torch')}; torch is needed to export a model, not to run plans"
#: The batch size the module is traced at: 0 and 1 would be specialized by torch.export.
TRACE_BATCH = 2


@dataclass(frozen=True)
class TorchInput:
    """One argument of the module's ``forward``: its name in the plan, one example's shape without
    the batch axis, and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


def parse_input(spec: str) -> TorchInput:
    """``NAME:SHAPE[:DTYPE]``, SHAPE one example's dims joined by ``x`` (``1x28x28``; empty for one
    value per example), DTYPE a numpy name (default ``float32``)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise TaskError(f"--input {spec!r} is not NAME:SHAPE[:DTYPE]; e.g. x:1x28x28 or tokens:16:int64")
    name, shape_text, dtype = parts[0], parts[1], parts[2] if len(parts) == 3 else "float32"
    try:
        shape = tuple(int(d) for d in shape_text.split("x")) if shape_text else ()
        np.dtype(dtype)
    except (ValueError, TypeError):
        raise TaskError(
            f"--input {spec!r}: SHAPE is whole numbers joined by x (1x28x28) and DTYPE a dtype such as "
            "float32, int64 or bool"
        ) from None
    if any(d < 1 for d in shape):
        raise TaskError(f"--input {spec!r}: every dimension must be at least 1 (the batch axis is not given)")
    return TorchInput(name, shape, np.dtype(dtype).name)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise TaskError(f"exporting a PyTorch module needs torch, which is not installed: {INSTALL_HINT}") from None
    if importlib.util.find_spec("onnxscript") is None:  # the dynamo exporter's
        raise TaskError(f"exporting a PyTorch module needs onnxscript, which is not installed: {INSTALL_HINT}")
    return torch


def load_factory(spec: str) -> Callable[[], Any]:
    """``MODULE:FACTORY``: a module path (importable from the working directory) or a ``.py``
    file, and the function in it that returns the ``nn.Module``."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise TaskError(f"{spec!r} is not MODULE:FACTORY (e.g. mymodels:make_cnn or models.py:make_cnn)")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise TaskError(f"{spec}: no file {path}")
            loader = importlib.util.spec_from_file_location(f"_fedfleet_factory_{path.stem}", path)
            assert loader is not None and loader.loader is not None
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` would find it
            try:
                module = importlib.import_module(where)
            finally:
                sys.path.remove(str(Path.cwd()))
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: say where it failed
        raise TaskError(f"{spec}: importing {where} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"{spec}: {where} has no function {attr!r}")
    return factory


def _example(torch: Any, spec: TorchInput) -> Any:
    shape = (TRACE_BATCH, *spec.shape)
    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def _check_example(torch: Any, spec: TorchInput) -> Any:
    """An example batch to hold the exported model to the module on: another batch size than the
    trace's (a size the export baked in shows), and values that vary (the trace's zeros of integer
    inputs mask every token of an attention mask): 0 or 1 for integers, valid for any vocabulary."""
    generator = torch.Generator().manual_seed(1)
    shape = (TRACE_BATCH + 1, *spec.shape)
    dtype = getattr(torch, spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 2, shape, generator=generator).to(dtype)


#: torch's exporter logs a warning for each torchvision operator it cannot register when torchvision
#: is not installed, which a model without them does not need to hear of.
REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The logger ``name`` at ERROR for the block, as it was after."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _bags_as_embeddings(torch: Any, module: Any) -> Iterator[None]:
    """Each ``nn.EmbeddingBag`` of ``module`` (without ``max_norm``) traced, for the block, as the
    rows of its bags gathered and summed, averaged or maximized over each bag's axis when its
    input is one bag per row (2-D, no ``offsets``): the same values and gradient, where both
    exporters write a ``Loop`` over the bags, which a plan cannot unroll with the batch known only at
    run time. ``padding_idx`` entries are left out of a bag (its mean divides by the others, an
    empty bag gives zeros), and ``per_sample_weights`` scale the rows of a sum, as torch does."""
    functional = torch.nn.functional
    patched = []

    def as_embedding(bag: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(input: Any, offsets: Any = None, per_sample_weights: Any = None) -> Any:
            if offsets is not None or input.dim() != 2:
                return original(input, offsets, per_sample_weights)
            rows = functional.embedding(input, bag.weight)  # [bags, bag size, dim]
            if per_sample_weights is not None:
                rows = rows * per_sample_weights.unsqueeze(-1)
            keep = None if bag.padding_idx is None else (input != bag.padding_idx).unsqueeze(-1)
            if bag.mode == "max":
                if keep is None:
                    return rows.amax(1)
                largest = rows.masked_fill(~keep, float("-inf")).amax(1)
                return torch.where(keep.any(1), largest, torch.zeros_like(largest))
            if keep is not None:
                rows = rows * keep.to(rows.dtype)
            total = rows.sum(1)
            if bag.mode == "sum":
                return total
            count = keep.sum(1).clamp(min=1) if keep is not None else input.shape[1]
            return total / count

        return forward

    for sub in module.modules():
        if isinstance(sub, torch.nn.EmbeddingBag) and sub.max_norm is None and "forward" not in vars(sub):
            sub.forward = as_embedding(sub, sub.forward)
            patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub.forward


#: The classic exporter's opset when the dynamo one failed: its newest that onnx converts from.
CLASSIC_OPSET = 20

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _refuse_misexported(torch: Any, module: Any) -> None:
    """Modules torch's exporters write as a graph that computes something else or does not load:
    refused before the export, naming the module and the way round it."""
    for name, sub in module.named_modules():
        kind = type(sub).__name__.removeprefix("Parametrized")  # a parametrized nn.Linear's class
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.max_norm is not None:
            raise TaskError(
                f"nn.{kind} {name or 'the module'!r} has max_norm={sub.max_norm:g}, which renormalizes the rows "
                "forward reads in the weight itself, in place, and torch's exporters write no training step of it (the "
                "dynamo exporter reads the weight through a detach, so a plan would not train it; the classic one "
                "leaves the renormalization out): give it max_norm=None, and to keep the rows short scale them in "
                "forward, rows * (max_norm / rows.norm(dim=-1, keepdim=True)).clamp(max=1)"
            )
        if isinstance(sub, torch.nn.Embedding) and sub.scale_grad_by_freq:
            raise TaskError(
                f"nn.Embedding {name or 'the module'!r} has scale_grad_by_freq=True, which divides each row's "
                "gradient by how often the batch reads it, and torch's exporters write no gradient (the dynamo "
                "exporter leaves it out, so a plan would take another step, the classic one refuses it): give it "
                "scale_grad_by_freq=False"
            )
        normed = [p for p, ps in getattr(sub, "parametrizations", {}).items() if _spectral(ps)] + [
            hook.name for hook in sub._forward_pre_hooks.values() if type(hook).__name__ == "SpectralNorm"
        ]
        if normed:
            raise TaskError(
                f"{name or 'the module'!r} ({kind}) has spectral_norm on its {normed[0]}, whose power iteration moves its "
                "_u and _v in place at each training forward, which torch's exporters write no step of (the plan's "
                "step would not be torch's): remove it (torch.nn.utils.parametrize.remove_parametrizations, or "
                "remove_spectral_norm of the older hook), or "
                "constrain the weight with a parametrization a plan trains (weight_norm)"
            )
        if isinstance(sub, torch.nn.LSTM) and sub.proj_size > 0:
            raise TaskError(
                f"nn.LSTM {name or 'the module'!r} has proj_size={sub.proj_size}, which torch's exporters do not "
                "write right (the dynamo exporter leaves out its weight_hr, the classic one refuses it): give it proj_size=0, and an nn.Linear after it if its outputs must be "
                f"{sub.proj_size} wide (that projects its outputs, not its recurrent state)"
            )


def _spectral(parametrizations: Any) -> bool:
    return any(type(p).__name__ == "_SpectralNorm" for p in parametrizations)


def export_failure(exc: BaseException) -> str:
    """One line for a failed ``torch.onnx.export``: the innermost cause's first line (the dynamo
    exporter wraps what failed in an error whose first line only says which of its steps it was),
    without terminal colours, and the way round it that keeps training mode."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = _ANSI.sub("", str(root)).strip()
    first = text.splitlines()[0][:300] if text else ""
    return (
        f"torch.onnx.export failed: {type(root).__name__}: {first}; export the module yourself in training mode "
        "(torch.onnx.export(model.train(), args, 'model.onnx', dynamo=False, "
        "training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)) and run `fedfleet plan from-onnx` on it"
    )


def forward_failure(exc: BaseException, inputs: Sequence[TorchInput]) -> str:
    """One line for a module whose forward fails on the examples of ``--input``: no exporter can
    trace it then, so the inputs are what to change."""
    text = _ANSI.sub("", str(exc)).strip()
    first = text.splitlines()[0][:300] if text else ""
    given = ", ".join(f"{s.name} {[TRACE_BATCH, *s.shape]} {s.dtype}" for s in inputs)
    return (
        f"the module's forward failed on the --input examples ({given}): {type(exc).__name__}: {first}; give one "
        "--input per argument of forward, in order, each with one example's shape (without the batch axis) and dtype"
    )


#: how far the exported model's outputs may lie from the module's, over the largest of them, before
#: a note says the export computes something else (float32 rounding through a deep model is ~1e-6)
EXPORT_TOLERANCE = 1e-4


def export_mismatch(path: str | Path, feeds: Mapping[str, np.ndarray], expected: Sequence[np.ndarray]) -> str | None:
    """A note where the ONNX model at ``path`` does not compute ``expected`` (the module's outputs in
    eval mode) from ``feeds`` within :data:`EXPORT_TOLERANCE`: an exporter that traced a different
    computation (Longformer's sliding-window chunks through the classic exporter) gives a plan that
    trains what was exported, not the module; None where it matches."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # the file as exported, not onnxruntime's rewrite of it: its constant folding crashed the process
    # (onnxruntime 1.32, a segmentation fault) on the Loop the dynamo exporter writes for nn.EmbeddingBag
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        got = session.run(None, dict(feeds))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own kinds; the note names it
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return f"the exported model did not run in onnxruntime on random examples ({type(exc).__name__}: {first})"
    for output, value, want in zip(session.get_outputs(), got, expected):
        value, want = np.asarray(value), np.asarray(want)
        if not np.issubdtype(want.dtype, np.floating) or value.shape != want.shape:
            continue
        scale = max(float(np.abs(want).max(initial=0.0)), float(np.finfo(np.float32).tiny))
        off = float(np.abs(value.astype(np.float64) - want).max(initial=0.0)) / scale
        if not off <= EXPORT_TOLERANCE:
            return (
                f"the exported model's {output.name!r} differs from the module's (eval mode, on random "
                f"examples) by {off:.1e} of its largest value: the exporter traced a different computation, "
                "and the plan trains what was exported; compare the two before training"
            )
    return None


def dynamic_batch(module: Any, count: int, axis: Any) -> tuple:
    """torch.export's ``dynamic_shapes`` for ``count`` inputs whose axis 0 is ``axis``, in the
    structure of ``module.forward``'s signature: one entry per argument, or one tuple of them all
    where ``forward`` takes ``*args`` (a wrapper that passes them on), which torch.export otherwise
    refuses as a mismatch of structure."""
    shapes = tuple({0: axis} for _ in range(count))
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a forward whose signature Python cannot read
        return shapes
    return (shapes,) if any(p.kind == p.VAR_POSITIONAL for p in params) else shapes


def forward_outputs(value: Any) -> list[tuple[int | str, NamedOutput]] | None:
    """The values of what a forward returned, each with the key that picks it (a tuple's index, a
    mapping's key) and its :class:`NamedOutput` (a named tuple's by its field names, a tuple's by
    its indices), a tensor's axis 0 batched where it is the trace's batch; None for one tensor."""
    if isinstance(value, Mapping):
        items: list[tuple[int | str, str, Any]] = [(k, str(k), v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        fields = getattr(value, "_fields", None)  # a named tuple: torchvision's GoogLeNetOutputs
        items = [(i, str(fields[i]) if fields else str(i), v) for i, v in enumerate(value)]
    else:
        return None
    found: list[tuple[int | str, NamedOutput]] = []
    for key, name, v in items:
        shape = getattr(v, "shape", None)
        dtype = getattr(v, "dtype", None)
        if shape is None or dtype is None or isinstance(v, (tuple, list, Mapping)):
            found.append((key, NamedOutput(name, type(v).__name__, tensor=False)))
            continue
        dims = tuple(int(d) for d in shape)
        batched = bool(dims) and dims[0] == TRACE_BATCH
        dtype_name = str(dtype).removeprefix("torch.")
        found.append((key, NamedOutput(name, dtype_name, ("N", *dims[1:]) if batched else dims, batched=batched)))
    return found


def forward_choice(
    values: Sequence[tuple[int | str, NamedOutput]], output: str | int | None, *, loss: str
) -> tuple[int | str, str, str | None]:
    """The value of :func:`forward_outputs` the loss reads: its key, its name and the line saying
    it was chosen (:func:`~emulator.toolchain.tasks.loss_output`); ``output`` is a name, or an
    index (a named tuple's value may be given by either)."""
    keys = {o.name: k for k, o in values}
    picked = None if output is None else str(output)
    if picked is not None and picked not in keys and picked.isdigit() and int(picked) < len(values):
        picked = values[int(picked)][1].name
    chosen, line = loss_output([o for _, o in values], picked, loss=loss, source="forward")
    return keys[chosen], chosen, line


def _picked(out: Any, key: int | str) -> Any:
    """The value ``key`` of what a forward returned; a lone tensor as it is (torchvision's GoogLeNet
    returns its auxiliary logits in training mode only)."""
    if isinstance(out, Mapping):
        return out[key]
    return out[int(key)] if isinstance(out, (tuple, list)) else out


def _one_output(module: Any, key: int | str) -> Any:
    """``module`` (the same parameters, buffers and submodules, under the same names) as a module
    whose forward returns the value ``key`` of what its own returns: the export then holds the
    output the loss reads alone (not a transformers model's key-value cache object, which no
    exporter can return, nor an auxiliary head the plan would carry unread)."""
    base = type(module)

    def forward(self: Any, *args: Any) -> Any:
        return _picked(base.forward(self, *args), key)

    view = copy.copy(module)  # shares the parameter and submodule tables: the export names them as torch does
    view.__class__ = type(base.__name__, (base,), {"forward": forward})
    return view


def _say(notes: list[str] | None, note: str | None) -> None:
    if notes is not None and note:
        notes.append(note)


def _save(model: onnx.ModelProto, state: Any, path: Path) -> None:
    """``model`` written to ``path`` with the module's ``state`` over the initializers of the same
    names, made an inference model again (its Dropout inactive)."""
    for i, init in enumerate(model.graph.initializer):
        if init.name in state:
            value = state[init.name].cpu().numpy()
            if value.shape == tuple(init.dims):
                model.graph.initializer[i].CopyFrom(
                    numpy_helper.from_array(value.astype(numpy_helper.to_array(init).dtype), init.name)
                )
    inference_form(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_onnx(model, path, data_file=None if model.ByteSize() < 1 << 30 else f"{path.name}.data")


def _saved_state(module: Any) -> Any:
    """A copy of ``module``'s ``state_dict`` to restore after the export, with its ``_metadata``: the
    versions of the modules' state layouts, which a module's own ``_load_from_state_dict`` may read
    (torchvision's MNASNet raises without one)."""
    saved = module.state_dict()
    state = type(saved)((k, v.detach().clone()) for k, v in saved.items())
    state._metadata = getattr(saved, "_metadata", None)
    return state


def export_torch(
    module: Any,
    inputs: Sequence[TorchInput],
    path: str | Path,
    *,
    opset: int | None = None,
    notes: list[str] | None = None,
    output: str | int | None = None,
    loss: str = "cross_entropy",
    say: Callable[[str], None] | None = None,
) -> Path:
    """Export ``module`` to ``path`` so that it trains right (see the module docstring) and return
    the path; its weights and train/eval mode are left as they were. Where the dynamo exporter
    fails, the classic one is tried in training mode, and ``notes`` gets a line saying so. The
    file is then run in onnxruntime on random examples and held to the module's outputs in eval mode
    (:func:`export_mismatch`): ``notes`` says where it differs.

    Where forward returns several values in training mode (a tuple, a dict, a transformers output
    object, torchvision's GoogLeNet with its auxiliary logits), the file holds one: ``output`` (an
    index, key or attribute name), else the only float tensor with a batch axis of the rank
    ``loss`` reads (``say`` says which); more than one such is refused in one line listing them
    (:func:`~emulator.toolchain.tasks.loss_output`)."""
    torch = _torch()
    if not isinstance(module, torch.nn.Module):
        raise TaskError(f"the factory returned {type(module).__name__}, not a torch.nn.Module")
    if not inputs:
        raise TaskError("give the module's inputs (--input NAME:SHAPE[:DTYPE] for each argument of forward)")
    _refuse_misexported(torch, module)
    path = Path(path)
    args = tuple(_example(torch, spec) for spec in inputs)
    state = _saved_state(module)
    was_training = module.training
    try:
        with torch.no_grad():
            module.eval()
            try:
                out = module(*args)
            except Exception as exc:  # noqa: BLE001 - the module's own code: any error is the inputs' mismatch
                # integer inputs of zeros are all padding to a model whose padding id is 0 (an
                # nn.TransformerEncoder's src_key_padding_mask then fails in eval): ones instead
                ones = tuple(torch.ones_like(a) if not a.is_floating_point() else a for a in args)
                try:
                    out, args = module(*ones), ones
                except Exception:  # noqa: BLE001 - the module's own code: the first error is the one to give
                    raise TaskError(forward_failure(exc, inputs)) from None
            checks = tuple(_check_example(torch, spec) for spec in inputs)
            try:
                expected = module(*checks)
            except Exception:  # noqa: BLE001 - the module's own code: then only the export is not checked
                expected = None
            module.train()  # what is traced: a model may return more in training mode (auxiliary logits)
            try:
                out = module(*args)
            except Exception:  # noqa: BLE001 - the module's own code: the export says what fails
                pass
            module.load_state_dict(state)  # the running statistics that forward moved
        traced, name = module, "output"
        values = forward_outputs(out)
        if values is not None:
            key, chosen, line = forward_choice(values, output, loss=loss)
            if say is not None and line:
                say(line)
            traced = _one_output(module, key)
            if forward_outputs(expected) is not None:
                expected = _picked(expected, key)
            elif chosen != values[0][1].name:  # eval mode's lone tensor is the main (first) value, as GoogLeNet's
                expected = None
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", chosen) and chosen not in {s.name for s in inputs}:
                name = chosen  # the file's output as the module names it (logits)
        elif output is not None:
            raise TaskError(
                f"--output {output!r}: forward returns one tensor, which the loss reads; leave --output out"
            )
        outputs = [name]
        feeds = {spec.name: a.numpy() for spec, a in zip(inputs, checks)}
        wanted = [expected.numpy()] if isinstance(expected, torch.Tensor) else None
        module.train()
        batch = torch.export.Dim("N")
        names = [s.name for s in inputs]
        with (
            tempfile.TemporaryDirectory() as tmp,
            warnings.catch_warnings(),
            _quiet(REGISTRATION_LOGGER),
            _bags_as_embeddings(torch, module),
        ):
            warnings.simplefilter("ignore")  # "exporting a model in training mode" is what is meant here
            exported = Path(tmp) / "model.onnx"
            common = {"input_names": names, "output_names": outputs}

            def classic() -> onnx.ModelProto:
                module.load_state_dict(state)
                torch.onnx.export(
                    traced,
                    args,
                    str(exported),
                    **common,
                    dynamo=False,
                    training=torch.onnx.TrainingMode.PRESERVE,
                    do_constant_folding=False,
                    dynamic_axes={n: {0: "N"} for n in [*names, *outputs]},
                    opset_version=min(opset or CLASSIC_OPSET, CLASSIC_OPSET),
                )
                return onnx.load(str(exported))  # with its external data, read from the temporary folder

            try:
                torch.onnx.export(
                    traced,
                    args,
                    str(exported),
                    **common,
                    dynamo=True,
                    optimize=False,
                    dynamic_shapes=dynamic_batch(traced, len(inputs), batch),
                    opset_version=opset,
                    verbose=False,
                )
                model = onnx.load(str(exported))
            except Exception as exc:  # noqa: BLE001 - torch.export raises many kinds; the root cause says which
                failed = export_failure(exc)
                try:  # the classic exporter traces where torch.export cannot (views of tensors a no-op left strided)
                    model = classic()
                except Exception:  # noqa: BLE001 - the dynamo exporter's reason is the one to give
                    raise TaskError(failed) from None
                reason = failed.removeprefix("torch.onnx.export failed: ").split("; export the module yourself")[0]
                _say(notes, f"the dynamo exporter failed ({reason}); exported with the classic one, in training mode")
            _save(model, state, path)
            _say(notes, export_mismatch(path, feeds, wanted) if wanted is not None else None)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.export raises many kinds; the root cause says which
        raise TaskError(export_failure(exc)) from None
    finally:
        module.load_state_dict(state)
        module.train(was_training)
    return path


def from_torch(
    module: Any,
    inputs: Sequence[TorchInput | str],
    out: str | Path,
    *,
    label: str,
    name: str | None = None,
    opset: int = 21,
    output: str | int | None = None,
    **options: Any,
) -> ModelBundle:
    """Export ``module`` (an ``nn.Module``, or ``"MODULE:FACTORY"`` naming the function that
    returns one) with :func:`export_torch` and write its bundle into ``out`` as ``plan from-onnx``
    does; ``output`` picks the value of forward's the loss reads where it returns several (an
    index, a key or an attribute name: ``"logits"``); ``options`` are
    :func:`~emulator.toolchain.model_bundle.bundle_from_onnx`'s (loss, optimizer, lr, batch_size,
    epochs, collection, trainable, frozen, runtimes, say)."""
    specs = [parse_input(s) if isinstance(s, str) else s for s in inputs]
    if isinstance(module, str):
        _torch()  # before the user's file, which imports torch itself
        factory = load_factory(module)
        name = name or factory.__name__
        try:
            module = factory()
        except Exception as exc:  # noqa: BLE001 - the user's code
            raise TaskError(
                f"{getattr(factory, '__name__', 'the factory')}() failed: {type(exc).__name__}: {exc}"
            ) from None
    name = name or type(module).__name__
    with tempfile.TemporaryDirectory() as tmp:
        notes: list[str] = []
        exported = export_torch(
            module,
            specs,
            Path(tmp) / "model.onnx",
            notes=notes,
            output=output,
            loss=options.get("loss", "cross_entropy"),
            say=options.get("say"),
        )
        initializers = {i.name for i in onnx.load(str(exported), load_external_data=False).graph.initializer}
        rows = padding_rows(module, initializers)
        if rows:
            options["frozen_rows"] = {**rows, **options.get("frozen_rows", {})}
        untrained = [*constant_buffers(module, initializers), *untrained_parameters(module, initializers)]
        if untrained:
            options["frozen"] = [*(options.get("frozen") or ()), *untrained]
        made = bundle_from_onnx(exported, out, label=label, name=name, opset=opset, command="from-torch", **options)
        return dataclasses.replace(made, warnings=(*notes, *made.warnings)) if notes else made


def constant_buffers(module: Any, initializers: set[str]) -> list[str]:
    """The exported float buffers torch never trains (a rotary embedding's ``inv_freq``, a fixed
    positional table): a plan would train any float initializer on the loss's path, so they are
    named ``frozen``. Normalization layers' running statistics are left out: the plan updates them
    as the layer does."""
    torch = _torch()
    params = {id(p) for p in module.parameters()}
    stats = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        if isinstance(sub, torch.nn.modules.batchnorm._NormBase)
        for name, _ in sub.named_buffers(recurse=False)
    }
    return sorted(
        name
        for name, buf in module.named_buffers(remove_duplicate=False)
        if name in initializers and name not in stats and id(buf) not in params and buf.is_floating_point()
    )


def untrained_parameters(module: Any, initializers: set[str]) -> list[str]:
    """The exported parameters torch does not train because their ``requires_grad`` is off (a
    frozen backbone, Whisper's sinusoidal position table): named ``frozen``, under the name the
    export gave each (a weight the model ties is exported once, under one of its names)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            names.setdefault(id(param), []).append(name)
    return sorted(
        exported[0] for exported in ([n for n in ns if n in initializers] for ns in names.values()) if exported
    )


def padding_rows(module: Any, initializers: set[str]) -> dict[str, tuple[int, ...]]:
    """The rows torch never trains: each ``nn.Embedding``'s and ``nn.EmbeddingBag``'s ``padding_idx`` (its gradient there is
    zero), keyed by the name its weight has among the exported ``initializers`` (a weight the model
    ties is exported once, under one of its names). Exporters drop ``padding_idx``."""
    torch = _torch()
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    rows: dict[str, set[int]] = {}
    for sub in module.modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.padding_idx is not None:
            exported = [n for n in names.get(id(sub.weight), []) if n in initializers]
            if exported:
                rows.setdefault(exported[0], set()).add(int(sub.padding_idx) % sub.num_embeddings)
    return {w: tuple(sorted(r)) for w, r in rows.items()}
