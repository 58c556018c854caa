"""scikit-learn models exported by skl2onnx take the step torch autograd computes from the estimator.

The fixtures in ``sklearn/`` (``benchmarks/sklearn_fixtures.py`` makes them, in a virtualenv with
scikit-learn, skl2onnx and torch; the README there says how) are fitted estimators converted by
``skl2onnx.to_onnx``: logistic regressions (binary and three classes, with skl2onnx's default
``ZipMap`` and without), ``SGDClassifier`` (log loss binary and one-vs-rest, hinge), ``LinearSVC``,
``LinearRegression`` and ``Ridge``, ``MLPClassifier`` (binary and three classes) and
``MLPRegressor``, and pipelines of ``StandardScaler`` or ``MinMaxScaler`` and ``Normalizer`` before
a ``LogisticRegression``. skl2onnx writes the linear models and scalers as ``ai.onnx.ml`` ops, which
the plan writes in standard ops (``emulator/toolchain/ml_ops.py``): those compute what onnxruntime's
own kernels compute on the original file, and one step of the plan's work graph lands where torch's
float64 step lands, weight by weight. Tree ensembles are refused in one line. Nothing here imports
scikit-learn, skl2onnx or torch.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from emulator.cli.commands import main
from emulator.toolchain import ml_ops
from emulator.toolchain.tasks import TaskError, onnx_import
from tests.emulator.toolchain.test_exported_models import task_for
from tests.emulator.toolchain.test_keras_exports import assert_step_matches, reference

FOLDER = Path(__file__).with_name("sklearn")
MANIFEST = json.loads((FOLDER / "manifest.json").read_text())
FIXTURES = MANIFEST["fixtures"]


@pytest.mark.parametrize("entry", FIXTURES, ids=[e["name"] for e in FIXTURES])
def test_a_plan_step_matches_torchs_step_from_the_estimator_for_every_weight(entry):
    """The loss (cross-entropy of ``predict_proba``, or the squared error) and every weight the
    plan trains, as torch's float64 step from the estimator's attributes leaves them, within float32
    noise; those are exactly the estimator's weights (a scaler's constants do not train)."""
    step = assert_step_matches(entry, MANIFEST, FOLDER, "torch")
    assert set(step.after) == set(reference(entry["reference"], FOLDER)[2])


def _outputs(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run(None, {model.graph.input[0].name: x})
    out = {}
    for o, v in zip(session.get_outputs(), values):
        if isinstance(v, list):  # ZipMap's maps, one per example, in the classes' order
            v = np.array([list(row.values()) for row in v], np.float32)
        out[o.name] = np.asarray(v)
    return out


def _translated(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    ml_ops.standard_form(copy)
    return copy


@pytest.mark.parametrize("entry", [e for e in FIXTURES if e["ml_ops"]], ids=lambda e: e["name"])
def test_ml_ops_written_in_standard_ops_compute_what_onnxruntime_computes(entry):
    """The translated graph holds no ``ai.onnx.ml`` op the prediction reads and its outputs (the
    probabilities or prediction, and the label) equal onnxruntime's on the file as exported."""
    model = onnx.ModelProto.FromString(gzip.decompress((FOLDER / entry["model"]).read_bytes()))
    x = np.load(FOLDER / entry["reference"])["input"]
    translated = _translated(model)
    assert not {n.op_type for n in translated.graph.node if n.domain == ml_ops.ML_DOMAIN} & set(ml_ops.TRANSLATED)
    expected, got = _outputs(model, x), _outputs(translated, x)
    assert set(got) == set(expected)
    for name, value in expected.items():
        if value.dtype.kind == "f":
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def _ml_model(node: onnx.NodeProto, outputs: list[onnx.ValueInfoProto], width: int = 3) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, width])], outputs
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])


_SCORES = [
    helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
    helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, None]),
]
_X = np.array([[1.0, 2.0, 0.0], [-3.0, 0.5, 1.0], [0.1, -0.2, 0.3], [0.0, 0.0, 0.0]], np.float32)


@pytest.mark.parametrize(
    "node",
    [
        # one row of coefficients for two classes: onnxruntime's [1 - z, z], or [1 - sigmoid(z), sigmoid(z)]
        *(
            helper.make_node(
                "LinearClassifier",
                ["X"],
                ["label", "scores"],
                domain="ai.onnx.ml",
                coefficients=[0.5, -1.0, 2.0],
                intercepts=[0.25],
                classlabels_ints=[3, 7],
                post_transform=post,
            )
            for post in ("NONE", "LOGISTIC", "SOFTMAX")
        ),
        *(  # one row per class
            helper.make_node(
                "LinearClassifier",
                ["X"],
                ["label", "scores"],
                domain="ai.onnx.ml",
                coefficients=[0.5, -1.0, 2.0, 1.0, 0.0, -0.5, 0.1, 0.2, 0.3],
                intercepts=[0.25, -0.5, 0.0],
                classlabels_ints=[0, 1, 2],
                post_transform=post,
            )
            for post in ("NONE", "LOGISTIC", "SOFTMAX")
        ),
        *(
            helper.make_node("Normalizer", ["X"], ["scores"], domain="ai.onnx.ml", norm=norm)
            for norm in ("MAX", "L1", "L2")
        ),
        helper.make_node(
            "Scaler", ["X"], ["scores"], domain="ai.onnx.ml", offset=[0.5, -1.0, 2.0], scale=[2.0, 0.5, 1.0]
        ),
        helper.make_node(
            "LinearRegressor",
            ["X"],
            ["scores"],
            domain="ai.onnx.ml",
            coefficients=[1.0, 2.0, 3.0, -1.0, 0.0, 0.5],
            intercepts=[0.5, -0.5],
            targets=2,
        ),
    ],
    ids=lambda n: (
        f"{n.op_type}-{next((a.s.decode() for a in n.attribute if a.name in ('post_transform', 'norm')), '')}"
    ),
)
def test_each_written_form_computes_what_onnxruntime_computes(node):
    """Forms skl2onnx writes that the fixtures do not reach (one row of coefficients for two classes,
    class labels other than 0..K-1, every ``post_transform`` and ``norm``, a zero row) as onnxruntime
    computes them."""
    outputs = _SCORES if node.op_type == "LinearClassifier" else _SCORES[1:]
    model = _ml_model(node, outputs)
    expected, got = _outputs(model, _X), _outputs(_translated(model), _X)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_post_transform_with_no_standard_form_is_refused_in_one_line():
    node = helper.make_node(
        "LinearClassifier",
        ["X"],
        ["label", "scores"],
        name="svm",
        domain="ai.onnx.ml",
        coefficients=[0.5, -1.0, 2.0],
        intercepts=[0.25],
        classlabels_ints=[0, 1],
        post_transform="PROBIT",
    )
    with pytest.raises(ValueError) as refused:
        ml_ops.standard_form(_ml_model(node, _SCORES))
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "op 'ai.onnx.ml.LinearClassifier' (node 'svm') has post_transform PROBIT" in message and "export" in message


TREES = [e for e in MANIFEST["as_is"] if not e["estimator"].endswith("NB")]
NAIVE_BAYES = [e for e in MANIFEST["as_is"] if e["estimator"].endswith("NB")]


@pytest.mark.parametrize("entry", TREES, ids=[e["name"] for e in TREES])
def test_a_tree_ensemble_is_refused_in_one_line_saying_it_has_no_gradient(entry):
    task = task_for(entry, MANIFEST, FOLDER)
    with pytest.raises(TaskError) as refused:
        onnx_import(task._model_source(), task)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "ai.onnx.ml.TreeEnsemble" in message and "no gradient" in message and "skl2onnx of a linear model" in message


@pytest.mark.parametrize("entry", NAIVE_BAYES, ids=[e["name"] for e in NAIVE_BAYES])
def test_a_naive_bayes_classifier_is_refused_in_one_line_naming_it_and_what_to_export(entry):
    """skl2onnx writes naive Bayes in standard ops, from statistics counted from the data (GaussianNB's
    log-normalizer of its variances a constant of its own): a gradient step would train no such model."""
    task = task_for(entry, MANIFEST, FOLDER)
    with pytest.raises(TaskError) as refused:
        onnx_import(task._model_source(), task)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert f"is a scikit-learn {'GaussianNB' if entry['estimator'] == 'GaussianNB' else 'naive Bayes'}" in message
    assert "counted from the data, not learned by gradient steps" in message
    assert "skl2onnx of a LogisticRegression" in message and "MLPClassifier" in message


def test_a_zipmap_classifier_becomes_a_bundle_whose_examples_are_the_classes(tmp_path, capsys):
    """skl2onnx's default output (a sequence of maps) is read as the probabilities it maps: the
    bundle's random labels are class ids below the classifier's three classes."""
    model = tmp_path / "logistic.onnx"
    model.write_bytes(gzip.decompress((FOLDER / "sklearn_logistic_multiclass.onnx.gz").read_bytes()))
    code = main(["plan", "from-onnx", str(model), "--label", "y", "--runtimes", "1.31.1", "-o", str(tmp_path / "b")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "LinearClassifier.coefficients  [5, 3]" in out.out or "LinearClassifier.coefficients" in out.out
    assert "did not run on random examples" not in out.err
    assert "'y': ('int64', (), 3)" in (tmp_path / "b" / "task.py").read_text()


def test_a_tree_file_with_no_standard_opset_is_refused_as_trees_are(tmp_path, capsys):
    """onnxmltools writes an XGBoost regressor as one ``TreeEnsembleRegressor`` and imports the
    ``ai.onnx.ml`` opset alone: the refusal names the trees, not the missing opset."""
    node = helper.make_node(
        "TreeEnsembleRegressor",
        ["X"],
        ["variable"],
        domain="ai.onnx.ml",
        n_targets=1,
        nodes_treeids=[0],
        nodes_nodeids=[0],
        nodes_featureids=[0],
        nodes_modes=["LEAF"],
        nodes_values=[0.0],
        nodes_truenodeids=[0],
        nodes_falsenodeids=[0],
        target_treeids=[0],
        target_nodeids=[0],
        target_ids=[0],
        target_weights=[0.5],
    )
    graph = helper.make_graph(
        [node],
        "xgb",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("variable", TensorProto.FLOAT, [None, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)])
    onnx.save_model(model, str(tmp_path / "xgb.onnx"))
    assert (
        main(
            [
                "plan",
                "from-onnx",
                str(tmp_path / "xgb.onnx"),
                "--label",
                "y",
                "--loss",
                "mse",
                "-o",
                str(tmp_path / "b"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ai.onnx.ml.TreeEnsembleRegressor" in err and "no gradient" in err


def test_a_regressor_under_the_default_cross_entropy_is_refused_in_one_line_naming_mse(tmp_path, capsys):
    """``plan from-onnx``'s default loss is cross_entropy: over a regressor's one output per example its
    softmax is 1 whatever the weights, a loss of 0 that trains nothing."""
    model = tmp_path / "ridge.onnx"
    model.write_bytes(gzip.decompress((FOLDER / "sklearn_ridge.onnx.gz").read_bytes()))
    assert main(["plan", "from-onnx", str(model), "--label", "y", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cross_entropy needs at least two classes" in err and "mse" in err
    assert not (tmp_path / "b").exists()
