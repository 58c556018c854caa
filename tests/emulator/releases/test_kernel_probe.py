"""The record of kernels a release lacks: the probe models are valid and run where the kernels
exist, versioned plans step below a missing kernel, and (slow) the record matches a re-measurement."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_runtime import build_mlp_plan, initial_weights
from device_runtime.executor import make_session
from emulator.releases.kernel_probe import (
    FIRST_OPSET,
    PROBED_OPS,
    PROBED_TYPES,
    missing_kernels,
    missing_type_kernels,
    probe_model,
    typed_probe_model,
)
from emulator.releases.missing_kernels import MISSING_KERNELS, MISSING_TYPE_KERNELS
from emulator.releases.workers import RuntimeWorker
from emulator.toolchain.versioning import versioned_plan
from example_store import ExampleSelector


@pytest.mark.parametrize("op", sorted(PROBED_OPS))
def test_every_probe_model_loads_on_this_interpreters_onnxruntime_at_every_opset(op):
    for opset in range(FIRST_OPSET, 27):
        make_session(probe_model(op, opset))  # what a release fails to load is then its own gap


@pytest.mark.parametrize("op", sorted(PROBED_TYPES))
def test_every_typed_probe_model_loads_on_this_interpreters_onnxruntime(op):
    for type_name in PROBED_TYPES[op][0]:
        make_session(typed_probe_model(op, type_name))


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


def _causal_mask_plan():
    """An MLP plan whose work graph also outputs its input masked by ``Trilu`` of a bool causal
    mask, what the dynamo exporter writes for ``scaled_dot_product_attention(is_causal=True)``."""
    plan = build_mlp_plan(64, (), 10, opset=21, selector=ExampleSelector("app:/d"))
    work = onnx.ModelProto.FromString(plan.work)
    work.graph.initializer.append(numpy_helper.from_array(np.ones((8, 64), bool), "ones"))
    work.graph.node.extend(
        [
            helper.make_node("Trilu", ["ones"], ["causal"], name="node_tril", upper=0),
            helper.make_node("Cast", ["causal"], ["causal_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x", "causal_f"], ["masked"], name="mask"),
        ]
    )
    work.graph.output.append(helper.make_tensor_value_info("masked", TensorProto.FLOAT, [8, 64]))
    return dataclasses.replace(plan, work=work.SerializeToString())


@pytest.mark.timeout(1800)  # a cold cache installs the release first
def test_a_bool_trilu_plan_runs_on_a_release_without_the_bool_kernel():
    """onnxruntime 1.17 has no bool Trilu kernel (its session refused GPT models with a causal
    mask at `loads`); the versioned plan computes the mask in int64 there, as the reference does."""
    assert MISSING_TYPE_KERNELS[(1, 17)]["Trilu"] == ("BOOL", "INT32")
    plan = _causal_mask_plan()
    outputs = [*plan.weight_outputs, *plan.metric_names, "masked"]
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    feeds = {**initial_weights(plan, seed=0), "x": x, "y": np.arange(8, dtype=np.int64)}
    want = dict(zip(outputs, make_session(plan.work).run(outputs, feeds)))
    with RuntimeWorker.for_release("1.17.3") as worker:
        got = worker.run(versioned_plan(plan, "1.17.3").work, feeds, outputs)
    for name in outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(got["masked"], np.tril(np.ones((8, 64), bool)) * x)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("release", ["1.15.1", "1.16.3", "1.18.1", "1.19.2", "1.23.2", "1.28.0", "1.31.1", "1.32.0"])
def test_the_record_matches_a_measurement_on_the_real_release(release):
    major, minor, _ = (int(p) for p in release.split("."))
    recorded = {op: v for op, v in MISSING_KERNELS.get((major, minor), {}).items() if op in PROBED_OPS}
    assert missing_kernels(release) == recorded
    recorded_types = {op: t for op, t in MISSING_TYPE_KERNELS.get((major, minor), {}).items() if op in PROBED_TYPES}
    assert missing_type_kernels(release) == recorded_types
