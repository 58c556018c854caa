"""Keras models converted by tf2onnx take TensorFlow's own SGD step.

The fixtures in ``keras/`` (``benchmarks/keras_fixtures.py`` makes them, in a virtualenv with
tensorflow and tf2onnx; the README there says how) are Keras models with random weights: an MLP
(also with a BatchNormalization over [N, 1, 1, features], and with a LayerNormalization), a CNN (NHWC, ``same`` and ``valid`` padding, strides, max and average pooling, BatchNormalization,
Dropout), MobileNetV2's inverted residual (ReLU6, depthwise convolutions, ZeroPadding2D), an LSTM
classifier (int32 ids), a bidirectional LSTM over float ids, a GRU next-token model (int64 ids, a
label per position), a GRU reading its sequence backwards, recurrences tf2onnx writes as a ``Loop``
the plan unrolls (a SimpleRNN, a GRU(reset_after=False), an LSTM after Embedding(mask_zero=True), a
GRU after Masking, and Keras 3's GRU next-token model, exported by ``model.export(format="onnx")``),
an MLP whose ``tf.cond`` on its features' static width tf2onnx writes as an ``If`` on a constant
(the plan takes its branch), an Embedding + GlobalAveragePooling1D
classifier and a transformer block (MultiHeadAttention, LayerNormalization, a learned position
table), each converted with ``tf2onnx.convert.from_keras`` keeping BatchNormalization (the
``optimizers`` the how-to names). Beside each, every initializer after one step of
``tf.GradientTape`` in float64, as tf2onnx lays it out.

Each goes through what ``fedfleet plan from-onnx`` does, and one step of the plan's work graph is
compared with TensorFlow's initializer by initializer, as ``test_exported_models`` compares torch's.
Four more files are converted as tf2onnx converts by default: the plan warns of the
BatchNormalization layers folded into constants, and refuses in one line a SimpleRNN's ``Loop`` over a
sequence of run-time length and a ``tf.cond`` on the data.
Nothing here imports tensorflow.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from emulator.toolchain.onnx_import import EVAL_MODE_WARNING
from emulator.toolchain.tasks import TaskError, onnx_import
from tests.emulator.toolchain.test_exported_models import (
    TOLERANCE,
    Step,
    relative_differences,
    scales,
    task_for,
    work_step,
)

FOLDER = Path(__file__).with_name("keras")
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())


@cache
def reference(
    name: str, folder: Path = FOLDER
) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray], dict[str, float]]:
    """TensorFlow's step (``keras_<model>.npz``; in ``folder``, another framework's step saved the
    same way): the examples, the loss, every float initializer of rank >= 1 after the step, and the
    framework's float32 error on each."""
    data = np.load(folder / name)
    index = json.loads(str(data["index"]))
    shapes = index["initializers"]
    ends = np.cumsum([int(np.prod(shape)) for _, shape in shapes])
    after = {n: piece.reshape(shape) for (n, shape), piece in zip(shapes, np.split(data["after"], ends[:-1]))}
    examples = {index["input"]: data["input"], "y": data["label"]}
    return examples, float(data["loss"]), after, dict(zip(after, map(float, data["float32_error"])))


@pytest.mark.parametrize("entry", MANIFEST["fixtures"], ids=[e["name"] for e in MANIFEST["fixtures"]])
def test_a_plan_step_matches_tensorflows_step_for_every_initializer(entry):
    """The loss, and every initializer the plan trains or keeps as state (BatchNormalization's
    moving statistics, at ONNX's momentum 0.9: tf2onnx writes none), as TensorFlow's float64 step
    leaves it, within float32 noise; every initializer TensorFlow's step moved is a plan weight (an
    LSTM's bias trains as Keras's one bias, the recurrent half tf2onnx adds staying zero)."""
    assert_step_matches(entry, MANIFEST, FOLDER, "TensorFlow")


def assert_step_matches(entry: dict[str, Any], manifest: dict[str, Any], folder: Path, framework: str) -> Step:
    """One step of ``entry``'s plan lands where ``framework``'s float64 step saved beside it does
    (:func:`reference`): the loss, and every initializer the plan trains or keeps as state within
    float32 noise (:data:`TOLERANCE`, or 4 times the framework's own float32 error where larger);
    every initializer the framework's step moved is a plan weight, and the plan warns of nothing.
    Returns the plan's step."""
    examples, loss, after, float32_error = reference(entry["reference"], folder)
    step = work_step(entry, examples, manifest, folder)
    assert step.loss == pytest.approx(loss, rel=1e-5)
    moved = {n for n, value in after.items() if n in step.before and not np.array_equal(value, step.before[n])}
    assert moved <= set(step.after), sorted(moved - set(step.after))
    compared = {w: after[w] for w in step.after}
    differences = relative_differences(step.after, compared, step.before)
    scale = scales(compared, step.before)
    noise = max(float32_error[w] / scale[w] for w in compared)
    worst = max(differences, key=differences.get)
    assert differences[worst] <= max(TOLERANCE, 4 * noise), f"{worst}: {differences[worst]:.3g} of {framework}'s change"
    assert not step.made.warnings
    return step


def _as_is(name: str) -> dict[str, Any]:
    return next(e for e in MANIFEST["as_is"] if e["name"] == name)


@pytest.mark.parametrize(
    "name, layers", [("cnn", ["cnn/conv2d"]), ("mlp_softmax", ["mlp_softmax/batch_normalization"])]
)
def test_batch_norms_tf2onnx_folds_by_default_are_named_in_one_warning_line(name, layers):
    """tf2onnx's default conversion folds a BatchNormalization into the convolution before it, and one
    over Dense features into a scale and shift: the warning names the layers and the conversion that
    keeps the first (no torch advice)."""
    task = task_for(_as_is(name), MANIFEST, FOLDER)
    made = onnx_import(task._model_source(), task)
    (warning,) = made.warnings
    assert warning != EVAL_MODE_WARNING and len(warning.splitlines()) == 1
    assert all(layer in warning for layer in layers) and "less 'remove_back_to_back'" in warning


def test_a_loop_over_a_sequence_of_run_time_length_is_refused_in_one_line_naming_the_loop():
    """A SimpleRNN over ``Input((None,))`` becomes a Loop whose trip count is the sequence length the
    device feeds: it cannot be unrolled when the plan is made, and is refused saying what to export."""
    task = task_for(_as_is("simple_rnn_any_length"), MANIFEST, FOLDER)
    with pytest.raises(TaskError) as refused:
        onnx_import(task._model_source(), task)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "op 'Loop' (node 'simple_rnn_any_length/simple_rnn/while_loop')" in message
    assert "known only at run time" in message and "fixed sequence length" in message


def test_a_tf_cond_on_the_data_is_refused_in_one_line_naming_the_if():
    """``tf.cond`` on the batch's values becomes an If the gradient must cross and whose branch is
    chosen at run time (``mlp_cond``'s, on a static width, is its branch in the plan)."""
    task = task_for(_as_is("mlp_cond_on_data"), MANIFEST, FOLDER)
    with pytest.raises(TaskError) as refused:
        onnx_import(task._model_source(), task)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "op 'If' (node 'mlp_cond_on_data/sign_branch/cond') runs a subgraph chosen at run time" in message
    assert "not known when the plan is made" in message and "Where" in message
