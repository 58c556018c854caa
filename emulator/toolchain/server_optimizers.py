"""The server part of generated plans (MapReduceForm graphs), with FedAvg and the adaptive server
optimizers of Reddi et al., "Adaptive Federated Optimization" (ICLR 2021): FedAvgM, FedAdam,
FedYogi.

The aggregate of a round is the example-weighted mean client delta ``d`` (a client reports
``(w_final - w_initial) * n``); the server treats ``-d`` as a pseudo-gradient:

* FedAvg:  ``w += lr * d``
* FedAvgM: ``m = beta*m + d;  w += lr * m``
* FedAdam: ``m = b1*m + (1-b1)*d;  v = b2*v + (1-b2)*d^2;  w += lr * m / (sqrt(v) + tau)``
* FedYogi: as FedAdam but ``v = v - (1-b2) * d^2 * sign(v - d^2)``

``m`` and ``v`` persist across rounds as server state (``server_state/<opt>/<weight>``, see
:data:`device_runtime.executor.SERVER_STATE_PREFIX`): the ``update`` graph reads and writes them,
the server keeps them in its checkpoint, devices never see them. The optimizer moves only the
trainable weights; running statistics and client optimizer state are averaged (FedAvg with rate 1)
or, for client optimizer state that does not carry over, reset to zero.

These are the paper's Algorithm 2 as written: no bias correction, and ``m`` and ``v`` start at zero
(the paper allows any ``v`` at or above ``tau^2``). Flower's ``FedAvg``, ``FedAvgM`` and ``FedYogi``
take the same steps; its ``FedAdam`` also multiplies ``lr`` by Adam's bias correction
``sqrt(1 - b2^t) / (1 - b1^t)`` (t the round plus one), 0.74 in round 1 at the defaults here.

Sums are float64 (no sum of finite float32 reports can overflow); weights and state are float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from device_runtime.executor import NUM_EXAMPLES
from device_runtime.plan import ServerPart, ir_version_for_opset
from device_runtime.plan_builder import summing_graphs
from device_runtime.server_ops import SERVER_STATE_PREFIX

_F32, _F64 = TensorProto.FLOAT, TensorProto.DOUBLE


@dataclass(frozen=True)
class FedAvg:
    lr: float = 1.0

    def slots(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True)
class FedAvgM:
    lr: float = 1.0
    momentum: float = 0.9

    def slots(self) -> tuple[str, ...]:
        return ("m",)


@dataclass(frozen=True)
class FedAdam:
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def slots(self) -> tuple[str, ...]:
        return ("m", "v")


@dataclass(frozen=True)
class FedYogi(FedAdam):
    pass


ServerOptimizer = FedAvg | FedAvgM | FedAdam | FedYogi


def check_server_optimizer(opt: ServerOptimizer) -> None:
    if not isinstance(opt, (FedAvg, FedAvgM, FedAdam)):
        raise TypeError(f"server_optimizer must be FedAvg, FedAvgM, FedAdam or FedYogi, got {type(opt).__name__}")
    values = {k: float(v) for k, v in vars(opt).items()}
    if not all(math.isfinite(v) for v in values.values()) or values["lr"] <= 0:
        raise ValueError(f"{type(opt).__name__}: lr must be a positive number, got {opt}")
    for k in ("momentum", "beta1", "beta2"):
        if k in values and not 0.0 <= values[k] < 1.0:
            raise ValueError(f"{type(opt).__name__}: {k} must be in [0, 1), got {values[k]}")
    if "tau" in values and values["tau"] <= 0:
        raise ValueError(f"{type(opt).__name__}: tau must be positive, got {values['tau']}")


def state_name(opt: ServerOptimizer, slot: str, weight: str) -> str:
    return f"{SERVER_STATE_PREFIX}{type(opt).__name__.lower()}/{slot}/{weight}"


class _G:
    """Nodes and constants of one small server graph."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def tmp(self, hint: str) -> str:
        self._n += 1
        return f"_{hint}_{self._n}"

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, **attrs) -> str:
        out = out or self.tmp(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=self.tmp(op_type), **attrs))
        return out

    def const(self, value, dtype=np.float32) -> str:
        name = self.tmp("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def model(self, name: str, inputs, outputs, opset: int) -> bytes:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name="fedfleet.toolchain",
            ir_version=ir_version_for_opset(opset),
        )
        onnx.checker.check_model(model)
        return model.SerializeToString()


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def server_part(
    weights: Mapping[str, tuple[int, ...]],
    *,
    kind: str,
    metrics: Sequence[str],
    opset: int,
    trainable: Sequence[str] = (),
    reset: Sequence[str] = (),
    optimizer: ServerOptimizer = FedAvg(),
    secure_sum: bool = False,
    bitwidth: int = 24,
    clip_range: float = 1024.0,
) -> ServerPart:
    """The MapReduceForm graphs (see :mod:`device_runtime.plan` for the names) of a ``train`` or
    ``eval`` plan over ``weights`` (name -> shape) and the per-batch sums ``metrics``.

    ``trainable`` weights move by ``optimizer``; the others move by the plain mean delta, except
    ``reset`` ones, which go back to zero every round. An ``eval`` plan's update keeps the weights."""
    check_server_optimizer(optimizer)
    train = kind == "train"
    update_spec: dict[str, tuple[int, ...]] = dict(weights) if train else {}
    update_spec.update({m: () for m in metrics})
    update_spec[NUM_EXAMPLES] = ()
    prefix = "train" if train else "eval"
    agg_metrics: dict[str, str] = {}  # aggregate name -> how it is computed
    if "loss_sum" in metrics:
        agg_metrics[f"{prefix}_loss"] = "loss_sum"
    if "correct" in metrics:
        agg_metrics[f"{prefix}_accuracy"] = "correct"
    for m in metrics:
        if m not in ("loss_sum", "correct", "count"):
            agg_metrics[m] = m  # other sums (counts, histogram bins) are reported as totals
    agg_metrics[NUM_EXAMPLES] = NUM_EXAMPLES

    zero, accumulate, merge = summing_graphs(update_spec, opset)

    # report: the mean delta per weight; loss and accuracy per example; other sums as they are
    g = _G()
    one = g.const(1.0, np.float64)
    n = g.op("Max", [f"acc/{NUM_EXAMPLES}", one])
    count = g.op("Max", ["acc/count", one]) if "count" in metrics else n
    report_out = []
    for name, shape in weights.items() if train else ():
        g.op("Div", [f"acc/{name}", n], name)
        report_out.append(_vi(name, _F64, shape))
    for agg, source in agg_metrics.items():
        if source in ("loss_sum", "correct"):
            g.op("Div", [f"acc/{source}", count], agg)
        else:
            g.op("Identity", [f"acc/{source}"], agg)
        report_out.append(_vi(agg, _F64, ()))
    report = g.model("report", [_vi(f"acc/{k}", _F64, s) for k, s in update_spec.items()], report_out, opset)

    g = _G()
    ins = [_vi(f"state/{w}", _F32, s) for w, s in weights.items()]
    ins += [_vi(f"agg/{w}", _F64, s) for w, s in (weights.items() if train else ())]
    ins += [_vi(f"agg/{a}", _F64, ()) for a in agg_metrics]
    outs = []
    movable = set(trainable)
    for w, s in weights.items():
        outs.append(_vi(w, _F32, s))
        if not train:
            g.op("Identity", [f"state/{w}"], w)
        elif w in reset:
            g.op("Mul", [f"state/{w}", g.const(0.0)], w)
        elif w in movable:
            ins_s, outs_s = _server_step(g, optimizer, w, s)
            ins += ins_s
            outs += outs_s
        else:
            g.op("Add", [f"state/{w}", g.op("Cast", [f"agg/{w}"], to=_F32)], w)
    for a in agg_metrics:
        g.op("Identity", [f"agg/{a}"], a)
        outs.append(_vi(a, _F64, ()))
    update = g.model("update", ins, outs, opset)

    g = _G()
    for w in weights:
        g.op("Identity", [f"state/{w}"], w)
    prepare = g.model(
        "prepare",
        [_vi(f"state/{w}", _F32, s) for w, s in weights.items()],
        [_vi(w, _F32, s) for w, s in weights.items()],
        opset,
    )
    part = ServerPart(prepare=prepare, zero=zero, accumulate=accumulate, merge=merge, report=report, update=update)
    if secure_sum:
        part = ServerPart(
            prepare=prepare,
            zero=zero,
            accumulate=accumulate,
            merge=merge,
            report=report,
            update=update,
            bitwidth=int(bitwidth),
            clip_range=float(clip_range),
            secure_sum=tuple(update_spec),
        )
    return part


def _server_step(g: _G, opt: ServerOptimizer, w: str, shape) -> tuple[list, list]:
    """Emit ``w``'s new value (named ``w``) and its new optimizer state; return their value infos."""
    d = g.op("Cast", [f"agg/{w}"], to=_F32)
    state = f"state/{w}"
    lr = g.const(opt.lr)
    if isinstance(opt, FedAvg):
        g.op("Add", [state, d if opt.lr == 1.0 else g.op("Mul", [d, lr])], w)
        return [], []
    if isinstance(opt, FedAvgM):
        m_name = state_name(opt, "m", w)
        m = g.op("Add", [g.op("Mul", [f"state/{m_name}", g.const(opt.momentum)]), d], m_name)
        g.op("Add", [state, g.op("Mul", [m, lr])], w)
        return [_vi(f"state/{m_name}", _F32, shape)], [_vi(m_name, _F32, shape)]
    m_name, v_name = state_name(opt, "m", w), state_name(opt, "v", w)
    b1, b2 = opt.beta1, opt.beta2
    m = g.op("Add", [g.op("Mul", [f"state/{m_name}", g.const(b1)]), g.op("Mul", [d, g.const(1 - b1)])], m_name)
    d2 = g.op("Mul", [d, d])
    v_old = f"state/{v_name}"
    if isinstance(opt, FedYogi):
        sign = g.op("Sign", [g.op("Sub", [v_old, d2])])
        v = g.op("Sub", [v_old, g.op("Mul", [g.op("Mul", [d2, sign]), g.const(1 - b2)])], v_name)
    else:
        v = g.op("Add", [g.op("Mul", [v_old, g.const(b2)]), g.op("Mul", [d2, g.const(1 - b2)])], v_name)
    step = g.op("Div", [m, g.op("Add", [g.op("Sqrt", [v]), g.const(opt.tau)])])
    g.op("Add", [state, g.op("Mul", [step, lr])], w)
    return (
        [_vi(f"state/{m_name}", _F32, shape), _vi(v_old, _F32, shape)],
        [_vi(m_name, _F32, shape), _vi(v_name, _F32, shape)],
    )
