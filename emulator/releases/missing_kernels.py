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
