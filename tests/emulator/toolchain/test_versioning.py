"""Versioned plans: every rewrite between opsets computes what the original computes (checked on
real onnxruntime sessions), every versioned plan loads on its release, and a graph that has no
form at the target opset is refused naming the op and the version."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from device_runtime import build_mlp_plan, initial_weights
from device_runtime.executor import make_session
from device_runtime.plan import load_plan, max_ir_version_for_runtime, max_opset_for_runtime, serialize_plan
from emulator.releases.envs import KNOWN_RELEASES
from emulator.toolchain.tasks import load_tasks
from emulator.toolchain.versioning import VersioningError, convert_model, plan_sha256, versioned_plan
from example_store import ExampleSelector


def _int_constant(name: str, values: object) -> onnx.NodeProto:
    """A Constant node holding ``values`` as int64."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))


F32 = TensorProto.FLOAT
TARGETS = st.sampled_from([11, 12, 13, 15, 17, 19, 20])


def model(nodes, inputs, outputs, opset, initializers=()) -> bytes:
    """A model whose outputs given as bare names take the types shape inference finds."""
    graph = helper.make_graph(nodes, "g", inputs, [], initializer=list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    m.graph.output.extend(inferred[o] if isinstance(o, str) else o for o in outputs)
    onnx.checker.check_model(m, full_check=True)
    return m.SerializeToString()


def run(model_bytes: bytes, feeds: dict) -> list[np.ndarray]:
    return make_session(model_bytes).run(None, feeds)


def assert_same(original: bytes, target: int, feeds: dict) -> bytes:
    converted = convert_model(original, target)
    m = onnx.ModelProto.FromString(converted)
    assert m.opset_import[0].version == min(target, onnx.ModelProto.FromString(original).opset_import[0].version)
    for want, got in zip(run(original, feeds), run(converted, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return converted


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(
    shape=shapes,
    data=st.data(),
    target=TARGETS,
    op=st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp"]),
)
def test_reduce_with_constant_axes_input_keeps_its_values_at_any_target(shape, data, target, op):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(-rank, rank - 1), min_size=1, max_size=rank, unique_by=lambda a: a % rank))
    keepdims = data.draw(st.integers(0, 1))
    axes_init = numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes")
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
    m = model([node], [helper.make_tensor_value_info("x", F32, shape)], ["y"], 18, [axes_init])
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    assert_same(m, target, {"x": x})


@settings(max_examples=25, deadline=None)
@given(shape=shapes, data=st.data(), target=TARGETS, op=st.sampled_from(["Softmax", "LogSoftmax", "Hardmax"]))
def test_softmax_family_keeps_the_one_axis_meaning_below_13(shape, data, target, op):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    node = helper.make_node(op, ["x"], ["y"], axis=axis)
    m = model(
        [node], [helper.make_tensor_value_info("x", F32, shape)], [helper.make_tensor_value_info("y", F32, shape)], 13
    )
    x = np.random.default_rng(axis + 7).standard_normal(shape).astype(np.float32)
    assert_same(m, target, {"x": x})


@settings(max_examples=20, deadline=None)
@given(shape=shapes, data=st.data(), target=TARGETS)
def test_squeeze_and_unsqueeze_axes_move_to_attributes(shape, data, target):
    rank = len(shape)
    new_axis = data.draw(st.integers(-(rank + 1), rank))
    nodes = [
        helper.make_node("Unsqueeze", ["x", "ax"], ["u"]),
        helper.make_node("Squeeze", ["u", "ax"], ["y"]),
        helper.make_node("Relu", ["u"], ["z"]),
    ]
    ax = numpy_helper.from_array(np.array([new_axis], dtype=np.int64), "ax")
    m = model(nodes, [helper.make_tensor_value_info("x", F32, shape)], ["y", "z"], 21, [ax])
    assert_same(m, target, {"x": np.arange(np.prod(shape), dtype=np.float32).reshape(shape)})


@settings(max_examples=20, deadline=None)
@given(dim=st.integers(2, 9), parts=st.integers(2, 4), target=TARGETS, explicit=st.booleans())
def test_split_sizes_and_num_outputs_survive_lowering(dim, parts, target, explicit):
    parts = min(parts, dim)
    assume(-(-dim // parts) * (parts - 1) < dim)  # num_outputs leaves no part empty
    outs = [f"y{i}" for i in range(parts)]
    inits = []
    if explicit:
        sizes = [1] * (parts - 1) + [dim - parts + 1]
        inits = [numpy_helper.from_array(np.array(sizes, dtype=np.int64), "sizes")]
        node = helper.make_node("Split", ["x", "sizes"], outs, axis=1)
    else:
        node = helper.make_node("Split", ["x"], outs, axis=1, num_outputs=parts)
    m = model([node], [helper.make_tensor_value_info("x", F32, [2, dim])], [o for o in outs], 18, inits)
    assert_same(m, target, {"x": np.arange(2 * dim, dtype=np.float32).reshape(2, dim)})


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), data=st.data(), target=TARGETS, bias=st.booleans())
def test_layer_normalization_is_decomposed_below_17(shape, data, target, bias):
    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    normalized = shape[axis % rank :]
    rng = np.random.default_rng(rank)
    inits = [numpy_helper.from_array(rng.standard_normal(normalized).astype(np.float32), "scale")]
    inputs = ["x", "scale"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(normalized).astype(np.float32), "bias"))
        inputs.append("bias")
    node = helper.make_node("LayerNormalization", inputs, ["y", "mean", "inv"], axis=axis, epsilon=1e-3)
    m = model([node], [helper.make_tensor_value_info("x", F32, shape)], [n for n in ("y", "mean", "inv")], 17, inits)
    converted = assert_same(m, target, {"x": rng.standard_normal(shape).astype(np.float32)})
    if target < 17:
        assert "LayerNormalization" not in {n.op_type for n in onnx.ModelProto.FromString(converted).graph.node}


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_decomposed_below_20(approximate):
    node = helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)
    m = model(
        [node], [helper.make_tensor_value_info("x", F32, [3, 5])], [helper.make_tensor_value_info("y", F32, [3, 5])], 20
    )
    x = np.linspace(-4, 4, 15, dtype=np.float32).reshape(3, 5)
    for target in (13, 19):
        assert_same(m, target, {"x": x})


def test_an_op_without_a_rewrite_is_refused_naming_op_node_and_version():
    x = helper.make_tensor_value_info("x", F32, [1, 2, 3, 4])
    node = helper.make_node("Attention", ["x", "x", "x"], ["y"], name="self_attention")
    m = model([node], [x], [helper.make_tensor_value_info("y", F32, [1, 2, 3, 4])], 23)
    with pytest.raises(
        VersioningError, match=r"op Attention \(node 'self_attention'\) cannot be expressed at opset 19.*opset 23"
    ):
        convert_model(m, 19)


def test_computed_axes_have_no_attribute_form_and_are_refused():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ReduceMean", ["x", "s"], ["y"], name="mean")]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
        18,
    )
    with pytest.raises(VersioningError, match="ReduceMean.*opset 17.*computed"):
        convert_model(m, 17)


def test_axes_computed_from_constants_alone_move_to_attributes():
    """The dynamo exporter's unoptimized graphs (opset 18 at the least) give a ReduceMean axes built by
    Reshape of Constant nodes: lowered to 17, they become its attribute."""
    const = _int_constant
    nodes = [
        const("raw", [[-1, -2]]),
        const("flat", [-1]),
        helper.make_node("Reshape", ["raw", "flat"], ["axes"]),
        helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F32, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", F32, [2, 3, 1, 1])],
        18,
    )
    assert_same(m, 17, {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)})


def test_a_node_whose_types_the_older_version_lacks_is_refused():
    node = helper.make_node("Relu", ["x"], ["y"], name="relu_int")  # Relu takes integers from 14 on
    m = model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.INT32, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [2])],
        14,
    )
    with pytest.raises(VersioningError, match="Relu.*opset 13.*tensor\\(int32\\)"):
        convert_model(m, 13)


def test_a_versioned_plan_per_release_loads_there_and_trains_like_the_unversioned_one(digits):
    plan = build_mlp_plan(64, (16,), 10, opset=26, learning_rate=0.1, selector=ExampleSelector("app:/digits"))
    weights = initial_weights(plan, seed=1)
    feeds = {**weights, "x": digits.x_train[:16].astype(np.float32), "y": digits.y_train[:16].astype(np.int64)}
    outputs = [*plan.weight_outputs, *plan.metric_names]
    reference = make_session(plan.work).run(outputs, feeds)
    hashes = set()
    for release in KNOWN_RELEASES:
        vplan = versioned_plan(plan, release)
        assert vplan.metadata.opset <= min(26, max_opset_for_runtime(release))
        assert vplan.metadata.opset == (18 if release.startswith("1.15.") else min(26, max_opset_for_runtime(release)))
        assert vplan.metadata.ir_version <= max_ir_version_for_runtime(release)
        loaded = load_plan(serialize_plan(vplan), runtime_version=release)  # the device's own check
        assert loaded.metadata.min_runtime_version.startswith(release.rsplit(".", 1)[0] + ".")
        for want, got in zip(reference, make_session(vplan.work).run(outputs, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        hashes.add(plan_sha256(vplan))
    assert len(hashes) == len(KNOWN_RELEASES)  # each claims its own release, so each has its own id


@pytest.mark.parametrize("task_file", ["digits_task.py", "digits_cnn_task.py"])
def test_generated_training_steps_compute_the_same_at_every_lower_opset(task_file):
    (task,) = load_tasks(Path(__file__).resolve().parents[3] / "examples" / "tasks" / task_file)
    plan = task.build_plan()
    shard = task.proxy_data().shards[0]
    feeds = {
        **task.weights(plan),
        **{graph: np.asarray(shard[name][:16]) for graph, name in plan.device.inputs.items()},
    }
    outputs = [*plan.weight_outputs, *plan.metric_names]
    reference = make_session(plan.work).run(outputs, feeds)
    for target in range(11, plan.metadata.opset):
        converted = make_session(convert_model(plan.work, target)).run(outputs, feeds)
        for want, got in zip(reference, converted):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"opset {target}")


def _causal_mask_plan():
    """A plan whose work graph also masks its input with torch's ``tril`` of a bool causal mask, as the
    dynamo exporter writes ``scaled_dot_product_attention(is_causal=True)``: ``Trilu`` on ``bool``."""
    plan = build_mlp_plan(64, (), 10, opset=21, selector=ExampleSelector("app:/d"))
    work = onnx.ModelProto.FromString(plan.work)
    work.graph.initializer.append(numpy_helper.from_array(np.ones((8, 64), bool), "ones"))
    work.graph.node.extend(
        [
            helper.make_node("Trilu", ["ones"], ["causal"], name="node_tril", upper=0),
            helper.make_node("Cast", ["causal"], ["causal_f"], to=F32),
            helper.make_node("Mul", ["x", "causal_f"], ["masked"], name="mask"),
        ]
    )
    work.graph.output.append(helper.make_tensor_value_info("masked", F32, [8, 64]))
    return dataclasses.replace(plan, work=work.SerializeToString()), [*plan.weight_outputs, "masked"]


def test_a_bool_trilu_is_computed_in_int64_for_releases_without_its_kernel():
    """onnxruntime 1.15-1.18 have no Trilu kernel for bool (MISSING_TYPE_KERNELS): their plans cast
    the mask to int64 and back around it, and compute what the unversioned plan does."""
    plan, outputs = _causal_mask_plan()
    weights = initial_weights(plan, seed=0)
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    feeds = {**weights, "x": x, "y": np.arange(8, dtype=np.int64)}
    reference = make_session(plan.work).run(outputs, feeds)
    np.testing.assert_array_equal(reference[-1], np.tril(np.ones((8, 64), bool)) * x)
    for release, typed in [("1.15.1", TensorProto.INT64), ("1.18.1", TensorProto.INT64), ("1.19.2", TensorProto.BOOL)]:
        work = versioned_plan(plan, release).work
        m = onnx.shape_inference.infer_shapes(onnx.ModelProto.FromString(work))
        types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.input]}
        types |= {i.name: i.data_type for i in m.graph.initializer}
        (trilu,) = [n for n in m.graph.node if n.op_type == "Trilu"]
        assert types[trilu.input[0]] == typed, release
        for want, got in zip(reference, make_session(work).run(outputs, feeds)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "op, attributes, opset, target",
    [
        ("AveragePool", {"kernel_shape": [2, 2], "dilations": [1, 1]}, 19, 18),  # onnxruntime 1.15's opset
        ("Cast", {"to": TensorProto.FLOAT16, "saturate": 1}, 19, 18),
        ("Resize", {"mode": "linear", "antialias": 0, "keep_aspect_ratio_policy": "stretch"}, 18, 17),
    ],
)
def test_attributes_a_newer_version_adds_are_dropped_where_they_hold_its_default(op, attributes, opset, target):
    """Exporters write such attributes out; the older version computes the same without them (they
    were refused as attributes that do not exist there)."""
    x = helper.make_tensor_value_info("x", F32, [1, 1, 4, 4])
    inputs = ["x", "", "scales"] if op == "Resize" else ["x"]
    scales = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")] if op == "Resize" else []
    m = model([helper.make_node(op, inputs, ["y"], name="n", **attributes)], [x], ["y"], opset, scales)
    converted = assert_same(m, target, {"x": np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)})
    (node,) = onnx.ModelProto.FromString(converted).graph.node
    assert not {a.name for a in node.attribute} - set(onnx.defs.get_schema(op, target, "").attributes)


def test_an_attribute_the_older_version_lacks_set_otherwise_than_by_default_is_still_refused():
    x = helper.make_tensor_value_info("x", F32, [1, 1, 5, 5])
    node = helper.make_node("AveragePool", ["x"], ["y"], name="dilated", kernel_shape=[2, 2], dilations=[2, 2])
    with pytest.raises(VersioningError, match=r"AveragePool \(node 'dilated'\).*opset 18.*dilations"):
        convert_model(model([node], [x], ["y"], 19), 18)


@pytest.mark.parametrize("mode, older", [("linear", "bilinear"), ("cubic", "bicubic")])
def test_grid_sample_modes_take_their_older_names_below_opset_20(mode, older):
    """GridSample-20 renamed its modes; kept as they were, a release's GridSample-16 kernel refused them."""
    inputs = [
        helper.make_tensor_value_info("x", F32, [1, 2, 4, 4]),
        helper.make_tensor_value_info("g", F32, [1, 3, 3, 2]),
    ]
    m = model([helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode)], inputs, ["y"], 20)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32),
        "g": rng.uniform(-1, 1, (1, 3, 3, 2)).astype(np.float32),
    }
    (node,) = onnx.ModelProto.FromString(assert_same(m, 16, feeds)).graph.node
    assert helper.get_attribute_value(node.attribute[0]) == older.encode()


def test_grid_sample_of_a_volume_is_refused_below_opset_20():
    inputs = [
        helper.make_tensor_value_info("x", F32, [1, 1, 3, 3, 3]),
        helper.make_tensor_value_info("g", F32, [1, 2, 2, 2, 3]),
    ]
    m = model([helper.make_node("GridSample", ["x", "g"], ["y"], name="warp")], inputs, ["y"], 20)
    with pytest.raises(VersioningError, match=r"GridSample \(node 'warp'\).*opset 19: .*4-D inputs only.*rank is 5"):
        convert_model(m, 19)


@pytest.mark.parametrize(
    "op, attribute, value, opset, target",
    [
        ("Resize", "coordinate_transformation_mode", "half_pixel_symmetric", 19, 18),
        ("Pad", "mode", "wrap", 19, 18),  # onnxruntime 1.15's Pad-18 kernel refuses it
        ("ScatterND", "reduction", "max", 18, 16),
        ("ScatterElements", "reduction", "min", 18, 17),
    ],
)
def test_an_attribute_value_a_later_version_added_is_refused_below_it(op, attribute, value, opset, target):
    """These nodes fit the older definition's attributes by name, but not by value: they were kept."""
    x = helper.make_tensor_value_info("x", F32, [2, 4])
    inputs, initializers = {
        "Resize": (["x", "", "s"], [numpy_helper.from_array(np.array([1, 2], np.float32), "s")]),
        "Pad": (["x", "p"], [numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "p")]),
        "ScatterND": (["x", "i", "u"], [numpy_helper.from_array(np.array([[0, 1]], np.int64), "i")]),
        "ScatterElements": (["x", "i", "u"], [numpy_helper.from_array(np.array([[0], [3]], np.int64), "i")]),
    }[op]
    if op.startswith("Scatter"):
        shape = [1] if op == "ScatterND" else [2, 1]
        initializers.append(numpy_helper.from_array(np.full(shape, 5.0, np.float32), "u"))
    node = helper.make_node(op, inputs, ["y"], name="n", **{attribute: value})
    m = model([node], [x], ["y"], opset, initializers)
    with pytest.raises(
        VersioningError, match=rf"{op} \(node 'n'\).*opset {target}: {attribute}='{value}'.*from opset {opset}"
    ):
        convert_model(m, target)


def test_roi_align_keeps_its_coordinates_below_opset_16_or_is_refused():
    """RoiAlign-16's default shifts by half a pixel, which RoiAlign-10 does not: it was kept and
    computed otherwise; the older behaviour, named, was refused."""
    x = helper.make_tensor_value_info("x", F32, [1, 1, 6, 6])
    rois = numpy_helper.from_array(np.array([[0.3, 0.7, 4.2, 5.1]], np.float32), "rois")
    batch = numpy_helper.from_array(np.array([0], np.int64), "batch")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 1, 6, 6)).astype(np.float32)}

    def roi_align(**mode) -> bytes:
        node = helper.make_node(
            "RoiAlign", ["x", "rois", "batch"], ["y"], name="pool", output_height=2, output_width=2, **mode
        )
        return model([node], [x], ["y"], 16, [rois, batch])

    assert_same(roi_align(coordinate_transformation_mode="output_half_pixel"), 13, feeds)
    for refused in (roi_align(), roi_align(coordinate_transformation_mode="half_pixel")):
        with pytest.raises(VersioningError, match=r"RoiAlign \(node 'pool'\).*opset 13: .*'half_pixel'.*opset 16"):
            convert_model(refused, 13)


@pytest.mark.parametrize("axis", [None, 1, -3])
def test_dft_axis_input_becomes_the_older_attribute_with_its_own_default(axis):
    """DFT-20 takes its axis as an input defaulting to -2, DFT-17 as an attribute defaulting to 1:
    without the axis the node was kept and transformed another axis of a rank-4 input."""
    x = helper.make_tensor_value_info("x", F32, [1, 4, 6, 1])
    inputs, initializers = ["x"], []
    if axis is not None:
        inputs, initializers = ["x", "", "axis"], [numpy_helper.from_array(np.array(axis, np.int64), "axis")]
    m = model([helper.make_node("DFT", inputs, ["y"])], [x], ["y"], 20, initializers)
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 4, 6, 1)).astype(np.float32)}
    assert_same(m, 17, feeds)


def test_group_normalization_of_opset_21_is_refused_below_it():
    """GroupNormalization-21 scales per channel where 18 scaled per group."""
    x = helper.make_tensor_value_info("x", F32, [2, 4, 3, 3])
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    bias = numpy_helper.from_array(np.zeros(4, np.float32), "bias")
    node = helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["y"], name="gn", num_groups=2)
    m = model([node], [x], [helper.make_tensor_value_info("y", F32, [2, 4, 3, 3])], 21, [scale, bias])
    with pytest.raises(VersioningError, match=r"GroupNormalization \(node 'gn'\).*opset 18: .*per channel.*opset 21"):
        convert_model(m, 18)


def test_floored_float_mod_of_opset_28_is_refused_below_it():
    """Mod-28 floors on floats by default; kept, a release's Mod-13 kernel failed on its first run."""
    inputs = [helper.make_tensor_value_info(n, F32, [3]) for n in "ab"]
    m = model([helper.make_node("Mod", ["a", "b"], ["y"], name="wrap")], inputs, ["y"], 28)
    with pytest.raises(VersioningError, match=r"Mod \(node 'wrap'\).*opset 26: fmod=0 on floating-point.*opset 28"):
        convert_model(m, 26)
    truncated = model([helper.make_node("Mod", ["a", "b"], ["y"], fmod=1)], inputs, ["y"], 28)
    feeds = {"a": np.array([5.5, -5.5, 3], np.float32), "b": np.array([2, 2, -2], np.float32)}
    assert_same(truncated, 26, feeds)


def test_a_cast_to_a_type_the_older_version_lacks_is_refused_naming_the_node():
    x = helper.make_tensor_value_info("x", F32, [3])
    m = model([helper.make_node("Cast", ["x"], ["y"], name="to_fp8", to=TensorProto.FLOAT8E4M3FN)], [x], ["y"], 19)
    with pytest.raises(
        VersioningError, match=r"Cast \(node 'to_fp8'\).*opset 18: output 'y' is tensor\(float8e4m3fn\)"
    ):
        convert_model(m, 18)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_a_ceil_mode_pool_of_opset_22_keeps_its_windows_below_it(op):
    """Opset 22 drops a last ceil_mode window that starts in the right padding, which older versions
    (and onnxruntime 1.15's kernels) keep: the pool is the floor one there, or refused where not."""
    x = helper.make_tensor_value_info("x", F32, ["n", 1, 4, 4])
    pool = helper.make_node(op, ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], pads=[0, 0, 1, 1], ceil_mode=1)
    feeds = {"x": np.arange(32, dtype=np.float32).reshape(2, 1, 4, 4)}
    (node,) = onnx.ModelProto.FromString(assert_same(model([pool], [x], ["y"], 22), 21, feeds)).graph.node
    assert helper.get_attribute_value(next(a for a in node.attribute if a.name == "ceil_mode")) == 0
    inside = helper.make_node(op, ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)
    assert_same(model([inside], [x], ["y"], 22), 21, feeds)  # its last window starts inside: kept as it is
    mixed = helper.make_node(
        op, ["x"], ["y"], name="p", kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 1, 1], ceil_mode=1
    )
    with pytest.raises(VersioningError, match=rf"{op} \(node 'p'\).*opset 21: ceil_mode=1 .*some spatial axes only"):
        convert_model(model([mixed], [x], ["y"], 22), 21)
    unknown = helper.make_tensor_value_info("x", F32, ["n", 1, "h", "w"])
    with pytest.raises(
        VersioningError, match=rf"{op} \(node 'p'\).*opset 21: ceil_mode=1 over spatial sizes that are unknown"
    ):
        convert_model(model([mixed], [unknown], ["y"], 22), 21)
