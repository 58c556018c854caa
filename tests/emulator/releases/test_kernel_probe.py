"""The record of kernels a release lacks: the probe models are valid and run where the kernels
exist, versioned plans step below a missing kernel, and (slow) the record matches a re-measurement."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from device_runtime import build_mlp_plan
from device_runtime.executor import make_session
from emulator.releases.kernel_probe import FIRST_OPSET, PROBED_OPS, missing_kernels, probe_model
from emulator.releases.missing_kernels import MISSING_KERNELS
from emulator.toolchain.versioning import versioned_plan
from example_store import ExampleSelector


@pytest.mark.parametrize("op", sorted(PROBED_OPS))
def test_every_probe_model_loads_on_this_interpreters_onnxruntime_at_every_opset(op):
    for opset in range(FIRST_OPSET, 27):
        make_session(probe_model(op, opset))  # what a release fails to load is then its own gap


def _quantizing_plan(opset: int):
    """The builder writes opsets up to 26; above that, its work graph is declared at ``opset``
    (its MLP ops have no newer versions)."""
    plan = build_mlp_plan(64, (), 10, opset=min(opset, 26), selector=ExampleSelector("app:/d"))
    work = onnx.ModelProto.FromString(plan.work)
    work.opset_import[0].version = opset
    work.graph.initializer.append(numpy_helper.from_array(np.array(0.1, np.float32), "q_scale"))
    work.graph.node.append(helper.make_node("QuantizeLinear", ["x", "q_scale"], ["x_q"], name="quantize"))
    return dataclasses.replace(
        plan, work=work.SerializeToString(), metadata=dataclasses.replace(plan.metadata, opset=opset)
    )


def test_a_quantize_at_opset_23_is_served_to_1_23_at_opset_22():
    plan = _quantizing_plan(23)
    assert versioned_plan(plan, "1.23.2").metadata.opset == 22
    assert versioned_plan(plan, "1.24.4").metadata.opset == 23
    assert MISSING_KERNELS[(1, 23)] == {"QuantizeLinear": 23}


def test_a_quantize_at_opset_28_is_served_to_1_32_below_its_opset_28_version():
    """onnxruntime 1.32 loads opset-28 models but has no kernel for QuantizeLinear-28 (measured by
    the slow test below); the op's previous version is 25, so the plan is written at opset 27."""
    plan = _quantizing_plan(28)
    assert versioned_plan(plan, "1.32.0").metadata.opset == 27
    assert versioned_plan(_quantizing_plan(27), "1.32.0").metadata.opset == 27


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("release", ["1.15.1", "1.16.3", "1.23.2", "1.31.1", "1.32.0"])
def test_the_record_matches_a_measurement_on_the_real_release(release):
    major, minor, _ = (int(p) for p in release.split("."))
    recorded = {op: v for op, v in MISSING_KERNELS.get((major, minor), {}).items() if op in PROBED_OPS}
    assert missing_kernels(release) == recorded
