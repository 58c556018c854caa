"""PaddlePaddle models exported by paddle2onnx take Paddle's own SGD step.

The fixtures in ``paddle/`` (``benchmarks/paddle_fixtures.py`` makes them, in a virtualenv with
paddlepaddle and paddle2onnx; the README there says how) are an MLP (ReLU, Tanh), a CNN (Conv2D,
BatchNorm2D, max and average pooling, LayerNorm), an Embedding + mean + GELU text classifier, LSTM and
GRU classifiers (the ONNX ops, their gates reordered by paddle2onnx, their initial state a zero it
expands, which does not train) and a TransformerEncoderLayer, random weights perturbed, exported with ``paddle.onnx.export`` in eval mode with the batch axis dynamic. Beside
each, every initializer after one step of Paddle's autograd in float64 in train mode (BatchNorm's
batch statistics, its running ones moved). Each goes through what ``fedfleet plan from-onnx`` does and
one step of the plan's work graph is compared with Paddle's, initializer by initializer. Nothing here
imports paddle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.emulator.toolchain.test_keras_exports import assert_step_matches

FOLDER = Path(__file__).with_name("paddle")
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())


@pytest.mark.parametrize("entry", MANIFEST["fixtures"], ids=[e["name"] for e in MANIFEST["fixtures"]])
def test_a_plan_step_matches_paddles_step_for_every_initializer(entry):
    """The loss and every initializer the plan trains or keeps as state, as Paddle's float64 step
    leaves it, within float32 noise; every initializer Paddle's step moved is a plan weight (a
    Conv's bias too, which paddle2onnx reshapes into a constant of its own)."""
    assert_step_matches(entry, MANIFEST, FOLDER, "Paddle")
