"""Flax NNX models exported by jax2onnx take JAX's own SGD step.

The fixtures in ``jax/`` (``benchmarks/jax_fixtures.py`` makes them, in a virtualenv with jax, flax
and jax2onnx; the README there says how) are an MLP (Linear, LayerNorm, GELU) and a CNN (an NHWC Conv
between the Transposes jax2onnx writes, BatchNorm, max pooling), random weights perturbed, exported by
``jax2onnx.to_onnx`` at its default opset (23, which the plan lowers). Beside each, every initializer
holding a parameter or statistic after one step of ``nnx.value_and_grad`` in float64 in train mode
(Flax moves the running variance with the population variance, at momentum 0.99). Each goes through
what ``fedfleet plan from-onnx`` does and one step of the plan's work graph is compared with JAX's,
initializer by initializer. Nothing here imports jax.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.emulator.toolchain.test_keras_exports import assert_step_matches

FOLDER = Path(__file__).with_name("jax")
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())


@pytest.mark.parametrize("entry", MANIFEST["fixtures"], ids=[e["name"] for e in MANIFEST["fixtures"]])
def test_a_plan_step_matches_jaxs_step_for_every_initializer(entry):
    """The loss and every initializer the plan trains or keeps as state, as JAX's float64 step
    leaves it, within float32 noise; every initializer JAX's step moved is a plan weight (the
    convolution's kernel too, which jax2onnx stores transposed to OIHW)."""
    assert_step_matches(entry, MANIFEST, FOLDER, "JAX")
