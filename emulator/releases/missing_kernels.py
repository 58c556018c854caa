"""The kernels onnxruntime releases lack inside the opsets they load: a measured record, read by
the toolchain when it writes a release's versioned plan and checked by ``kernel_probe``."""

from __future__ import annotations

#: Op versions inside a release's opset (``ort_support.json``) for which that release has no kernel,
#: measured on the wheels by ``python -m emulator.releases.kernel_probe`` (a one-node model at each
#: opset 18..max fails with NOT_IMPLEMENTED): onnxruntime 1.15 loads opset 19 models but not these
#: ops' opset-19 versions. A plan for such a release is written at the opset just below the op's version.
MISSING_KERNELS: dict[tuple[int, int], dict[str, int]] = {
    (1, 15): {
        op: 19
        for op in ("AveragePool", "Cast", "CastLike", "Equal", "Identity", "Pad", "QuantizeLinear", "Reshape", "Size")
    },
    (1, 23): {"QuantizeLinear": 23},
    (1, 32): {"QuantizeLinear": 28},
}

#: Element types (``TensorProto`` names) an op's kernel does not take in a release whose opsets the
#: op's definition allows them in, measured by ``kernel_probe`` the same way (a one-node model per
#: type): ``Trilu`` on ``bool``, what torch's ``tril`` of a causal mask and
#: ``scaled_dot_product_attention(is_causal=True)`` export to, has a kernel from onnxruntime 1.19 on,
#: on ``int32`` from 1.26 on. A versioned plan computes such a node in a type the release takes
#: (``emulator/toolchain/versioning.py``: ``int64``, casting around it).
MISSING_TYPE_KERNELS: dict[tuple[int, int], dict[str, tuple[str, ...]]] = {
    **{(1, minor): {"Trilu": ("BOOL", "INT32")} for minor in range(15, 19)},
    **{(1, minor): {"Trilu": ("INT32",)} for minor in range(19, 29)},
}
