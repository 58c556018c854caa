"""Client optimizers of a training plan: SGD, SGD with momentum, Adam.

An optimizer's state (momentum buffers, Adam's moments and step count) must persist from one step
to the next, and the executor carries exactly one thing from step to step: the plan's weights.
So the state tensors are weights of the plan (``<weight>.momentum``, ``<weight>.adam_m``,
``<weight>.adam_v``, ``adam_step``), held in the checkpoint. Between rounds the server either
averages them like any weight (``carry_state=True``: a device starts from the fleet's mean state)
or resets them to zero (``carry_state=False``: each round starts fresh, as in FedAvg with a local
optimizer); they are never moved by a server optimizer.

SGD folds its learning rate into the backward pass's seed (the gradient is linear in it), so its
update is one subtraction, which a final ``Gemm`` absorbs: the same step as a hand-written one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from .autodiff import Emitter


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def _fraction(name: str, value: float) -> float:
    value = float(value)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


@dataclass(frozen=True)
class Slot:
    """One state tensor: its name, the weight it shadows (None: a scalar shared by all)."""

    name: str
    weight: str | None


@dataclass(frozen=True)
class SGD:
    lr: float
    carry_state: bool = True  # no state; kept for a uniform interface

    def __post_init__(self) -> None:
        _positive("lr", self.lr)

    folds_lr = True

    def slots(self, e: Emitter, weights: list[str]) -> list[Slot]:
        return []

    def step(
        self, e: Emitter, weight: str, grad: str, slots: dict[str, str], shared: dict[str, str], out: str
    ) -> dict[str, str]:
        producer = _sole_gemm(e, grad)
        if producer is not None:  # w - alpha*A@B as one Gemm: C=w, beta=1, alpha negated
            producer.input.append(weight)
            for a in producer.attribute:
                if a.name == "alpha":
                    a.f = -a.f
                    break
            else:
                producer.attribute.append(onnx.helper.make_attribute("alpha", -1.0))
            producer.attribute.append(onnx.helper.make_attribute("beta", 1.0))
            producer.output[0] = out
            return {}
        e.op("Sub", [weight, grad], out=out)
        return {}


@dataclass(frozen=True)
class Momentum:
    lr: float
    beta: float = 0.9
    nesterov: bool = False
    carry_state: bool = True

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _fraction("beta", self.beta)

    folds_lr = False

    def slots(self, e: Emitter, weights: list[str]) -> list[Slot]:
        return [Slot(e.reserve(f"{w}.momentum"), w) for w in weights]

    def step(
        self, e: Emitter, weight: str, grad: str, slots: dict[str, str], shared: dict[str, str], out: str
    ) -> dict[str, str]:
        ((slot, value),) = slots.items()
        v = e.op("Add", [e.op("Mul", [value, e.scalar(self.beta, weight)]), grad], hint="momentum_next")
        direction = e.op("Add", [grad, e.op("Mul", [v, e.scalar(self.beta, weight)])]) if self.nesterov else v
        e.op("Sub", [weight, e.op("Mul", [direction, e.scalar(self.lr, weight)])], out=out)
        return {slot: v}


@dataclass(frozen=True)
class Adam:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    carry_state: bool = True

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _fraction("beta1", self.beta1)
        _fraction("beta2", self.beta2)
        _positive("eps", self.eps)

    folds_lr = False

    def slots(self, e: Emitter, weights: list[str]) -> list[Slot]:
        slots = [Slot(e.reserve("adam_step"), None)]
        for w in weights:
            slots += [Slot(e.reserve(f"{w}.adam_m"), w), Slot(e.reserve(f"{w}.adam_v"), w)]
        return slots

    def shared_step(self, e: Emitter, shared: dict[str, str]) -> dict[str, str]:
        """The step counter and the bias corrections every weight's update uses."""
        ((slot, t),) = shared.items()
        t_next = e.op("Add", [t, e.scalar(1.0, t)], hint="adam_step_next")
        c1 = e.op("Sub", [e.scalar(1.0, t), e.op("Pow", [e.scalar(self.beta1, t), t_next])])
        c2 = e.op("Sub", [e.scalar(1.0, t), e.op("Pow", [e.scalar(self.beta2, t), t_next])])
        # lr * sqrt(1 - b2^t) / (1 - b1^t): the two corrections folded into one step size
        size = e.op("Div", [e.op("Mul", [e.op("Sqrt", [c2]), e.scalar(self.lr, t)]), c1], hint="adam_lr")
        return {slot: t_next, "_size": size, "_c2": c2}

    def step(
        self, e: Emitter, weight: str, grad: str, slots: dict[str, str], shared: dict[str, str], out: str
    ) -> dict[str, str]:
        (m_slot, m), (v_slot, v) = slots.items()
        b1, b2 = self.beta1, self.beta2
        m_next = e.op("Add", [e.op("Mul", [m, e.scalar(b1, weight)]), e.op("Mul", [grad, e.scalar(1 - b1, weight)])])
        v_next = e.op(
            "Add",
            [
                e.op("Mul", [v, e.scalar(b2, weight)]),
                e.op("Mul", [e.op("Mul", [grad, grad]), e.scalar(1 - b2, weight)]),
            ],
        )
        # eps is added to sqrt(v_hat) = sqrt(v)/sqrt(c2): scaled here to keep one division
        denom = e.op(
            "Add", [e.op("Sqrt", [v_next]), e.op("Mul", [e.op("Sqrt", [shared["_c2"]]), e.scalar(self.eps, weight)])]
        )
        e.op("Sub", [weight, e.op("Mul", [e.op("Div", [m_next, denom]), shared["_size"]])], out=out)
        return {m_slot: m_next, v_slot: v_next}


Optimizer = SGD | Momentum | Adam


def _sole_gemm(e: Emitter, grad: str):
    """The emitted Gemm node without a C input that alone produces ``grad`` and whose result no
    other node reads, or None."""
    producer = None
    for node in e.nodes:
        if grad in node.output:
            producer = node
        elif grad in node.input:
            return None
    if producer is None or producer.op_type != "Gemm" or len(producer.input) != 2:
        return None
    return producer


def zero_state(slots: list[Slot], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {s.name: np.zeros(shapes[s.weight] if s.weight is not None else (), dtype=np.float32) for s in slots}
