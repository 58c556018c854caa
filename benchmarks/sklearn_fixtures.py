"""scikit-learn models exported by skl2onnx, and one SGD step of each computed in float64 by torch
autograd from the estimator's own attributes: the fixtures of
``tests/emulator/toolchain/test_sklearn_exports.py``, which never imports scikit-learn, skl2onnx
or torch.

    PYTHONPATH=. /work/skenv/bin/python -m benchmarks.sklearn_fixtures [--out DIR]

in a virtualenv of its own, outside the repository::

    python3 -m venv /work/skenv
    /work/skenv/bin/pip install scikit-learn skl2onnx onnx onnxruntime torch numpy

For each model of :data:`MODELS` (fitted on :func:`data`, nothing downloaded) it writes
``sklearn_<name>.onnx.gz``: ``skl2onnx.to_onnx(estimator, X[:1], target_opset={"": 17, "ai.onnx.ml": 3})``
with the options the entry names (``zipmap`` left at skl2onnx's default unless ``zipmap: False``).
Beside it, ``sklearn_<name>.npz``: the batch (``input``, ``label``), the loss and every weight the
plan trains after one SGD step of learning rate :data:`LR` in float64 (``after``, in the order and
shapes of ``index``), with torch float32's own error per weight (``float32_error``). The step is
written from scikit-learn's attributes (``coef_``, ``intercept_``, ``coefs_``, a scaler's
``mean_`` and ``scale_``), not from the ONNX file: the loss is cross-entropy of the model's
``predict_proba`` (of its decision function for ``LinearSVC`` and a hinge ``SGDClassifier``, which
have none) or the mean squared error of ``predict``, the mean over the batch. The weights are named
as the plan names them: skl2onnx's initializers where it writes standard ops (an MLP's
``coefficient``, ``intercepts``), ``<node>.coefficients`` and ``<node>.intercepts`` where the plan
writes an ``ai.onnx.ml`` linear op in standard ops (``emulator/toolchain/ml_ops.py``).
``sklearn_<name>.as_is.onnx.gz`` are tree models and naive Bayes classifiers, refused without a step.
"""

from __future__ import annotations

import gzip
import json
import platform
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import skl2onnx
import sklearn
import torch
from skl2onnx import to_onnx
from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge, SGDClassifier
from sklearn.naive_bayes import GaussianNB, MultinomialNB
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MinMaxScaler, Normalizer, StandardScaler
from sklearn.svm import LinearSVC

from benchmarks.fixture_cli import make_fixtures

OUT = Path(__file__).resolve().parent.parent / "tests" / "emulator" / "toolchain" / "sklearn"
LR = 0.5
BATCH = 8
OPSET = {"": 17, "ai.onnx.ml": 3}
T = torch.Tensor


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Five features, a binary label, a three-class label and a real target."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 5)).astype(np.float32)
    binary = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.normal(size=80) > 0).astype(np.int64)
    three = np.digitize(x[:, 0] - x[:, 2] + 0.3 * rng.normal(size=80), [-0.6, 0.6]).astype(np.int64)
    target = (x @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.7 + 0.1 * rng.normal(size=80)).astype(np.float32)
    return x, binary, three, target


def f32(a: Any) -> np.ndarray:
    """A value as skl2onnx writes it (float32), widened again for the float64 step."""
    return np.asarray(a, np.float32).astype(np.float64)


def _binary_probabilities(z: T) -> T:
    p = torch.sigmoid(z.reshape(-1, 1))
    return torch.cat([1 - p, p], dim=1)


def _cross_entropy(p: T, y: np.ndarray) -> T:
    return -torch.log(p[torch.arange(len(y)), torch.as_tensor(y)]).mean()


def _logits_cross_entropy(s: T, y: np.ndarray) -> T:
    return torch.nn.functional.cross_entropy(s, torch.as_tensor(y))


def _mse(prediction: T, y: np.ndarray) -> T:
    return ((prediction.reshape(-1) - torch.as_tensor(y, dtype=prediction.dtype)) ** 2).mean()


# Each: the fitted estimator -> (named start weights (plan name -> value as skl2onnx wrote it),
# loss of (weights, x, y) in torch)
Reference = tuple[dict[str, np.ndarray], Callable[[dict[str, T], T, np.ndarray], T]]


def linear_binary(clf: Any, node: str = "LinearClassifier") -> Reference:
    weights = {f"{node}.coefficients": f32(clf.coef_).T, f"{node}.intercepts": f32(clf.intercept_)}

    def loss(w: dict[str, T], x: T, y: np.ndarray) -> T:
        z = x @ w[f"{node}.coefficients"] + w[f"{node}.intercepts"]
        return _cross_entropy(_binary_probabilities(z), y)

    return weights, loss


def linear_softmax(clf: Any, node: str = "LinearClassifier") -> Reference:
    weights = {f"{node}.coefficients": f32(clf.coef_).T, f"{node}.intercepts": f32(clf.intercept_)}

    def loss(w: dict[str, T], x: T, y: np.ndarray) -> T:
        return _logits_cross_entropy(x @ w[f"{node}.coefficients"] + w[f"{node}.intercepts"], y)

    return weights, loss


def sgd_one_vs_rest(clf: Any) -> Reference:
    weights = {"coef": f32(clf.coef_).T, "intercept": f32(clf.intercept_)}

    def loss(w: dict[str, T], x: T, y: np.ndarray) -> T:
        p = torch.sigmoid(x @ w["coef"] + w["intercept"])
        return _cross_entropy(p / p.sum(dim=1, keepdim=True), y)

    return weights, loss


def sgd_binary(clf: Any) -> Reference:
    weights = {"coef": f32(clf.coef_).T, "intercept": f32(clf.intercept_)}
    return weights, lambda w, x, y: _cross_entropy(_binary_probabilities(x @ w["coef"] + w["intercept"]), y)


def sgd_hinge(clf: Any) -> Reference:
    """No predict_proba: the decision function s, as skl2onnx's [-s, s], read as logits."""
    weights = {"coef": f32(clf.coef_).T, "intercept": f32(clf.intercept_)}

    def loss(w: dict[str, T], x: T, y: np.ndarray) -> T:
        s = x @ w["coef"] + w["intercept"]
        return _logits_cross_entropy(torch.cat([-s, s], dim=1), y)

    return weights, loss


def linear_regression(reg: Any) -> Reference:
    weights = {
        "LinearRegressor.coefficients": f32(reg.coef_).reshape(-1, 1),
        "LinearRegressor.intercepts": f32(reg.intercept_).reshape(1),
    }
    return weights, lambda w, x, y: _mse(x @ w["LinearRegressor.coefficients"] + w["LinearRegressor.intercepts"], y)


def _mlp_weights(net: Any) -> dict[str, np.ndarray]:
    out = {}
    for k, (c, b) in enumerate(zip(net.coefs_, net.intercepts_)):
        suffix = str(k) if k else ""
        out[f"coefficient{suffix}"], out[f"intercepts{suffix}"] = f32(c), f32(b)
    return out


def _mlp_hidden(w: dict[str, T], x: T) -> T:
    return torch.relu(x @ w["coefficient"] + w["intercepts"]) @ w["coefficient1"] + w["intercepts1"]


def mlp_classifier(net: Any) -> Reference:
    if len(net.classes_) == 2:
        return _mlp_weights(net), lambda w, x, y: _cross_entropy(_binary_probabilities(_mlp_hidden(w, x)), y)
    return _mlp_weights(net), lambda w, x, y: _logits_cross_entropy(_mlp_hidden(w, x), y)


def mlp_regressor(net: Any) -> Reference:
    return _mlp_weights(net), lambda w, x, y: _mse(_mlp_hidden(w, x), y)


def standard_scaler_softmax(pipe: Any) -> Reference:
    scaler, clf = pipe.steps[0][1], pipe.steps[-1][1]
    mean, scale = torch.as_tensor(f32(scaler.mean_)), torch.as_tensor(f32(1 / scaler.scale_))
    weights, inner = linear_softmax(clf)
    return weights, lambda w, x, y: inner(w, (x - mean.to(x.dtype)) * scale.to(x.dtype), y)


def min_max_normalizer_binary(pipe: Any) -> Reference:
    scaler, clf = pipe.steps[0][1], pipe.steps[-1][1]
    scale, shift = torch.as_tensor(f32(scaler.scale_)), torch.as_tensor(f32(scaler.min_))
    weights, inner = linear_binary(clf)

    def loss(w: dict[str, T], x: T, y: np.ndarray) -> T:
        h = x * scale.to(x.dtype) + shift.to(x.dtype)
        return inner(w, h / torch.linalg.vector_norm(h, dim=1, keepdim=True), y)

    return weights, loss


#: name -> (estimator, which label, export options, reference, loss)
MODELS: dict[str, tuple[Callable[[], Any], str, dict[str, Any], Callable[[Any], Reference], str]] = {
    "logistic_binary": (LogisticRegression, "binary", {}, linear_binary, "cross_entropy"),
    "logistic_binary_nozipmap": (LogisticRegression, "binary", {"zipmap": False}, linear_binary, "cross_entropy"),
    "logistic_multiclass": (LogisticRegression, "three", {}, linear_softmax, "cross_entropy"),
    "logistic_multiclass_nozipmap": (
        LogisticRegression,
        "three",
        {"zipmap": False},
        linear_softmax,
        "cross_entropy",
    ),
    "sgd_log_multiclass": (
        lambda: SGDClassifier(loss="log_loss", random_state=0),
        "three",
        {"zipmap": False},
        sgd_one_vs_rest,
        "cross_entropy",
    ),
    "sgd_log_binary": (
        lambda: SGDClassifier(loss="log_loss", random_state=0),
        "binary",
        {"zipmap": False},
        sgd_binary,
        "cross_entropy",
    ),
    "sgd_hinge_binary": (
        lambda: SGDClassifier(random_state=0),
        "binary",
        {"zipmap": False},
        sgd_hinge,
        "cross_entropy",
    ),
    "linear_svc": (lambda: LinearSVC(C=0.1), "three", {}, linear_softmax, "cross_entropy"),
    "linear_regression": (LinearRegression, "target", {}, linear_regression, "mse"),
    "ridge": (Ridge, "target", {}, linear_regression, "mse"),
    "mlp_classifier": (
        lambda: MLPClassifier(hidden_layer_sizes=(6,), max_iter=30, random_state=0),
        "three",
        {"zipmap": False},
        mlp_classifier,
        "cross_entropy",
    ),
    "mlp_classifier_binary": (
        lambda: MLPClassifier(hidden_layer_sizes=(6,), max_iter=30, random_state=0),
        "binary",
        {},
        mlp_classifier,
        "cross_entropy",
    ),
    "mlp_regressor": (
        lambda: MLPRegressor(hidden_layer_sizes=(6,), max_iter=30, random_state=0),
        "target",
        {},
        mlp_regressor,
        "mse",
    ),
    "scaler_logistic": (
        lambda: make_pipeline(StandardScaler(), LogisticRegression()),
        "three",
        {"zipmap": False},
        standard_scaler_softmax,
        "cross_entropy",
    ),
    "minmax_normalizer_logistic": (
        lambda: make_pipeline(MinMaxScaler(), Normalizer(), LogisticRegression()),
        "binary",
        {"zipmap": False},
        min_max_normalizer_binary,
        "cross_entropy",
    ),
}
#: name -> (estimator, which label, loss): refused, without a step
AS_IS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "random_forest": (
        lambda: RandomForestClassifier(n_estimators=3, max_depth=2, random_state=0),
        "three",
        "cross_entropy",
    ),
    "gradient_boosting": (lambda: GradientBoostingRegressor(n_estimators=3, random_state=0), "target", "mse"),
    "gaussian_nb": (GaussianNB, "three", "cross_entropy"),
    # counts: the features made non-negative by a MinMaxScaler
    "multinomial_nb": (lambda: make_pipeline(MinMaxScaler(), MultinomialNB()), "three", "cross_entropy"),
}


def _options(estimator: Any, options: dict[str, Any]) -> dict[str, Any] | None:
    return {id(estimator.steps[-1][1] if hasattr(estimator, "steps") else estimator): options} if options else None


def _step(
    reference: Reference, x: np.ndarray, y: np.ndarray, dtype: torch.dtype
) -> tuple[float, dict[str, np.ndarray]]:
    start, loss_of = reference
    w = {n: torch.tensor(v, dtype=dtype, requires_grad=True) for n, v in start.items()}
    loss = loss_of(w, torch.as_tensor(x, dtype=dtype), y)
    loss.backward()
    return float(loss), {n: (t - LR * t.grad).detach().numpy().astype(np.float64) for n, t in w.items()}


def _write(out: Path, name: str, model: onnx.ModelProto) -> None:
    (out / name).write_bytes(gzip.compress(model.SerializeToString(), mtime=0))


def make(out: Path) -> dict[str, Any]:
    x, binary, three, target = data()
    labels = {"binary": binary, "three": three, "target": target}
    batch = x[:BATCH]
    fixtures, as_is = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unconverged fits: the weights are what matters
        for name, (make_estimator, label, options, reference, loss) in MODELS.items():
            estimator = make_estimator().fit(x, labels[label])
            model = to_onnx(estimator, x[:1], target_opset=OPSET, options=_options(estimator, options))
            _write(out, f"sklearn_{name}.onnx.gz", model)
            ref = reference(estimator)
            y = labels[label][:BATCH]
            value, after = _step(ref, batch, y, torch.float64)
            _, after32 = _step(ref, batch, y, torch.float32)
            names = list(after)
            index = {"input": model.graph.input[0].name, "initializers": [[n, list(after[n].shape)] for n in names]}
            np.savez_compressed(
                out / f"sklearn_{name}.npz",
                input=batch,
                label=y.astype(np.float32).reshape(-1, 1) if loss == "mse" else y.astype(np.int64),
                loss=np.float64(value),
                after=np.concatenate([after[n].reshape(-1) for n in names]),
                float32_error=np.array([np.abs(after32[n] - after[n]).max() for n in names]),
                index=json.dumps(index),
            )
            ml = sorted({n.op_type for n in model.graph.node if n.domain == "ai.onnx.ml"})
            fixtures.append(
                {
                    "name": name,
                    "model": f"sklearn_{name}.onnx.gz",
                    "reference": f"sklearn_{name}.npz",
                    "loss": loss,
                    "estimator": type(estimator).__name__,
                    "ml_ops": ml,
                }
            )
        for name, (make_estimator, label, loss) in AS_IS.items():
            estimator = make_estimator().fit(x, labels[label])
            model = to_onnx(
                estimator,
                x[:1],
                target_opset=OPSET,
                options=_options(estimator, {"zipmap": False} if loss == "cross_entropy" else {}),
            )
            _write(out, f"sklearn_{name}.as_is.onnx.gz", model)
            as_is.append(
                {
                    "name": name,
                    "model": f"sklearn_{name}.as_is.onnx.gz",
                    "loss": loss,
                    "estimator": type(estimator.steps[-1][1] if hasattr(estimator, "steps") else estimator).__name__,
                }
            )
    return {
        "regenerate": "PYTHONPATH=. python -m benchmarks.sklearn_fixtures  (in a virtualenv with scikit-learn, skl2onnx and torch)",
        "versions": {
            "scikit-learn": sklearn.__version__,
            "skl2onnx": skl2onnx.__version__,
            "onnx": onnx.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "export": f"skl2onnx.to_onnx(estimator, X[:1], target_opset={OPSET})",
        "step": "torch autograd in float64 from the estimator's attributes, cross-entropy of predict_proba or mse",
        "batch": BATCH,
        "lr": LR,
        "fixtures": fixtures,
        "as_is": as_is,
    }


def main() -> None:
    manifest, out = make_fixtures(__doc__ or "", OUT, make)
    print(f"{len(manifest['fixtures'])} fixtures and {len(manifest['as_is'])} refused models in {out}")


if __name__ == "__main__":
    main()
