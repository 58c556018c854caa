"""PaddlePaddle models exported by paddle2onnx, and Paddle's own training step for each: the fixtures
of ``tests/emulator/toolchain/test_paddle_exports.py``, which never imports paddle.

    PYTHONPATH=. /work/paddleenv/bin/python -m benchmarks.paddle_fixtures [--out DIR]

in a virtualenv of its own, outside the repository::

    python3 -m venv /work/paddleenv
    /work/paddleenv/bin/pip install paddlepaddle paddle2onnx packaging onnx onnxruntime

For each model of :data:`MODELS` (random weights, every parameter perturbed so that no two tensors
are equal, nothing downloaded) it writes ``paddle_<name>.onnx.gz``: the model in eval mode exported
as a Paddle user exports it, ``paddle.onnx.export(model, path, input_spec=[InputSpec([None, ...])],
opset_version=17)``. Beside it, ``paddle_<name>.npz``: the batch (``input``, ``label``), Paddle's
loss (``F.cross_entropy``, the batch's mean) and every float initializer of rank >= 1 after one SGD
step of learning rate :data:`LR` of Paddle's autograd in float64 in train mode (``after``, in the
order and shapes of ``index``, under the initializers' names; paddle2onnx names them as Paddle names
its parameters; a bias it reshaped for a ``Conv``, ``p2o.pd_op.reshape.*``, and an RNN's weights whose
gates it reordered and whose two biases it joined, ``helper.concat.*``, are found by their values),
with Paddle float32's own error per initializer (``float32_error``).
"""

from __future__ import annotations

import gzip
import itertools
import json
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import paddle
import paddle2onnx
from onnx import numpy_helper

from benchmarks.fixture_cli import make_fixtures

F = paddle.nn.functional
OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "paddle"
LR = 0.5
BATCH = 4
OPSET = 17


class MLP(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 8), paddle.nn.Linear(8, 3)

    def forward(self, x: Any) -> Any:
        return self.fc3(F.tanh(self.fc2(F.relu(self.fc1(x)))))


class CNN(paddle.nn.Layer):
    """Conv2D, BatchNorm2D (train mode: batch statistics, running ones moved), max and average
    pooling, LayerNorm over the flattened features."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 4, 3, padding=1)
        self.bn = paddle.nn.BatchNorm2D(4)
        self.conv2 = paddle.nn.Conv2D(4, 6, 3, stride=2, padding=1)
        self.norm = paddle.nn.LayerNorm(24)
        self.fc = paddle.nn.Linear(24, 3)

    def forward(self, x: Any) -> Any:
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        h = F.avg_pool2d(F.relu(self.conv2(h)), 1)
        return self.fc(self.norm(paddle.flatten(h, 1)))


class Text(paddle.nn.Layer):
    """Embedding, then a mean over the sequence, GELU and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = paddle.nn.Embedding(20, 6)
        self.fc1, self.fc2 = paddle.nn.Linear(6, 8), paddle.nn.Linear(8, 3)

    def forward(self, tokens: Any) -> Any:
        return self.fc2(F.gelu(self.fc1(self.emb(tokens).mean(axis=1))))


class Recurrent(paddle.nn.Layer):
    """Embedding, a one-layer LSTM or GRU (paddle2onnx writes the ONNX op), its last step, Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.emb, self.rnn, self.fc = paddle.nn.Embedding(20, 6), getattr(paddle.nn, kind)(6, 5), paddle.nn.Linear(5, 3)

    def forward(self, tokens: Any) -> Any:
        out, _ = self.rnn(self.emb(tokens))
        return self.fc(out[:, -1])


class Transformer(paddle.nn.Layer):
    """Embedding, one TransformerEncoderLayer (two heads, LayerNorm, ReLU), mean over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = paddle.nn.Embedding(20, 8)
        self.enc = paddle.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.fc = paddle.nn.Linear(8, 3)

    def forward(self, tokens: Any) -> Any:
        return self.fc(self.enc(self.emb(tokens)).mean(axis=1))


#: name -> (model, one example's shape, dtype of the input)
MODELS: dict[str, tuple[Callable[[], paddle.nn.Layer], list[int], str]] = {
    "mlp": (MLP, [6], "float32"),
    "cnn": (CNN, [3, 8, 8], "float32"),
    "text": (Text, [5], "int64"),
    "lstm": (lambda: Recurrent("LSTM"), [7], "int64"),
    "gru": (lambda: Recurrent("GRU"), [7], "int64"),
    "transformer": (Transformer, [7], "int64"),
}


def _perturbed(net: paddle.nn.Layer, seed: int) -> dict[str, np.ndarray]:
    """Every parameter and buffer moved off its initial value (ones, zeros): distinct tensors."""
    rng = np.random.default_rng(seed)
    values = {}
    for name, t in net.state_dict().items():
        v = t.numpy().astype(np.float32)
        v = v + rng.normal(scale=0.1, size=v.shape).astype(np.float32)
        if name.endswith("_variance"):
            v = np.abs(v) + 0.5
        values[name] = v
    return values


def _step(
    make: Callable[[], paddle.nn.Layer], state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, dtype: str
) -> tuple[float, dict[str, np.ndarray]]:
    """One SGD step in train mode in ``dtype``: the loss and every parameter and buffer after it, by
    its key in the state dict."""
    paddle.set_default_dtype(dtype)
    net = make()
    net.set_state_dict({k: paddle.to_tensor(v.astype(dtype)) for k, v in state.items()})
    net.train()
    inputs = paddle.to_tensor(x if x.dtype.kind == "i" else x.astype(dtype))
    loss = F.cross_entropy(net(inputs), paddle.to_tensor(y))
    loss.backward()
    with paddle.no_grad():
        for p in net.parameters():
            if not p.stop_gradient:  # a BatchNorm's running statistics are parameters that take none
                p.set_value(p - LR * p.grad)
    after = {key: t.numpy().astype(np.float64) for key, t in net.state_dict().items()}
    paddle.set_default_dtype("float32")
    return float(loss), after


Layout = Callable[[dict[str, np.ndarray]], np.ndarray]


def _laid_out(flat: np.ndarray, state: dict[str, np.ndarray]) -> Layout | None:
    """How to lay the module's state out as the initializer ``flat`` (its values, flattened): one
    tensor reshaped, or with its rows' blocks reordered (an RNN's gates, 3 or 4 blocks), or two such
    tensors joined (an RNN's input and recurrent biases); None when no layout matches."""
    for key, value in state.items():
        if value.size != flat.size:
            continue
        for blocks in (1, 3, 4):
            if value.shape[0] % blocks:
                continue
            for order in itertools.permutations(range(blocks)):
                if np.array_equal(value.reshape(blocks, -1)[list(order)].ravel(), flat):
                    return lambda values, key=key, blocks=blocks, order=order: (
                        values[key].reshape(blocks, -1)[list(order)].ravel()
                    )
    if flat.size % 2 == 0 and flat.size > 2:
        first, second = _laid_out(flat[: flat.size // 2], state), _laid_out(flat[flat.size // 2 :], state)
        if first is not None and second is not None:
            return lambda values: np.concatenate([first(values), second(values)])
    return None


def make(out: Path) -> dict[str, Any]:
    paddle.seed(0)
    rng = np.random.default_rng(0)
    fixtures = []
    for k, (name, (build, shape, dtype)) in enumerate(MODELS.items()):
        net = build()
        state = _perturbed(net, k)
        net.set_state_dict({n: paddle.to_tensor(v) for n, v in state.items()})
        net.eval()
        with tempfile.TemporaryDirectory() as tmp:
            spec = [paddle.static.InputSpec(shape=[None, *shape], dtype=dtype, name="x")]
            paddle.onnx.export(net, f"{tmp}/model", input_spec=spec, opset_version=OPSET)
            model = onnx.load(f"{tmp}/model.onnx")
        (out / f"paddle_{name}.onnx.gz").write_bytes(gzip.compress(model.SerializeToString(), mtime=0))
        x = rng.integers(0, 20, size=(BATCH, *shape)) if dtype == "int64" else rng.normal(size=(BATCH, *shape))
        x = x.astype(dtype)
        y = rng.integers(0, 3, size=BATCH).astype(np.int64)
        loss, after = _step(build, state, x, y, "float64")
        _, after32 = _step(build, state, x, y, "float32")
        key_of = {t.name: key for key, t in net.state_dict().items()}  # linear_0.w_0 -> fc1.weight
        named = {key: lambda values, key=key: values[key] for key in state}
        index, values, errors = [], [], []
        for init in model.graph.initializer:
            v = numpy_helper.to_array(init)
            if v.dtype != np.float32 or v.ndim == 0:
                continue
            key = key_of.get(init.name)
            # else a parameter paddle2onnx laid out anew (a Conv's bias reshaped, an RNN's gates reordered
            # and its two biases joined): found by its values
            lay = named[key] if key is not None else _laid_out(v.ravel(), state)
            if lay is None:
                continue
            index.append([init.name, list(v.shape)])
            values.append(lay(after).reshape(v.shape))
            errors.append(float(np.abs(lay(after32).reshape(v.shape) - values[-1]).max()))
        np.savez_compressed(
            out / f"paddle_{name}.npz",
            input=x,
            label=y,
            loss=np.float64(loss),
            after=np.concatenate([v.ravel() for v in values]),
            float32_error=np.array(errors),
            index=json.dumps({"input": model.graph.input[0].name, "initializers": index}),
        )
        ops = sorted({n.op_type for n in model.graph.node})
        fixtures.append(
            {"name": name, "model": f"paddle_{name}.onnx.gz", "reference": f"paddle_{name}.npz", "ops": ops}
        )
    return {
        "regenerate": "PYTHONPATH=. python -m benchmarks.paddle_fixtures  (in a virtualenv with paddlepaddle and paddle2onnx)",
        "versions": {
            "paddlepaddle": paddle.__version__,
            "paddle2onnx": paddle2onnx.__version__,
            "onnx": onnx.__version__,
            "python": platform.python_version(),
        },
        "export": f"paddle.onnx.export(model, path, input_spec=[InputSpec([None, ...])], opset_version={OPSET})",
        "step": "Paddle autograd, F.cross_entropy, train mode, float64",
        "batch": BATCH,
        "lr": LR,
        "fixtures": fixtures,
    }


def main() -> None:
    manifest, out = make_fixtures(__doc__ or "", OUT, make)
    print(f"{len(manifest['fixtures'])} fixtures in {out}")


if __name__ == "__main__":
    main()
