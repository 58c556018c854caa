"""Flax NNX models exported by jax2onnx, and JAX's own training step for each: the fixtures of
``tests/emulator/toolchain/test_jax_exports.py``, which never imports jax.

    PYTHONPATH=. /work/jaxenv/bin/python -m benchmarks.jax_fixtures [--out DIR]

in a virtualenv of its own, outside the repository::

    python3 -m venv /work/jaxenv
    /work/jaxenv/bin/pip install jax jax2onnx flax onnx onnxruntime

For each model of :data:`MODELS` (random weights, every parameter and statistic perturbed so that
no two tensors are equal, nothing downloaded) it writes ``jax_<name>.onnx.gz``: the module in eval
mode exported as a JAX user exports it, ``jax2onnx.to_onnx(module, [("B", ...)])`` at jax2onnx's
default opset. Beside it, ``jax_<name>.npz``: the batch (``input``, ``label``), JAX's loss
(``optax``-style softmax cross-entropy with integer labels, the batch's mean) and every float
initializer of rank >= 1 that holds a parameter or a BatchNorm statistic, after one SGD step of
``nnx.grad`` with learning rate :data:`LR` in float64 in train mode (``after``, in the order and
shapes of ``index``, under the initializers' names), with JAX float32's own error on each
(``float32_error``). jax2onnx names its initializers ``const_<k>`` and lays some out anew (a
convolution's kernel from HWIO to OIHW): each is matched to the module's state by its values, up
to a transpose.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import itertools
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import flax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax2onnx  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from flax import nnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from benchmarks.fixture_cli import make_fixtures  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "jax"
LR = 0.5
BATCH = 4


class MLP(nnx.Module):
    """Linear, LayerNorm, GELU, Linear."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1, self.ln, self.l2 = (
            nnx.Linear(6, 8, rngs=rngs),
            nnx.LayerNorm(8, rngs=rngs),
            nnx.Linear(8, 3, rngs=rngs),
        )

    def __call__(self, x: Any) -> Any:
        return self.l2(nnx.gelu(self.ln(self.l1(x))))


class CNN(nnx.Module):
    """NHWC Conv (jax2onnx transposes around it), BatchNorm (train mode: batch statistics, running
    ones moved with flax's momentum 0.99), ReLU, max pooling, Linear."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.fc = nnx.Linear(4 * 4 * 4, 3, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        h = nnx.max_pool(nnx.relu(self.bn(self.conv(x))), window_shape=(2, 2), strides=(2, 2))
        return self.fc(h.reshape(h.shape[0], -1))


#: name -> (module, one example's shape)
MODELS: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (6,)),
    "cnn": (CNN, (8, 8, 3)),
}


def _key(path: Any) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _leaves(module: nnx.Module) -> dict[str, np.ndarray]:
    """Every array of the module's state (parameters and BatchNorm statistics), by its path."""
    return {
        _key(path): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(module)))
    }


def _perturb(module: nnx.Module, seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = nnx.state(module)
    pure = nnx.to_pure_dict(state)

    def moved(path: Any, v: Any) -> Any:
        a = np.asarray(v, np.float32)
        a = a + rng.normal(scale=0.1, size=a.shape).astype(np.float32)
        if "var" in str(path[-1]):
            a = np.abs(a) + 0.5
        return jnp.asarray(a)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(moved, pure))
    nnx.update(module, state)


def _step(
    build: Callable[[nnx.Rngs], nnx.Module], start: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, dtype: Any
) -> tuple[float, dict[str, np.ndarray]]:
    """One SGD step in train mode in ``dtype`` from the state ``start``: the loss and every state array after it."""
    module = build(nnx.Rngs(0))
    state = nnx.state(module)
    pure = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(
        state, jax.tree_util.tree_map_with_path(lambda p, v: jnp.asarray(start[_key(p)], dtype), pure)
    )
    nnx.update(module, state)
    module.train()

    def loss_of(m: nnx.Module) -> Any:
        logits = m(jnp.asarray(x, dtype))
        log_p = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_p, jnp.asarray(y)[:, None], axis=-1).mean()

    loss, grads = nnx.value_and_grad(loss_of)(module)
    params = nnx.state(module, nnx.Param)
    nnx.update(module, jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads))
    return float(loss), {k: np.asarray(v, np.float64) for k, v in _leaves(module).items()}


def _layouts(value: np.ndarray, target: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The axis orders that lay ``value`` out in ``target``'s shape (a reshape when sizes alone agree)."""
    return [p for p in itertools.permutations(range(value.ndim)) if tuple(value.shape[i] for i in p) == target]


def _match(init: np.ndarray, state: dict[str, np.ndarray]) -> tuple[str, tuple[int, ...] | None] | None:
    for key, v in state.items():
        if v.size != init.size:
            continue
        for order in _layouts(v, init.shape):
            if np.array_equal(np.transpose(v, order).astype(np.float32), init):
                return key, order
        if np.array_equal(v.astype(np.float32).reshape(init.shape), init):
            return key, None
    return None


def _laid_out(value: np.ndarray, order: tuple[int, ...] | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.transpose(value, order) if order is not None else value.reshape(shape)


def make(out: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    fixtures = []
    for k, (name, (build, shape)) in enumerate(MODELS.items()):
        module = build(nnx.Rngs(k))
        _perturb(module, k)
        module.eval()
        model = jax2onnx.to_onnx(module, [("B", *shape)])
        (out / f"jax_{name}.onnx.gz").write_bytes(gzip.compress(model.SerializeToString(), mtime=0))
        start = _leaves(module)
        x = rng.normal(size=(BATCH, *shape)).astype(np.float32)
        y = rng.integers(0, 3, size=BATCH).astype(np.int64)
        loss, after = _step(build, start, x, y, jnp.float64)
        _, after32 = _step(build, start, x, y, jnp.float32)
        index, values, errors = [], [], []
        for init in model.graph.initializer:
            v = numpy_helper.to_array(init)
            if v.dtype != np.float32 or v.ndim == 0 or (found := _match(v, start)) is None:
                continue
            key, order = found
            index.append([init.name, list(v.shape)])
            values.append(_laid_out(after[key], order, v.shape))
            errors.append(float(np.abs(_laid_out(after32[key], order, v.shape) - values[-1]).max()))
        np.savez_compressed(
            out / f"jax_{name}.npz",
            input=x,
            label=y,
            loss=np.float64(loss),
            after=np.concatenate([v.ravel() for v in values]),
            float32_error=np.array(errors),
            index=json.dumps({"input": model.graph.input[0].name, "initializers": index}),
        )
        ops = sorted({n.op_type for n in model.graph.node})
        fixtures.append({"name": name, "model": f"jax_{name}.onnx.gz", "reference": f"jax_{name}.npz", "ops": ops})
    return {
        "regenerate": "PYTHONPATH=. python -m benchmarks.jax_fixtures  (in a virtualenv with jax, flax and jax2onnx)",
        "versions": {
            "jax": jax.__version__,
            "flax": flax.__version__,
            "jax2onnx": importlib.metadata.version("jax2onnx"),
            "onnx": onnx.__version__,
            "python": platform.python_version(),
        },
        "export": 'jax2onnx.to_onnx(module, [("B", ...)])',
        "step": "nnx.value_and_grad, softmax cross-entropy, train mode, float64",
        "batch": BATCH,
        "lr": LR,
        "fixtures": fixtures,
    }


def main() -> None:
    manifest, out = make_fixtures(__doc__ or "", OUT, make)
    print(f"{len(manifest['fixtures'])} fixtures in {out}")


if __name__ == "__main__":
    main()
