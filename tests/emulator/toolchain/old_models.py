"""Small models as the ONNX Model Zoo's older files are written (opsets 6-12, IR versions 3-7), built
with onnx.helper: the ops and attributes of CNTK's MNIST-8, MXNet's and Caffe2's SqueezeNet and ResNet
exports at their opsets, at fixture size. Each builder also writes the same network at opset 13 or
later by hand (``modern=True``): the reference its conversion must train as."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def ir_version(opset: int) -> int:
    """The IR version an exporter of that time wrote with the opset (onnx 1.2-1.7)."""
    return 3 if opset < 8 else 4 if opset < 9 else 5 if opset < 11 else 6 if opset < 12 else 7


def zoo_model(
    nodes,
    inputs,
    output: str,
    initializers: dict[str, np.ndarray],
    opset: int,
    name: str = "zoo",
    shape: list | None = None,
) -> onnx.ModelProto:
    """A model as exporters of its opset wrote it: below IR version 4 every initializer is also a
    graph input, and the output's shape is spelled out (inferred, or ``shape`` for ops that onnx no
    longer knows)."""
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()]
    graph = helper.make_graph(nodes, name, inputs, [helper.make_tensor_value_info(output, F, shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
    if shape is None:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        model.graph.output[0].CopyFrom(inferred.graph.output[0])
    model.ir_version = ir_version(opset)
    if model.ir_version < 4:
        model.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in inits)
    if shape is None:
        onnx.checker.check_model(model)
    return model


def _normal(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mnist8_like(opset: int = 8, *, modern: bool = False, seed: int = 0) -> onnx.ModelProto:
    """CNTK's MNIST-8 at 8x8: ``Conv(auto_pad=SAME_UPPER)`` without bias, ``Plus`` of a [C,1,1]
    bias, ``Relu``, ``MaxPool``, twice; the features reshaped to the batch of one it was exported at
    (``Reshape`` to a constant [1, 32]), the ``Times`` weight kept 4-D and reshaped to [32, 10] in
    the graph, ``MatMul`` and ``Plus`` of a [1, 10] bias. ``modern``: explicit pads, ``Flatten``
    for the batch, opset 17."""
    rng = np.random.default_rng(seed)
    w = {
        "Parameter5": _normal(rng, 4, 1, 3, 3),
        "Parameter6": _normal(rng, 4, 1, 1, scale=0.1),
        "Parameter87": _normal(rng, 8, 4, 3, 3, scale=0.2),
        "Parameter88": _normal(rng, 8, 1, 1, scale=0.1),
        "Parameter193": _normal(rng, 8, 2, 2, 10, scale=0.2),
        "Parameter194": _normal(rng, 1, 10, scale=0.1),
        "Parameter193_reshape1_shape": np.array([32, 10], np.int64),
    }
    pad = {"pads": [1, 1, 1, 1]} if modern else {"auto_pad": "SAME_UPPER"}
    nodes = [
        helper.make_node("Conv", ["Input3", "Parameter5"], ["Convolution28_Output_0"], kernel_shape=[3, 3], **pad),
        helper.make_node("Add", ["Convolution28_Output_0", "Parameter6"], ["Plus30_Output_0"]),
        helper.make_node("Relu", ["Plus30_Output_0"], ["ReLU32_Output_0"]),
        helper.make_node("MaxPool", ["ReLU32_Output_0"], ["Pooling66_Output_0"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node(
            "Conv", ["Pooling66_Output_0", "Parameter87"], ["Convolution110_Output_0"], kernel_shape=[3, 3], **pad
        ),
        helper.make_node("Add", ["Convolution110_Output_0", "Parameter88"], ["Plus112_Output_0"]),
        helper.make_node("Relu", ["Plus112_Output_0"], ["ReLU114_Output_0"]),
        helper.make_node("MaxPool", ["ReLU114_Output_0"], ["Pooling160_Output_0"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["Parameter193", "Parameter193_reshape1_shape"], ["Parameter193_reshape1"]),
        helper.make_node("MatMul", ["Pooling160_Output_0_reshape0", "Parameter193_reshape1"], ["Times212_Output_0"]),
        helper.make_node("Add", ["Times212_Output_0", "Parameter194"], ["Plus214_Output_0"]),
    ]
    if modern:
        nodes.insert(8, helper.make_node("Flatten", ["Pooling160_Output_0"], ["Pooling160_Output_0_reshape0"]))
    else:
        w["Pooling160_Output_0_reshape0_shape"] = np.array([1, 32], np.int64)
        nodes.insert(
            8,
            helper.make_node(
                "Reshape",
                ["Pooling160_Output_0", "Pooling160_Output_0_reshape0_shape"],
                ["Pooling160_Output_0_reshape0"],
            ),
        )
    x = helper.make_tensor_value_info("Input3", F, [1, 1, 8, 8])
    return zoo_model(nodes, [x], "Plus214_Output_0", w, 17 if modern else opset, "CNTKGraph")


def _fire(prefix: str, x: str, cin: int, squeeze: int, expand: int, rng, w: dict) -> tuple[list, str]:
    """A SqueezeNet fire module: a 1x1 squeeze and its 1x1 and 3x3 expansions, concatenated."""
    w[f"{prefix}_squeeze_w"] = _normal(rng, squeeze, cin, 1, 1)
    w[f"{prefix}_squeeze_b"] = _normal(rng, squeeze, scale=0.05)
    w[f"{prefix}_e1_w"] = _normal(rng, expand, squeeze, 1, 1)
    w[f"{prefix}_e1_b"] = _normal(rng, expand, scale=0.05)
    w[f"{prefix}_e3_w"] = _normal(rng, expand, squeeze, 3, 3, scale=0.2)
    w[f"{prefix}_e3_b"] = _normal(rng, expand, scale=0.05)
    nodes = [
        helper.make_node(
            "Conv", [x, f"{prefix}_squeeze_w", f"{prefix}_squeeze_b"], [f"{prefix}_s"], kernel_shape=[1, 1]
        ),
        helper.make_node("Relu", [f"{prefix}_s"], [f"{prefix}_sr"]),
        helper.make_node(
            "Conv", [f"{prefix}_sr", f"{prefix}_e1_w", f"{prefix}_e1_b"], [f"{prefix}_e1"], kernel_shape=[1, 1]
        ),
        helper.make_node("Relu", [f"{prefix}_e1"], [f"{prefix}_e1r"]),
        helper.make_node(
            "Conv",
            [f"{prefix}_sr", f"{prefix}_e3_w", f"{prefix}_e3_b"],
            [f"{prefix}_e3"],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", [f"{prefix}_e3"], [f"{prefix}_e3r"]),
        helper.make_node("Concat", [f"{prefix}_e1r", f"{prefix}_e3r"], [f"{prefix}_concat"], axis=1),
    ]
    return nodes, f"{prefix}_concat"


def squeezenet_like(
    opset: int = 7, *, modern: bool = False, ratio: float = 0.5, softmax: bool = True, seed: int = 0
) -> onnx.ModelProto:
    """SqueezeNet 1.0 as its opset-7 zoo file: a strided conv and max pool, two fire modules
    (``Concat`` of the expansions), ``Dropout(ratio=...)`` as an attribute, a 1x1 classifier conv,
    ``GlobalAveragePool`` and ``Softmax`` over the [N, 10, 1, 1] scores with opset 7's default
    axis 1, which normalizes each example's scores flattened to 2-D. ``modern``: opset 17, the
    ratio an input, and the softmax written as that flattening (``Flatten``, ``Softmax``,
    ``Reshape`` back). Without ``softmax`` the pooled [N, 10, 1, 1] scores are the output."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {"conv1_w": _normal(rng, 8, 3, 3, 3), "conv1_b": _normal(rng, 8, scale=0.05)}
    nodes = [
        helper.make_node("Conv", ["data_0", "conv1_w", "conv1_b"], ["conv1"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Relu", ["conv1"], ["conv1r"]),
        helper.make_node("MaxPool", ["conv1r"], ["pool1"], kernel_shape=[3, 3], strides=[2, 2]),
    ]
    fire2, x = _fire("fire2", "pool1", 8, 4, 8, rng, w)
    fire3, x = _fire("fire3", x, 16, 4, 8, rng, w)
    nodes += fire2 + fire3
    if modern or opset >= 12:
        w["drop_ratio"] = np.array(ratio, np.float32)
        nodes.append(helper.make_node("Dropout", [x, "drop_ratio"], ["drop9"]))
    else:
        nodes.append(helper.make_node("Dropout", [x], ["drop9"], ratio=ratio))
    w["conv10_w"] = _normal(rng, 10, 16, 1, 1)
    w["conv10_b"] = _normal(rng, 10, scale=0.05)
    nodes += [
        helper.make_node("Conv", ["drop9", "conv10_w", "conv10_b"], ["conv10"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["conv10"], ["conv10r"]),
        helper.make_node("GlobalAveragePool", ["conv10r"], ["pool10"]),
    ]
    if not softmax:
        nodes[-1].output[0] = "softmaxout_1"
    elif modern:
        nodes += [
            helper.make_node("Shape", ["pool10"], ["pool10_shape"]),
            helper.make_node("Flatten", ["pool10"], ["pool10_flat"]),
            helper.make_node("Softmax", ["pool10_flat"], ["softmax_flat"], axis=1),
            helper.make_node("Reshape", ["softmax_flat", "pool10_shape"], ["softmaxout_1"]),
        ]
    else:
        nodes.append(helper.make_node("Softmax", ["pool10"], ["softmaxout_1"]))
    x0 = helper.make_tensor_value_info("data_0", F, [1, 3, 16, 16])
    return zoo_model(nodes, [x0], "softmaxout_1", w, 17 if modern else opset, "squeezenet")


def _bn(prefix: str, x: str, channels: int, rng, w: dict, *, modern: bool, opset: int) -> onnx.NodeProto:
    w[f"{prefix}_gamma"] = (1 + rng.standard_normal(channels) * 0.1).astype(np.float32)
    w[f"{prefix}_beta"] = _normal(rng, channels, scale=0.1)
    w[f"{prefix}_moving_mean"] = _normal(rng, channels, scale=0.1)
    w[f"{prefix}_moving_var"] = np.exp(rng.standard_normal(channels) * 0.1).astype(np.float32)
    spatial = {} if modern or opset >= 9 else {"spatial": 1}
    return helper.make_node(
        "BatchNormalization",
        [x, *(f"{prefix}_{k}" for k in ("gamma", "beta", "moving_mean", "moving_var"))],
        [f"{prefix}_fwd"],
        epsilon=1e-5,
        momentum=0.9,
        **spatial,
    )


def mxnet_resnet_like(opset: int = 7, *, modern: bool = False, seed: int = 0) -> onnx.ModelProto:
    """MXNet's resnet18-v1 as its opset-7 zoo file, one basic block: convolutions without bias,
    ``BatchNormalization`` with ``spatial=1`` (opsets 7 and 8), the residual ``Add``,
    ``GlobalAveragePool``, ``Flatten`` and ``Gemm(transB=1)`` (with opset 6's ``broadcast=1``)."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "conv0_weight": _normal(rng, 8, 3, 3, 3),
        "stage1_conv0_weight": _normal(rng, 8, 8, 3, 3, scale=0.15),
        "stage1_conv1_weight": _normal(rng, 8, 8, 3, 3, scale=0.15),
        "dense0_weight": _normal(rng, 10, 8),
        "dense0_bias": _normal(rng, 10, scale=0.05),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    version = 17 if modern else opset
    nodes = [
        helper.make_node("Conv", ["data", "conv0_weight"], ["conv0_fwd"], **conv),
        _bn("batchnorm0", "conv0_fwd", 8, rng, w, modern=modern, opset=opset),
        helper.make_node("Relu", ["batchnorm0_fwd"], ["relu0_fwd"]),
        helper.make_node("Conv", ["relu0_fwd", "stage1_conv0_weight"], ["stage1_conv0_fwd"], **conv),
        _bn("stage1_batchnorm0", "stage1_conv0_fwd", 8, rng, w, modern=modern, opset=opset),
        helper.make_node("Relu", ["stage1_batchnorm0_fwd"], ["stage1_relu0_fwd"]),
        helper.make_node("Conv", ["stage1_relu0_fwd", "stage1_conv1_weight"], ["stage1_conv1_fwd"], **conv),
        _bn("stage1_batchnorm1", "stage1_conv1_fwd", 8, rng, w, modern=modern, opset=opset),
        helper.make_node("Add", ["relu0_fwd", "stage1_batchnorm1_fwd"], ["stage1__plus0"]),
        helper.make_node("Relu", ["stage1__plus0"], ["stage1_activation0"]),
        helper.make_node("GlobalAveragePool", ["stage1_activation0"], ["pool1_fwd"]),
        helper.make_node("Flatten", ["pool1_fwd"], ["flatten_fwd"], axis=1),
        helper.make_node(
            "Gemm",
            ["flatten_fwd", "dense0_weight", "dense0_bias"],
            ["dense0_fwd"],
            alpha=1.0,
            beta=1.0,
            transB=1,
            **({"broadcast": 1} if version < 7 else {}),
        ),
    ]
    x = helper.make_tensor_value_info("data", F, [1, 3, 8, 8])
    return zoo_model(nodes, [x], "dense0_fwd", w, version, "mxnet_resnet")


def caffe2_misc(opset: int = 8, *, modern: bool = False, seed: int = 0) -> onnx.ModelProto:
    """The other ops older files write with attributes that later became inputs: ``Clip(min, max)``,
    ``Upsample(scales)`` (an input at opset 9), ``Pad(pads)``, ``ReduceMean(axes)``,
    ``Unsqueeze``/``Squeeze(axes)``, and ``Sum`` of a skip connection; ``modern``: opset 17's
    ``Clip`` bounds, ``Resize``, ``Pad``, ``Unsqueeze`` and ``Squeeze`` inputs."""
    rng = np.random.default_rng(seed)
    version = 17 if modern else opset
    w: dict[str, np.ndarray] = {
        "conv1_w": _normal(rng, 4, 3, 3, 3),
        "conv1_b": _normal(rng, 4, scale=0.05),
        "conv2_w": _normal(rng, 4, 4, 3, 3, scale=0.2),
        "fc_w": _normal(rng, 10, 4),
        "fc_b": _normal(rng, 10, scale=0.05),
    }
    if version >= 11:
        w["clip_min"], w["clip_max"] = np.array(0.0, np.float32), np.array(6.0, np.float32)
        w["pads"] = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
        clip = helper.make_node("Clip", ["conv1", "clip_min", "clip_max"], ["clip"])
        pad = helper.make_node("Pad", ["sum", "pads"], ["padded"])
    else:
        clip = helper.make_node("Clip", ["conv1"], ["clip"], min=0.0, max=6.0)
        pad = helper.make_node("Pad", ["sum"], ["padded"], pads=[0, 0, 1, 1, 0, 0, 1, 1])
    if version >= 11:
        w["roi"], w["scales"] = np.zeros(0, np.float32), np.array([1, 1, 2, 2], np.float32)
        up = helper.make_node("Resize", ["pool", "roi", "scales"], ["up"], mode="nearest")
    elif version == 10:
        w["scales"] = np.array([1, 1, 2, 2], np.float32)
        up = helper.make_node("Resize", ["pool", "scales"], ["up"], mode="nearest")
    elif version == 9:
        w["scales"] = np.array([1, 1, 2, 2], np.float32)
        up = helper.make_node("Upsample", ["pool", "scales"], ["up"], mode="nearest")
    else:
        up = helper.make_node("Upsample", ["pool"], ["up"], mode="nearest", scales=[1.0, 1.0, 2.0, 2.0])
    if version >= 13:
        w["axis2"] = np.array([2], np.int64)
        w["axes23"] = np.array([2, 3], np.int64)
        squeeze = [
            helper.make_node("ReduceMean", ["conv2"], ["mean"], axes=[2, 3], keepdims=0),
            helper.make_node("Unsqueeze", ["mean", "axis2"], ["mean3"]),
            helper.make_node("Squeeze", ["mean3", "axis2"], ["features"]),
        ]
    else:
        squeeze = [
            helper.make_node("ReduceMean", ["conv2"], ["mean"], axes=[2, 3], keepdims=0),
            helper.make_node("Unsqueeze", ["mean"], ["mean3"], axes=[2]),
            helper.make_node("Squeeze", ["mean3"], ["features"], axes=[2]),
        ]
    nodes = [
        helper.make_node("Conv", ["data", "conv1_w", "conv1_b"], ["conv1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        clip,
        helper.make_node("MaxPool", ["clip"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        up,
        helper.make_node("Sum", ["up", "clip", "conv1"], ["sum"]),
        pad,
        helper.make_node("Conv", ["padded", "conv2_w"], ["conv2"], kernel_shape=[3, 3]),
        *squeeze,
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    x = helper.make_tensor_value_info("data", F, ["N", 3, 8, 8])
    return zoo_model(nodes, [x], "logits", w, version, "caffe2_misc")


def upsampling(opset: int = 9, *, mode: str = "nearest", scale: float = 2.0, modern: bool = False, seed: int = 0):
    """A decoder's upsampling as opsets 7-10 write it: ``Upsample`` (scales an attribute at opsets 7
    and 8, an input at 9) or opset 10's ``Resize``, both mapping output pixels to input ones
    asymmetrically (``x / scale``, nearest flooring it), between two convolutions; ``modern``:
    opset 17's ``Resize`` told so (``coordinate_transformation_mode=asymmetric``)."""
    rng = np.random.default_rng(seed)
    version = 17 if modern else opset
    w: dict[str, np.ndarray] = {
        "conv1_w": _normal(rng, 4, 3, 3, 3),
        "conv2_w": _normal(rng, 4, 4, 3, 3, scale=0.2),
        "fc_w": _normal(rng, 10, 4),
        "fc_b": _normal(rng, 10, scale=0.05),
    }
    scales = [1.0, 1.0, scale, scale]
    if version >= 11:
        w["roi"], w["scales"] = np.zeros(0, np.float32), np.array(scales, np.float32)
        floor = {"nearest_mode": "floor"} if mode == "nearest" else {}
        up = helper.make_node(
            "Resize",
            ["conv1", "roi", "scales"],
            ["up"],
            mode=mode,
            coordinate_transformation_mode="asymmetric",
            **floor,
        )
    elif version >= 9:
        w["scales"] = np.array(scales, np.float32)
        up = helper.make_node("Resize" if version == 10 else "Upsample", ["conv1", "scales"], ["up"], mode=mode)
    else:
        up = helper.make_node("Upsample", ["conv1"], ["up"], mode=mode, scales=scales)
    nodes = [
        helper.make_node("Conv", ["data", "conv1_w"], ["conv1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        up,
        helper.make_node("Conv", ["up", "conv2_w"], ["conv2"], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv2"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    x = helper.make_tensor_value_info("data", F, ["N", 3, 6, 6])
    return zoo_model(nodes, [x], "logits", w, version, "upsampling")


def experimental_ops(opset: int = 8, *, modern: bool = False, crop: bool = False, seed: int = 0) -> onnx.ModelProto:
    """The experimental ops of opsets 1-9 that later opsets dropped, as the Model Zoo's tiny YOLOv2
    scales its input: ``ImageScaler(scale, bias)``, then a conv, ``ScaledTanh`` and ``Affine``, a
    pooled ``Gemm``; ``crop`` puts ``Crop`` (no standard op of any opset) after the conv.
    ``modern``: the ops they compute (``Mul``, ``Add``, ``Tanh``) at opset 17."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "conv_w": _normal(rng, 4, 3, 3, 3),
        "fc_w": _normal(rng, 10, 4),
        "fc_b": _normal(rng, 10, scale=0.05),
    }
    bias = [-0.5, 0.1, 0.3]
    if modern:  # the attributes' values as constants, as they were: not weights
        values = {
            "scale": np.array(0.5, np.float32),
            "bias": np.array(bias, np.float32).reshape(1, 3, 1, 1),
            "beta": np.array(0.7, np.float32),
            "alpha": np.array(1.5, np.float32),
            "a": np.array(0.8, np.float32),
            "b": np.array(0.2, np.float32),
        }
        constants = [
            helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k)) for k, v in values.items()
        ]
        head = [
            *constants,
            helper.make_node("Mul", ["data", "scale"], ["scaled0"]),
            helper.make_node("Add", ["scaled0", "bias"], ["scaled"]),
        ]
        middle = [
            helper.make_node("Mul", ["conv", "beta"], ["inner"]),
            helper.make_node("Tanh", ["inner"], ["tanh"]),
            helper.make_node("Mul", ["tanh", "alpha"], ["squashed"]),
            helper.make_node("Mul", ["squashed", "a"], ["affine0"]),
            helper.make_node("Add", ["affine0", "b"], ["affine"]),
        ]
    else:
        head = [helper.make_node("ImageScaler", ["data"], ["scaled"], scale=0.5, bias=bias)]
        middle = [
            helper.make_node("ScaledTanh", ["conv"], ["squashed"], alpha=1.5, beta=0.7),
            helper.make_node("Affine", ["squashed"], ["affine"], alpha=0.8, beta=0.2),
        ]
    if crop:
        middle.insert(0, helper.make_node("Crop", ["conv"], ["cropped"], border=[1, 1, 1, 1], name="crop1"))
        middle[1].input[0] = "cropped"
    nodes = [
        *head,
        helper.make_node("Conv", ["scaled", "conv_w"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        *middle,
        helper.make_node("GlobalAveragePool", ["affine"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
        helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"], transB=1),
    ]
    x = helper.make_tensor_value_info("data", F, ["N", 3, 6, 6])
    return zoo_model(nodes, [x], "logits", w, 17 if modern else opset, "experimental", shape=["N", 10])


def dense_batch_norm(spatial: int, opset: int = 7, seed: int = 0) -> onnx.ModelProto:
    """CNTK's dense layer with BatchNormalization over [N, C] written with ``spatial`` (0 or 1, one
    scale per channel either way), over 3x6x6 inputs flattened."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {"w1": _normal(rng, 108, 16, scale=0.1), "w2": _normal(rng, 16, 10)}
    nodes = [
        helper.make_node("Flatten", ["data"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w1"], ["dense"]),
        _bn("bn", "dense", 16, rng, w, modern=False, opset=opset),
        helper.make_node("Relu", ["bn_fwd"], ["relu"]),
        helper.make_node("MatMul", ["relu", "w2"], ["logits"]),
    ]
    next(a for a in nodes[2].attribute if a.name == "spatial").i = spatial
    x = helper.make_tensor_value_info("data", F, ["N", 3, 6, 6])
    return zoo_model(nodes, [x], "logits", w, opset, "dense_batch_norm")


def caffenet_like(opset: int = 7, *, modern: bool = False, seed: int = 0) -> onnx.ModelProto:
    """Caffe2's bvlc_alexnet and CaffeNet as their zoo files: ``Conv``, ``Relu``, ``LRN(size=5)``,
    an overlapping ``MaxPool`` (3x3, stride 2), a second conv block, ``Gemm`` layers with ``Dropout``
    between them and a ``Softmax``; ``modern``: the same ops at opset 17 (the ratio an input)."""
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "conv1_w": _normal(rng, 6, 3, 3, 3),
        "conv1_b": _normal(rng, 6, scale=0.05),
        "conv2_w": _normal(rng, 8, 6, 3, 3, scale=0.2),
        "conv2_b": _normal(rng, 8, scale=0.05),
        "fc6_w": _normal(rng, 16, 8, scale=0.3),
        "fc6_b": _normal(rng, 16, scale=0.05),
        "fc8_w": _normal(rng, 10, 16),
        "fc8_b": _normal(rng, 10, scale=0.05),
    }
    if modern or opset >= 12:
        w["drop_ratio"] = np.array(0.5, np.float32)
        dropout = helper.make_node("Dropout", ["fc6r", "drop_ratio"], ["drop6"])
    else:
        dropout = helper.make_node("Dropout", ["fc6r"], ["drop6"], ratio=0.5)
    lrn = {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 1.0}
    nodes = [
        helper.make_node("Conv", ["data_0", "conv1_w", "conv1_b"], ["conv1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv1"], ["conv1r"]),
        helper.make_node("LRN", ["conv1r"], ["norm1"], **lrn),
        helper.make_node("MaxPool", ["norm1"], ["pool1"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("Conv", ["pool1", "conv2_w", "conv2_b"], ["conv2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv2"], ["conv2r"]),
        helper.make_node("LRN", ["conv2r"], ["norm2"], **lrn),
        helper.make_node("GlobalMaxPool", ["norm2"], ["pool2"]),
        helper.make_node("Flatten", ["pool2"], ["pool2_flat"]),
        helper.make_node("Gemm", ["pool2_flat", "fc6_w", "fc6_b"], ["fc6"], transB=1),
        helper.make_node("Relu", ["fc6"], ["fc6r"]),
        dropout,
        helper.make_node("Gemm", ["drop6", "fc8_w", "fc8_b"], ["fc8"], transB=1),
        helper.make_node("Softmax", ["fc8"], ["prob_1"]),
    ]
    x = helper.make_tensor_value_info("data_0", F, [1, 3, 9, 9])
    return zoo_model(nodes, [x], "prob_1", w, 17 if modern else opset, "caffenet")
