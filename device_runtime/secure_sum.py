"""A plan's client update as one integer vector for Secure Aggregation, and back.

Device and server share this codec so that both lay out, quantize and dequantize the update in
exactly the same way: entries in the order of ``plan.server.secure_sum``, each clipped to the
plan's clip range and quantized to its bitwidth (``secagg.Quantizer``)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from secagg import Quantizer, SecAggConfig, modulus_for

from .executor import PlanExecutor
from .plan import Plan, PlanError


class SecureSumCodec:
    def __init__(self, plan: Plan, executor: PlanExecutor | None = None) -> None:
        server = plan.server
        if not server.secure_sum or server.bitwidth is None or server.clip_range is None:
            raise PlanError(f"plan {plan.name!r} sends nothing to secure sum")
        spec = (executor or PlanExecutor(plan)).client_update_spec()
        missing = [n for n in server.secure_sum if n not in spec]
        if missing:
            raise PlanError(f"the plan's secure_sum names {missing}, which are not in its client update")
        if set(server.secure_sum) != set(spec):
            raise PlanError("every client-update tensor must go to secure sum (mixed aggregation is not supported)")
        self.names = tuple(server.secure_sum)
        self.shapes = {n: tuple(spec[n][0]) for n in self.names}
        self.sizes = [int(np.prod(self.shapes[n], dtype=np.int64)) for n in self.names]
        self.vector_length = int(sum(self.sizes))
        self.bitwidth = server.bitwidth
        self.quantizer = Quantizer(bitwidth=server.bitwidth, clip=server.clip_range)

    def modulus(self, cohort: int) -> int:
        return modulus_for(cohort, self.bitwidth)

    @property
    def max_count(self) -> float:
        """The largest example count one encoding carries whole (the clip range): a device caps
        its count there too, or the count would be clipped while its weights were not."""
        return self.quantizer.clip

    def sum_error(self, count: int) -> float:
        """The largest error of one entry of ``decode_sum`` over ``count`` encodings: under one
        quantization step per encoding (stochastic rounding), plus the float32 rounding of a sum
        of at most ``count * clip``."""
        return count * (1.0 / self.quantizer.scale + self.quantizer.clip * 2.0**-23)

    def encode(self, update: Mapping[str, np.ndarray], rng: np.random.Generator | None = None) -> np.ndarray:
        """Flatten and quantize (stochastic rounding when ``rng`` is given: unbiased sums)."""
        flat = np.concatenate([np.asarray(update[n], dtype=np.float64).reshape(-1) for n in self.names])
        return self.quantizer.quantize(flat, rng)

    def decode_sum(self, total: np.ndarray, count: int) -> dict[str, np.ndarray]:
        """The float sum of ``count`` clients' updates from the secure sum of their encodings."""
        flat = self.quantizer.dequantize_sum(total, count)
        out, pos = {}, 0
        for name, size in zip(self.names, self.sizes):
            out[name] = flat[pos : pos + size].reshape(self.shapes[name]).astype(np.float32)
            pos += size
        return out


def config_to_json(config: SecAggConfig) -> dict:
    return {
        "vector_length": config.vector_length,
        "modulus": config.modulus,
        "threshold": config.threshold,
        "session_label": base64.b64encode(config.session_label).decode(),
        "degree": config.degree,
        "consistency_check": config.consistency_check,
        "min_summed": config.min_summed,
        "graph_commitment": base64.b64encode(config.graph_commitment).decode(),
    }


def config_from_json(data: dict) -> SecAggConfig:
    """Parse the server's SecAgg parameters; malformed ones raise ValueError (or ConfigError).

    Parsed as the server sent them (``allow_unsafe``): whether they are safe enough is the
    device's privacy floor's call (``SecAggPolicy``), which refuses them with a reason."""
    if not isinstance(data, dict):
        raise ValueError("SecAgg config must be an object")
    ints: dict[str, Any] = {k: data.get(k) for k in ("vector_length", "modulus", "threshold")}
    if any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values()):
        raise ValueError("SecAgg config needs integer vector_length, modulus and threshold")
    degree = data.get("degree")
    if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)):
        raise ValueError("SecAgg degree must be an integer or null")
    min_summed = data.get("min_summed", 0)
    if isinstance(min_summed, bool) or not isinstance(min_summed, int):
        raise ValueError("SecAgg min_summed must be an integer")
    return SecAggConfig(
        vector_length=ints["vector_length"],
        modulus=ints["modulus"],
        threshold=ints["threshold"],
        session_label=base64.b64decode(str(data.get("session_label", "")), validate=True),
        degree=degree,
        consistency_check=data.get("consistency_check") is True,
        min_summed=min_summed,
        graph_commitment=base64.b64decode(str(data.get("graph_commitment", "")), validate=True),
        allow_unsafe=True,
    )
