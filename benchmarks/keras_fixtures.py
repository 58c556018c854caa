"""Keras models exported by tf2onnx, and TensorFlow's own training step for each: the fixtures of
``tests/emulator/toolchain/test_keras_exports.py``, which never imports tensorflow.

    PYTHONPATH=. /work/tfenv/bin/python -m benchmarks.keras_fixtures [--only NAME ...] [--out DIR] [--keras3]

TensorFlow and tf2onnx do not install beside the project's own dependencies (tf2onnx pins an old
protobuf), so this runs in a virtualenv of its own, outside the repository::

    python3 -m venv /work/tfenv
    /work/tfenv/bin/pip install tensorflow-cpu==2.15.1 tf2onnx==1.16.1 protobuf==3.20.3 "numpy<2" \\
        onnx==1.16.2 onnxruntime==1.18.1

For each model of :data:`MODELS` (random weights, nothing downloaded) it writes
``keras_<name>.onnx.gz``: the model exported as a Keras user exports it,
``tf2onnx.convert.from_keras(model, input_signature=..., opset=OPSET)`` with the batch axis
dynamic (tf2onnx traces the model for inference: ``Dropout`` is gone and ``BatchNormalization``
reads its moving statistics; a plan trains the latter with batch statistics again). Beside it,
``keras_<name>.npz``: the batch, the loss TensorFlow computed (sparse categorical cross-entropy,
the mean over every label) and every ONNX initializer after one SGD step of
``tf.GradientTape`` with learning rate :data:`LR` in float64 (``training=True``, dropout rates 0),
found by exporting the stepped model the same way: tf2onnx lays out Keras weights as ONNX wants
them (a convolution's kernel transposed, a recurrent layer's gates reordered and stacked), so the
exported initializers are TensorFlow's step in the plan's own coordinates. TensorFlow's float32
step's error per initializer is saved too, as the noise to expect.

``--only NAME ...`` makes those again and updates their entries of the manifest. ``--keras3``
(TensorFlow 2.16 or later, without ``TF_USE_LEGACY_KERAS``) exports with Keras 3's own
``model.export(path, format="onnx")`` instead, as ``keras3_<name>`` (:data:`KEPT_KERAS3`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
import tf2onnx.optimizer  # noqa: E402  (tf2onnx 1.17 loads its submodules lazily)
from onnx import numpy_helper  # noqa: E402

keras = tf.keras
layers = keras.layers

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "keras"
LR = 0.5
BATCH = 4
OPSET = 17
#: Export with Keras 3's ``model.export(format="onnx")`` (``--keras3``: TensorFlow 2.16 or later
#: without ``TF_USE_LEGACY_KERAS``) instead of tf2onnx's ``from_keras``.
KERAS3 = False
#: tf2onnx writes no momentum on BatchNormalization (Keras's is 0.99): a plan moves the running
#: statistics by ONNX's default, and so does the reference step.
ONNX_MOMENTUM = 0.9


def mlp(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12,), name="x"),
            layers.Dense(16, activation="relu"),
            layers.Dropout(dropout),
            layers.Dense(8, activation="tanh"),
            layers.Dense(5),
        ],
        name="mlp",
    )


def mlp_softmax(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12,), name="x"),
            layers.Dense(16, activation="relu"),
            layers.BatchNormalization(),
            layers.Dropout(dropout),
            layers.Dense(5, activation="softmax"),
        ],
        name="mlp_softmax",
    )


def mlp_batch_norm(dropout: float) -> keras.Model:
    """A BatchNormalization over Dense features given a [N, 1, 1, features] input: Keras runs it
    fused, and tf2onnx keeps it (over [N, features] it is folded into constants)."""
    return keras.Sequential(
        [
            keras.Input((12,), name="x"),
            layers.Dense(16, activation="relu"),
            layers.Reshape((1, 1, 16)),
            layers.BatchNormalization(),
            layers.Flatten(),
            layers.Dropout(dropout),
            layers.Dense(5, activation="softmax"),
        ],
        name="mlp_batch_norm",
    )


def mlp_layer_norm(dropout: float) -> keras.Model:
    """LayerNormalization over [N, features]: tf.keras computes it with a fused batch norm over the
    features reshaped, which tf2onnx writes as a ``BatchNormalization`` of the moments it computes."""
    return keras.Sequential(
        [
            keras.Input((12,), name="x"),
            layers.Dense(8),
            layers.LayerNormalization(),
            layers.Dense(3),
        ],
        name="mlp_layer_norm",
    )


def mlp_preprocessed(dropout: float) -> keras.Model:
    """Normalization and Rescaling before the Dense layers (their constants: not trained)."""
    return keras.Sequential(
        [
            keras.Input((12,), name="x"),
            layers.Normalization(mean=np.linspace(-1, 1, 12), variance=np.linspace(0.5, 2, 12)),
            layers.Rescaling(0.5, offset=0.1),
            layers.Dense(8, activation="relu"),
            layers.Dense(3),
        ],
        name="mlp_preprocessed",
    )


def cnn(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12, 12, 3), name="x"),
            layers.Conv2D(4, 3, padding="same"),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.MaxPooling2D(2),
            layers.Conv2D(6, 3, strides=2, padding="valid", activation="relu"),
            layers.Conv2D(6, 3, strides=2, padding="same", use_bias=False),
            layers.AveragePooling2D(2, padding="same"),
            layers.Dropout(dropout),
            layers.Flatten(),
            layers.Dense(4, activation="softmax"),
        ],
        name="cnn",
    )


def mobile_block(dropout: float) -> keras.Model:
    """MobileNetV2's inverted residual as keras.applications writes it (ZeroPadding2D before a
    strided depthwise convolution, ReLU6, BatchNormalization with momentum 0.999)."""
    x = inputs = keras.Input((10, 10, 3), name="x")
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x)
    x = layers.ReLU(6.0)(x)
    shortcut = x
    x = layers.Conv2D(16, 1, use_bias=False)(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x)
    x = layers.ReLU(6.0)(x)
    x = layers.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x)
    x = layers.ReLU(6.0)(x)
    x = layers.Conv2D(8, 1, use_bias=False)(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x)
    x = layers.Add()([shortcut, x])
    x = layers.ZeroPadding2D(((0, 1), (0, 1)))(x)
    x = layers.DepthwiseConv2D(3, strides=2, padding="valid", use_bias=False)(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(dropout)(x)
    return keras.Model(inputs, layers.Dense(3, activation="softmax")(x), name="mobile_block")


def mobilenet_v2(dropout: float) -> keras.Model:
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5)


def resnet50(dropout: float) -> keras.Model:
    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=5)


def efficientnet_b0(dropout: float) -> keras.Model:
    return keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, classes=5)


def lstm(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((7,), dtype="int32", name="tokens"),
            layers.Embedding(30, 6),
            layers.LSTM(5),
            layers.Dropout(dropout),
            layers.Dense(3),
        ],
        name="lstm",
    )


def bilstm(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,), name="tokens"),  # float ids, as Input's default dtype gives
            layers.Embedding(30, 6),
            layers.Bidirectional(layers.LSTM(4, return_sequences=True)),
            layers.LSTM(4),
            layers.Dense(3, activation="softmax"),
        ],
        name="bilstm",
    )


def gru_next_token(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int64", name="tokens"),
            layers.Embedding(20, 6),
            layers.GRU(7, return_sequences=True),
            layers.Dense(20),
        ],
        name="gru_next_token",
    )


def gru_reset_before(dropout: float) -> keras.Model:
    """Keras's GRU with ``reset_after=False`` (TensorFlow 1's form): one bias, as an LSTM's."""
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32", name="tokens"),
            layers.Embedding(20, 6),
            layers.GRU(5, reset_after=False, go_backwards=True),
            layers.Dense(4),
        ],
        name="gru_reset_before",
    )


def simple_rnn(dropout: float) -> keras.Model:
    """tf2onnx writes a SimpleRNN as a ``Loop`` over the fixed sequence length."""
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32", name="tokens"),
            layers.Embedding(20, 6),
            layers.SimpleRNN(5),
            layers.Dense(4),
        ],
        name="simple_rnn",
    )


def lstm_masked(dropout: float) -> keras.Model:
    """``Embedding(mask_zero=True)`` before an LSTM: tf2onnx writes the masked LSTM as a ``Loop``
    that keeps the state over the padding (the batch pads its first rows' ends with 0)."""
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32", name="tokens"),
            layers.Embedding(20, 6, mask_zero=True),
            layers.LSTM(5),
            layers.Dense(3),
        ],
        name="lstm_masked",
    )


def gru_masking(dropout: float) -> keras.Model:
    """``Masking`` before a GRU over float features (the batch zeroes its first rows' last steps)."""
    return keras.Sequential(
        [
            keras.Input((5, 3), name="x"),
            layers.Masking(0.0),
            layers.GRU(4),
            layers.Dense(3),
        ],
        name="gru_masking",
    )


def simple_rnn_any_length(dropout: float) -> keras.Model:
    """A SimpleRNN over a sequence of run-time length: its ``Loop``'s trip count is not known."""
    return keras.Sequential(
        [
            keras.Input((None,), dtype="int32", name="tokens"),
            layers.Embedding(20, 6),
            layers.SimpleRNN(5),
            layers.Dense(4),
        ],
        name="simple_rnn_any_length",
    )


def gru_backwards(dropout: float) -> keras.Model:
    """``go_backwards=True``: tf2onnx reverses the sequence with ``ReverseSequence``."""
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32", name="tokens"),
            layers.Embedding(20, 6),
            layers.GRU(4, go_backwards=True),
            layers.Dense(3),
        ],
        name="gru_backwards",
    )


def embedding_pool(dropout: float) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8,), dtype="int32", name="tokens"),
            layers.Embedding(40, 8),
            layers.GlobalAveragePooling1D(),
            layers.Dropout(dropout),
            layers.Dense(8, activation="relu"),
            layers.Dense(2, activation="softmax"),
        ],
        name="embedding_pool",
    )


@keras.utils.register_keras_serializable("keras_fixtures")
class PositionEmbedding(layers.Layer):
    """A learned position table added to the token embeddings (as Keras's examples write one)."""

    def build(self, input_shape: Any) -> None:
        self.table = self.add_weight(name="table", shape=tuple(input_shape[1:]), initializer="random_normal")

    def call(self, x: Any) -> Any:
        return x + self.table


@keras.utils.register_keras_serializable("keras_fixtures")
class WidthBranch(layers.Layer):
    """``tf.cond`` on the features' static width (tanh over more than 2 features, else sigmoid):
    tf2onnx writes an ``If`` on a constant condition."""

    def call(self, h: Any) -> Any:
        return tf.cond(tf.shape(h)[1] > 2, lambda: tf.tanh(h), lambda: tf.sigmoid(h))


@keras.utils.register_keras_serializable("keras_fixtures")
class SignBranch(layers.Layer):
    """``tf.cond`` on the data (tanh where the batch's features sum above 0, else sigmoid): an
    ``If`` whose condition is known only at run time."""

    def call(self, h: Any) -> Any:
        return tf.cond(tf.reduce_sum(h) > 0, lambda: tf.tanh(h), lambda: tf.sigmoid(h))


def mlp_cond(dropout: float) -> keras.Model:
    """A Dense layer's output through :class:`WidthBranch`: the plan takes the If's branch."""
    return keras.Sequential(
        [keras.Input((5,), name="x"), layers.Dense(6), WidthBranch(), layers.Dense(3)], name="mlp_cond"
    )


def mlp_cond_on_data(dropout: float) -> keras.Model:
    """:class:`SignBranch` after a Dense layer: the gradient must cross an If on the data."""
    return keras.Sequential(
        [keras.Input((5,), name="x"), layers.Dense(6), SignBranch(), layers.Dense(3)], name="mlp_cond_on_data"
    )


def transformer(dropout: float) -> keras.Model:
    t, d = 6, 8
    tokens = keras.Input((t,), dtype="int32", name="tokens")
    x = PositionEmbedding()(layers.Embedding(30, d)(tokens))
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout)(x, x)
    x = layers.LayerNormalization(epsilon=1e-6)(x + layers.Dropout(dropout)(attended))
    ffn = layers.Dense(d)(layers.Dense(16, activation="gelu")(x))
    x = layers.LayerNormalization(epsilon=1e-6)(x + ffn)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, layers.Dense(3)(x), name="transformer")


#: name -> (builder, classes, label per position)
MODELS: dict[str, tuple[Callable[[float], keras.Model], int, bool]] = {
    "mlp": (mlp, 5, False),
    "mlp_softmax": (mlp_softmax, 5, False),
    "mlp_batch_norm": (mlp_batch_norm, 5, False),
    "mlp_layer_norm": (mlp_layer_norm, 3, False),
    "mlp_preprocessed": (mlp_preprocessed, 3, False),
    "cnn": (cnn, 4, False),
    "mobile_block": (mobile_block, 3, False),
    "lstm": (lstm, 3, False),
    "bilstm": (bilstm, 3, False),
    "gru_next_token": (gru_next_token, 20, True),
    "gru_backwards": (gru_backwards, 3, False),
    "gru_reset_before": (gru_reset_before, 4, False),
    "simple_rnn": (simple_rnn, 4, False),
    "lstm_masked": (lstm_masked, 3, False),
    "gru_masking": (gru_masking, 3, False),
    "embedding_pool": (embedding_pool, 2, False),
    "mlp_cond": (mlp_cond, 3, False),
    "transformer": (transformer, 3, False),
    "mobilenet_v2": (mobilenet_v2, 5, False),
    "resnet50": (resnet50, 5, False),
    "efficientnet_b0": (efficientnet_b0, 5, False),
}
#: The models whose fixtures the repository keeps (the others are tens of MB).
KEPT = (
    "mlp",
    "mlp_batch_norm",
    "mlp_layer_norm",
    "mlp_preprocessed",
    "cnn",
    "mobile_block",
    "lstm",
    "bilstm",
    "gru_next_token",
    "gru_backwards",
    "gru_reset_before",
    "simple_rnn",
    "lstm_masked",
    "gru_masking",
    "embedding_pool",
    "mlp_cond",
    "transformer",
)
#: The models whose Keras 3 export (``--keras3``) the repository keeps: its GRU is a ``Loop``.
KEPT_KERAS3 = ("gru_next_token",)
#: Converted as tf2onnx converts by default, with no reference step: a plan warns of the first two
#: (their BatchNormalization folded into constants) and refuses the others (a SimpleRNN's Loop over
#: a sequence of run-time length, an If on the data).
AS_IS = {
    "cnn": cnn,
    "mlp_softmax": mlp_softmax,
    "simple_rnn_any_length": simple_rnn_any_length,
    "mlp_cond_on_data": mlp_cond_on_data,
}


def _seed(name: str) -> int:
    return sum(map(ord, name))


def perturbed(model: keras.Model, rng: np.random.Generator) -> None:
    """Gaussian noise on every weight (10% of its spread, 0.1 where it has none), so that no two
    tensors are equal and no bias is zero; moving variances stay positive."""
    values = []
    for w in model.weights:
        v = w.numpy()
        spread = float(v.std()) if v.size > 1 else 0.0
        noise = rng.standard_normal(v.shape) * (0.1 * spread if spread > 0 else 0.1)
        v = v * np.exp(noise) if "moving_variance" in w.name else v + noise
        values.append(v.astype(v.dtype))
    model.set_weights(values)


def batch(model: keras.Model, classes: int, per_position: bool, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    spec = model.inputs[0]
    shape = (BATCH, *spec.shape[1:])
    dtype = tf.as_dtype(spec.dtype)  # Keras 3 names it
    if dtype.is_integer or "tokens" in spec.name:
        vocab = next(layer.input_dim for layer in model.layers if isinstance(layer, layers.Embedding))
        x = rng.integers(0, vocab, shape).astype(dtype.as_numpy_dtype)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    if any(getattr(layer, "mask_zero", False) or isinstance(layer, layers.Masking) for layer in model.layers):
        x[:2, -2:] = 0  # padding at the ends of the first two rows (token 0, or a step of zeros)
    label_shape = (BATCH, shape[1]) if per_position else (BATCH,)
    return x, rng.integers(0, classes, label_shape)


def twin(model: keras.Model, builder: Callable[[float], keras.Model], dtype: str) -> keras.Model:
    """The same architecture in ``dtype`` with dropout rates 0, holding ``model``'s weights."""
    keras.backend.set_floatx(dtype)
    try:
        other = builder(0.0)
    finally:
        keras.backend.set_floatx("float32")
    if dtype != "float32":
        config = json.loads(json.dumps(other.get_config()).replace('"float32"', f'"{dtype}"'))
        other = other.__class__.from_config(config)
    other.set_weights([w.astype(dtype) for w in model.get_weights()])
    for layer in other.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.momentum = ONNX_MOMENTUM
        if isinstance(layer, layers.Dropout):  # keras.applications' own (EfficientNet's top and drop connect)
            layer.rate = 0.0
    return other


def sgd_step(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    """One step of SGD(LR) on sparse categorical cross-entropy (Keras's loss: from the logits when
    the model ends in softmax), in training mode, in the model's own float type.

    Keras runs a BatchNormalization over [N, H, W, C] in float32 as TensorFlow's fused kernel, whose
    moving variance takes the unbiased batch variance (n/(n-1), n values per channel), as a plan's
    does; in float64 it runs the layer's own ops, which take the biased one: the float64 step's
    moving variance is set to the fused kernel's."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=not _ends_in_softmax(model))
    norms = [layer for layer in model.layers if isinstance(layer, layers.BatchNormalization)]
    held = [layer.moving_variance.numpy() for layer in norms]
    with tf.GradientTape() as tape:
        out = model(x, training=True)
        loss = loss_fn(y, out)
    grads = tape.gradient(loss, model.trainable_weights)
    for w, g in zip(model.trainable_weights, grads):
        w.assign_sub(LR * tf.convert_to_tensor(g))  # an embedding's gradient comes as IndexedSlices
    for layer, before in zip(norms, held):
        shape = layer.input_shape
        if layer.dtype == "float64" and len(shape) == 4:
            n = len(x) * shape[1] * shape[2]
            m = layer.momentum
            biased = (layer.moving_variance.numpy() - m * before) / (1 - m)
            layer.moving_variance.assign(m * before + (1 - m) * biased * n / (n - 1))
    return float(loss)


def _ends_in_softmax(model: keras.Model) -> bool:
    last = model.layers[-1]
    return getattr(getattr(last, "activation", None), "__name__", "") == "softmax"


def export(model: keras.Model, optimizers: Any = None) -> onnx.ModelProto:
    """``model`` converted as a Keras user converts it, with tf2onnx's ``optimizers`` (default:
    :data:`KEEP_BATCH_NORM`)."""
    spec = model.inputs[0]
    signature = (tf.TensorSpec((None, *spec.shape[1:]), tf.as_dtype(spec.dtype), name=spec.name.split(":")[0]),)
    tf2onnx.utils.INTERNAL_NAME = 1  # the names tf2onnx makes count from here: one model, one set of names
    if KERAS3:  # Keras 3's own export (tf2onnx's from_function inside, its default optimizers)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.onnx")
            model.export(path, format="onnx", verbose=False, input_signature=signature, opset_version=OPSET)
            return onnx.load(path)
    proto, _ = tf2onnx.convert.from_keras(
        model, input_signature=signature, opset=OPSET, optimizers=optimizers or KEEP_BATCH_NORM
    )
    return proto


#: tf2onnx's optimizers less ``remove_back_to_back``, which folds a BatchNormalization into the
#: convolution before it (its inference form: the plan could not train it with batch statistics).
KEEP_BATCH_NORM = {k: v for k, v in tf2onnx.optimizer._optimizers.items() if k != "remove_back_to_back"}


def initializers(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The float initializers of rank >= 1 (what a plan may train; tf2onnx merges the scalar bounds
    of ReLU6 under either name)."""
    return {
        t.name: numpy_helper.to_array(t)
        for t in proto.graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) > 0
    }


def keys(proto: onnx.ModelProto) -> dict[str, str]:
    """Per initializer name, a key that names it alike in any export of the same model: tf2onnx
    numbers the constants and nodes it makes (``const_fold_opt__62``: a depthwise kernel it
    transposed; ``W0__26``: an LSTM's weights; ``Gemm__376``: an attention projection), and
    TensorFlow its embedding lookups (``embedding_lookup/557:0``), from counters whose course
    differs from one conversion to the next: the key is the name less those numbers and, for each
    node that reads it, the first node on from there that TensorFlow named (its layer's scope)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def plain(name: str) -> str:
        return re.sub(r"__[0-9]+|/[0-9]+:", "", name)

    def scope(node: onnx.NodeProto, depth: int = 0) -> str:
        if "/" in node.name or depth > 30:
            return plain(node.name)
        after = [scope(n, depth + 1) for o in node.output for n in readers.get(o, [])]
        return f"{node.op_type}>{min(after, default='')}"

    out = {}
    for t in proto.graph.initializer:
        read = sorted(f"{scope(n)}#{list(n.input).index(t.name)}" for n in readers.get(t.name, []))
        out[t.name] = plain(t.name) + "|" + "|".join(read)
    if len(set(out.values())) != len(out):
        raise SystemExit("two initializers have one key")
    return out


def exported_after(model: keras.Model, weights: list[np.ndarray], proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The initializers of ``model`` exported with ``weights`` (float32), named as in ``proto``."""
    held = model.get_weights()
    model.set_weights([w.astype(np.float32) for w in weights])
    try:
        stepped = export(model)
    finally:
        model.set_weights(held)
    values = initializers(stepped)
    by_key = {key: values[name] for name, key in keys(stepped).items() if name in values}
    names = {key: name for name, key in keys(proto).items()}
    if set(by_key) != {keys(proto)[n] for n in initializers(proto)}:
        raise SystemExit(f"{model.name}: the stepped model's export has other initializers")
    return {names[key]: value for key, value in by_key.items()}


def make(name: str, out: Path) -> dict[str, Any]:
    builder, classes, per_position = MODELS[name]
    keras.backend.clear_session()
    tf.random.set_seed(_seed(name))
    rng = np.random.default_rng(_seed(name))
    model = builder(0.2)
    perturbed(model, rng)
    proto = export(model)
    x, y = batch(model, classes, per_position, rng)

    wide = twin(model, builder, "float64")
    loss = sgd_step(wide, x.astype(np.float64) if x.dtype.kind == "f" else x, y)
    after = exported_after(model, wide.get_weights(), proto)
    narrow = twin(model, builder, "float32")
    sgd_step(narrow, x, y)
    after32 = exported_after(model, narrow.get_weights(), proto)
    names = sorted(after)
    stem = f"keras3_{name}" if KERAS3 else f"keras_{name}"
    (out / f"{stem}.onnx.gz").write_bytes(gzip.compress(proto.SerializeToString(), mtime=0))
    input_name = proto.graph.input[0].name
    np.savez_compressed(
        out / f"{stem}.npz",
        index=json.dumps({"input": input_name, "initializers": [[n, list(after[n].shape)] for n in names]}),
        input=x,
        label=y,
        loss=np.float64(loss),
        after=np.concatenate([after[n].ravel() for n in names]),
        float32_error=np.array([float(np.abs(after32[n] - after[n]).max(initial=0)) for n in names]),
    )
    ops = sorted({n.op_type for n in proto.graph.node})
    entry = {"name": stem.removeprefix("keras_"), "model": f"{stem}.onnx.gz", "reference": f"{stem}.npz", "ops": ops}
    if KERAS3:
        entry["export"] = f"model.export(path, format='onnx', input_signature=<batch axis None>, opset_version={OPSET})"
        entry["versions"] = {"tensorflow": tf.__version__, "keras": keras.__version__, "tf2onnx": tf2onnx.__version__}
    return entry


def main() -> None:
    global OPSET, KERAS3
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted({*MODELS, *AS_IS}))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--opset", type=int, default=17, help="the ONNX opset to convert to (default 17)")
    parser.add_argument(
        "--keras3", action="store_true", help="export with Keras 3's model.export(format='onnx') (TensorFlow >= 2.16)"
    )
    args = parser.parse_args()
    OPSET, KERAS3 = args.opset, args.keras3
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only if n in MODELS] if args.only else list(KEPT_KERAS3 if KERAS3 else KEPT)
    as_is = []
    if not KERAS3:
        for name, builder in AS_IS.items():
            if args.only and name not in args.only:
                continue
            keras.backend.clear_session()
            tf.random.set_seed(_seed(name))
            model = builder(0.2)
            perturbed(model, np.random.default_rng(_seed(name)))
            proto = export(model, tf2onnx.optimizer._get_optimizers())
            (args.out / f"keras_{name}.as_is.onnx.gz").write_bytes(gzip.compress(proto.SerializeToString(), mtime=0))
            as_is.append({"name": name, "model": f"keras_{name}.as_is.onnx.gz"})
    made = []
    for name in names:
        try:
            made.append(make(name, args.out))
        except SystemExit as exc:
            print(f"{name}: not made: {exc}")
    manifest = {
        "regenerate": "PYTHONPATH=. python -m benchmarks.keras_fixtures  (in a virtualenv with tensorflow and tf2onnx)",
        "versions": {
            "tensorflow": tf.__version__,
            "tf2onnx": tf2onnx.__version__,
            "onnx": onnx.__version__,
            "python": platform.python_version(),
        },
        "export": f"tf2onnx.convert.from_keras(model, input_signature=<batch axis None>, opset={OPSET}, "
        "optimizers=<tf2onnx's less remove_back_to_back>)",
        "as_is_export": f"tf2onnx.convert.from_keras(model, input_signature=<batch axis None>, opset={OPSET})",
        "step": "tf.GradientTape, SparseCategoricalCrossentropy, training=True, dropout 0, float64",
        "batch": BATCH,
        "lr": LR,
        "fixtures": made,
        "as_is": as_is,
    }
    written = args.out / "manifest.json"
    if (args.only or KERAS3) and written.exists():  # some fixtures made again, or Keras 3's beside tf.keras's
        manifest = json.loads(written.read_text())
        again = {e["name"] for e in made}
        manifest["fixtures"] = [e for e in manifest["fixtures"] if e["name"] not in again] + made
        again = {e["name"] for e in as_is}
        manifest["as_is"] = [e for e in manifest["as_is"] if e["name"] in AS_IS and e["name"] not in again] + as_is
    written.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
