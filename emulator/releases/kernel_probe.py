"""Measure which op versions inside a release's opset have no kernel in that release.

``ort_support.json`` records the highest opset each release *loads*; a release can still lack the
kernel of an op's newest version at that opset (onnxruntime 1.15 loads opset 19 models but has no
``Equal``-19 kernel). :data:`emulator.releases.missing_kernels.MISSING_KERNELS` is that record; this
module re-measures it on the real wheels: a one-node model per op at each opset from 18 to the
release's maximum, built here and sent to the release's env (:mod:`emulator.releases.envs`), counts
as missing when session creation fails with NOT_IMPLEMENTED. The ops of :data:`PROBED_TYPES` are
also probed in each element type they list, at opset 18, against
:data:`~emulator.releases.missing_kernels.MISSING_TYPE_KERNELS`.

Run ``python -m emulator.releases.kernel_probe [--releases 1.15.1 1.16.3]``: one JSON line per
release with its missing ``{op: version}`` and ``{op: [types]}``, and a last line comparing them
with the record.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from device_runtime.plan import ir_version_for_opset, max_opset_for_runtime
from device_runtime.versions import version_tuple
from emulator.releases.envs import RuntimeEnv, available_releases

from .missing_kernels import MISSING_KERNELS, MISSING_TYPE_KERNELS

__all__ = [
    "PROBED_OPS",
    "PROBED_TYPES",
    "main",
    "missing_kernels",
    "missing_type_kernels",
    "probe_model",
    "typed_probe_model",
]

FIRST_OPSET = 18
_F = TensorProto.FLOAT

# op -> (inputs, initializers, attributes, output type, input shape, output shape)
PROBED_OPS: dict[str, tuple] = {
    "Equal": (["x", "x"], {}, {}, TensorProto.BOOL, [2, 3], [2, 3]),
    "Cast": (["x"], {}, {"to": _F}, _F, [2, 3], [2, 3]),
    "CastLike": (["x", "x"], {}, {}, _F, [2, 3], [2, 3]),
    "Reshape": (["x", "s"], {"s": np.array([3, 2], np.int64)}, {}, _F, [2, 3], [3, 2]),
    "Shape": (["x"], {}, {}, TensorProto.INT64, [2, 3], [2]),
    "Size": (["x"], {}, {}, TensorProto.INT64, [2, 3], []),
    "Identity": (["x"], {}, {}, _F, [2, 3], [2, 3]),
    "Pad": (["x", "p"], {"p": np.array([0, 1, 0, 1], np.int64)}, {}, _F, [2, 3], [2, 5]),
    "ConstantOfShape": (
        ["s"],
        {"s": np.array([2, 3], np.int64)},
        {"value": numpy_helper.from_array(np.zeros(1, np.float32))},
        _F,
        None,
        [2, 3],
    ),
    "Squeeze": (["x", "a"], {"a": np.array([0], np.int64)}, {}, _F, [1, 3], [3]),
    "Unsqueeze": (["x", "a"], {"a": np.array([0], np.int64)}, {}, _F, [2, 3], [1, 2, 3]),
    "Transpose": (["x"], {}, {}, _F, [2, 3], [3, 2]),
    "Flatten": (["x"], {}, {}, _F, [2, 3], [2, 3]),
    "ReduceMax": (["x", "a"], {"a": np.array([1], np.int64)}, {"keepdims": 0}, _F, [2, 3], [2]),
    "ReduceMin": (["x", "a"], {"a": np.array([1], np.int64)}, {"keepdims": 0}, _F, [2, 3], [2]),
    "Relu": (["x"], {}, {}, _F, [2, 3], [2, 3]),
    "AveragePool": (["x"], {}, {"kernel_shape": [2, 2]}, _F, [1, 1, 4, 4], [1, 1, 3, 3]),
    "QuantizeLinear": (["x", "s"], {"s": np.array(0.1, np.float32)}, {}, TensorProto.UINT8, [2, 3], [2, 3]),
}

#: Ops probed per element type (``TensorProto`` names), each a one-node model at opset 18 whose
#: first input and output take the type: op -> (types, extra inputs, initializers, attributes, shape).
PROBED_TYPES: dict[str, tuple] = {
    "Trilu": (("BOOL", "INT32"), [], {}, {"upper": 0}, [3, 3]),
}

_PROBE = """\
import base64, onnxruntime as ort
missing = {}
for key, model in payload.items():
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        ort.InferenceSession(base64.b64decode(model), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" in str(exc):
            missing[key] = str(exc).splitlines()[0][:200]
result = missing
"""


def probe_model(op: str, opset: int) -> bytes:
    """A one-node model of ``op`` at ``opset`` (default domain), at the lowest IR that carries it."""
    inputs, initializers, attributes, out_type, in_shape, out_shape = PROBED_OPS[op]
    graph_inputs = [helper.make_tensor_value_info("x", _F, in_shape)] if in_shape is not None else []
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attributes)],
        f"probe_{op}",
        graph_inputs,
        [helper.make_tensor_value_info("y", out_type, out_shape)],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version_for_opset(opset)
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def typed_probe_model(op: str, type_name: str) -> bytes:
    """A one-node model of ``op`` at opset 18 whose input ``x`` and output have element type ``type_name``."""
    _types, extra, initializers, attributes, shape = PROBED_TYPES[op]
    elem = TensorProto.DataType.Value(type_name)
    graph = helper.make_graph(
        [helper.make_node(op, ["x", *extra], ["y"], **attributes)],
        f"probe_{op}_{type_name.lower()}",
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, shape)],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", FIRST_OPSET)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def missing_type_kernels(release: str, env: RuntimeEnv | None = None) -> dict[str, tuple[str, ...]]:
    """The probed ops of :data:`PROBED_TYPES` whose kernel in ``release`` does not take some of the
    listed element types: op -> those types (in the listed order)."""
    env = env or RuntimeEnv.for_release(release)
    payload = {
        f"{op}@{name}": base64.b64encode(typed_probe_model(op, name)).decode()
        for op, (types, *_rest) in PROBED_TYPES.items()
        for name in types
    }
    found = env.run_json(_PROBE, payload)
    return {
        op: tuple(name for name in types if f"{op}@{name}" in found)
        for op, (types, *_rest) in PROBED_TYPES.items()
        if any(f"{op}@{name}" in found for name in types)
    }


def missing_kernels(release: str, env: RuntimeEnv | None = None) -> dict[str, int]:
    """The probed ops whose version at some opset in [18, the release's max] has no kernel in
    ``release``: op -> the first such version (the op's ``since_version`` at that opset)."""
    env = env or RuntimeEnv.for_release(release)
    payload: dict[str, object] = {}
    for op in PROBED_OPS:
        for opset in range(FIRST_OPSET, max_opset_for_runtime(release) + 1):
            since = onnx.defs.get_schema(op, opset, "").since_version
            payload.setdefault(f"{op}@{since}", base64.b64encode(probe_model(op, opset)).decode())
    found = env.run_json(_PROBE, payload)
    out: dict[str, int] = {}
    for key in found:
        op, since = key.split("@")
        out[op] = min(out.get(op, int(since)), int(since))
    return dict(sorted(out.items()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.releases.kernel_probe", description=__doc__)
    parser.add_argument("--releases", nargs="+", default=available_releases())
    args = parser.parse_args(argv)
    differs = []
    for release in args.releases:
        measured = missing_kernels(release)
        measured_types = missing_type_kernels(release)
        minor = version_tuple(release)[:2]
        recorded = {op: v for op, v in MISSING_KERNELS.get(minor, {}).items() if op in PROBED_OPS}
        recorded_types = {op: t for op, t in MISSING_TYPE_KERNELS.get(minor, {}).items() if op in PROBED_TYPES}
        line = {"release": release, "missing": measured, "missing_types": measured_types}
        print(json.dumps(line), flush=True)
        if measured != recorded or measured_types != recorded_types:
            differs.append(release)
    print(json.dumps({"summary": "matches MISSING_KERNELS" if not differs else "differs", "releases": differs}))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
