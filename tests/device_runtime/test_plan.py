"""The plan format: round trip, and each refusal of load_plan with its own message."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest

from device_runtime.executor import PlanExecutor, make_session
from device_runtime.plan import (
    _PREFIX,
    MAGIC,
    PLAN_FORMAT_VERSION,
    PlanError,
    load_ort_support_record,
    load_plan,
    max_ir_version_for_runtime,
    max_opset_for_runtime,
    min_runtime_for_opset,
    serialize_plan,
)
from device_runtime.plan_builder import build_eval_plan, build_mlp_plan, build_softmax_regression_plan, initial_weights
from example_store import ExampleSelector

SEL = ExampleSelector("app:/digits", start_time=10.0, limit=500, order="newest")


@pytest.fixture(scope="module")
def plan():
    return build_mlp_plan(
        8,
        (5,),
        3,
        learning_rate=0.3,
        batch_size=4,
        epochs=2,
        selector=SEL,
        inputs={"x": "pixels", "y": "label"},
        shuffle_seed=7,
        name="tiny",
        time_budget_s=30.0,
    )


@pytest.fixture(scope="module")
def data(plan):
    return serialize_plan(plan)


def _reseal(content: bytes) -> bytes:
    """Recompute the overall checksum, as someone who rewrites a plan on purpose would."""
    body = content[:-32]
    return body + hashlib.sha256(body).digest()


def test_round_trip_is_identical(plan, data):
    loaded = load_plan(data)
    assert loaded == plan
    assert serialize_plan(loaded) == data
    assert loaded.device.selector == SEL
    assert loaded.device.inputs == {"x": "pixels", "y": "label"}
    eval_plan = build_eval_plan(plan)
    assert load_plan(serialize_plan(eval_plan)) == eval_plan


def test_plan_contains_no_pickle(data):
    assert b"\x80\x04\x95" not in data and b"numpy" not in data


def test_bad_magic(data):
    with pytest.raises(PlanError, match="magic"):
        load_plan(b"PK\x03\x04" + data[4:])
    with pytest.raises(PlanError, match="magic"):
        load_plan(b"")


@pytest.mark.parametrize("where", ["header", "graph", "trailer"])
def test_bit_flip_is_refused(data, where):
    header_len = struct.unpack_from("<I", data, 10)[0]
    pos = {"header": _PREFIX.size + 5, "graph": _PREFIX.size + header_len + 40, "trailer": len(data) - 3}[where]
    flipped = bytearray(data)
    flipped[pos] ^= 0x10
    with pytest.raises(PlanError, match="checksum"):
        load_plan(bytes(flipped))


def test_every_single_byte_corruption_is_refused(data):
    for pos in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        with pytest.raises(PlanError):
            load_plan(bytes(flipped))


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.01, 0.3, 0.9, 0.9999])
def test_truncated_is_refused(data, keep):
    cut = data[: int(len(data) * keep)]
    with pytest.raises(PlanError, match="truncated|magic"):
        load_plan(cut)


def test_truncated_says_so(data):
    with pytest.raises(PlanError, match="truncated"):
        load_plan(data[:-100])
    with pytest.raises(PlanError, match="trailing"):
        load_plan(data + b"\x00")


def test_future_format_version_is_refused(data):
    future = bytearray(data)
    struct.pack_into("<H", future, len(MAGIC), PLAN_FORMAT_VERSION + 1)
    with pytest.raises(PlanError, match="newer than this runtime reads"):
        load_plan(_reseal(bytes(future)))


def test_opset_too_high_for_the_given_runtime():
    plan = build_softmax_regression_plan(4, 3, selector=SEL, opset=21)
    data = serialize_plan(plan)
    assert plan.metadata.min_runtime_version == "1.18.0"
    load_plan(data, runtime_version="1.20.3")
    with pytest.raises(PlanError, match="opset 21 is above what onnxruntime 1.16.0 runs"):
        # lying about the supported range must not get a plan past the opset check
        load_plan(
            serialize_plan(
                dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, min_runtime_version="1.15.0"))
            ),
            runtime_version="1.16.0",
        )
    with pytest.raises(PlanError, match="supports runtimes 1.18.0"):
        load_plan(data, runtime_version="1.16.0")


def test_runtime_version_outside_the_claimed_range(plan):
    ranged = dataclasses.replace(
        plan, metadata=dataclasses.replace(plan.metadata, min_runtime_version="1.20.0", max_runtime_version="1.25.9")
    )
    data = serialize_plan(ranged)
    assert load_plan(data, runtime_version="1.22.1").metadata.max_runtime_version == "1.25.9"
    for version in ("1.19.2", "1.26.0", "1.31.1"):
        with pytest.raises(PlanError, match="supports runtimes 1.20.0 to 1.25.9, not"):
            load_plan(data, runtime_version=version)
    with pytest.raises(PlanError, match="not a version"):
        load_plan(data, runtime_version="latest")
    load_plan(data)  # without a runtime version (the server) only what the installed ORT runs is checked


def test_ir_version_above_what_the_runtime_loads(plan):
    above = max_ir_version_for_runtime(onnxruntime.__version__) + 1  # one past the installed release's
    model = onnx.ModelProto.FromString(plan.work)
    model.ir_version = above
    bumped = dataclasses.replace(
        plan, work=model.SerializeToString(), metadata=dataclasses.replace(plan.metadata, ir_version=above)
    )
    with pytest.raises(PlanError, match=f"IR version {above}"):
        load_plan(serialize_plan(bumped))
    # a graph whose IR version exceeds the plan's declared one is refused too
    declared_plus_one = plan.metadata.ir_version + 1
    model.ir_version = declared_plus_one
    sneaky = dataclasses.replace(plan, work=model.SerializeToString())
    with pytest.raises(PlanError, match=f"graph 'work' has IR version {declared_plus_one}"):
        load_plan(serialize_plan(sneaky))


def test_non_onnx_blob_with_valid_checksums_is_refused(plan):
    for blob in (b"this is not an onnx model at all" * 10, b"\x08\x07", b""):
        bad = dataclasses.replace(plan, server=dataclasses.replace(plan.server, merge=blob))
        with pytest.raises(PlanError, match="graph 'merge'"):
            load_plan(serialize_plan(bad))


def test_graph_failing_the_checker_is_refused(plan):
    model = onnx.ModelProto.FromString(plan.server.report)
    model.graph.node[0].op_type = "NoSuchOp"
    bad = dataclasses.replace(plan, server=dataclasses.replace(plan.server, report=model.SerializeToString()))
    with pytest.raises(PlanError, match="graph 'report' fails the ONNX checker"):
        load_plan(serialize_plan(bad))


def test_custom_domains_and_mismatched_names_are_refused(plan):
    model = onnx.ModelProto.FromString(plan.work)
    model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    bad = dataclasses.replace(plan, work=model.SerializeToString())
    with pytest.raises(PlanError, match="domain 'com.microsoft'"):
        load_plan(serialize_plan(bad))
    renamed = dataclasses.replace(plan, weight_names=("w0", "b0", "w1", "bias1"))
    with pytest.raises(PlanError, match="missing inputs"):
        load_plan(serialize_plan(renamed))


def test_bad_header_fields_are_refused(plan):
    for bad in (
        dataclasses.replace(plan, kind="distill"),
        dataclasses.replace(plan, device=dataclasses.replace(plan.device, batch_size=0)),
        dataclasses.replace(plan, weight_outputs=plan.weight_outputs[:-1]),
        dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, min_runtime_version="one")),
    ):
        with pytest.raises(PlanError):
            load_plan(serialize_plan(bad))


def test_version_tables_follow_the_measured_record():
    # the values themselves are checked against ort_support.json in test_ort_support.py
    record = load_ort_support_record()
    for row in record:
        assert max_opset_for_runtime(row["release"]) == row["max_opset"]
        assert max_ir_version_for_runtime(row["release"]) == row["max_ir"]
        assert max_opset_for_runtime(min_runtime_for_opset(row["max_opset"])) == row["max_opset"]
    newest = max(record, key=lambda row: row["minor"])["release"]
    assert max_opset_for_runtime("1.40.0") == max_opset_for_runtime(newest)
    with pytest.raises(PlanError, match="older than"):
        max_opset_for_runtime("1.14.1")


@pytest.mark.parametrize("opset", [13, 15, 17, 19, 20, 21, 22, 23, 26])
def test_plans_emitted_at_each_opset_load_and_train_alike(opset):
    plan = build_mlp_plan(6, (4,), 3, learning_rate=0.2, selector=SEL, opset=opset)
    loaded = load_plan(serialize_plan(plan), runtime_version=plan.metadata.min_runtime_version)
    model = onnx.ModelProto.FromString(loaded.work)
    assert (
        model.ir_version == loaded.metadata.ir_version <= max_ir_version_for_runtime(plan.metadata.min_runtime_version)
    )
    assert [o.version for o in model.opset_import] == [opset]
    w = initial_weights(loaded, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 6)).astype(np.float32), rng.integers(0, 3, 5)
    out = make_session(loaded.work).run(["w0_new", "loss_sum"], {**w, "x": x, "y": y})
    ref = make_session(build_mlp_plan(6, (4,), 3, learning_rate=0.2, selector=SEL, opset=17).work).run(
        ["w0_new", "loss_sum"], {**w, "x": x, "y": y}
    )
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-6, atol=1e-7)
    assert PlanExecutor(loaded).client_update_spec()["w0"] == ((6, 4), np.dtype(np.float32))


@pytest.mark.parametrize("header", [b"[" * 100_000 + b"]" * 100_000, b'{"a": NaN}', b"{" * 5000])
def test_a_plan_header_that_nests_deeply_or_holds_nan_is_refused_as_a_plan_error(header):
    import hashlib

    from device_runtime.plan import _DIGEST_LEN, _PREFIX, MAGIC, PLAN_FORMAT_VERSION

    total = _PREFIX.size + len(header) + _DIGEST_LEN
    content = _PREFIX.pack(MAGIC, PLAN_FORMAT_VERSION, len(header), total) + header
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(content + hashlib.sha256(content).digest())


def test_shared_weights_round_trip_and_plans_without_them_keep_their_bytes(plan, data):
    """The metadata's tied weights: written only when there are some, so that existing plans (and
    their ids) do not change; a plan written before the field loads with none."""
    assert b"shared_weights" not in data and load_plan(data).metadata.shared_weights == ()
    tied = dataclasses.replace(
        plan, metadata=dataclasses.replace(plan.metadata, shared_weights=(plan.weight_names[0],))
    )
    written = serialize_plan(tied)
    assert load_plan(written) == tied and serialize_plan(load_plan(written)) == written


def test_shared_weights_that_are_not_weights_of_the_plan_are_refused(plan):
    bad = dataclasses.replace(plan, metadata=dataclasses.replace(plan.metadata, shared_weights=("not_a_weight",)))
    with pytest.raises(PlanError, match="shared_weights names 'not_a_weight'"):
        load_plan(serialize_plan(bad))


#: Measured in a process of its own: the most a plan's load takes above the plan's bytes, as a
#: multiple of them: about 2.3 (the plan keeps a copy of its graphs, and each graph is parsed by the
#: checks, then by the ONNX checker). It took about 9.6 here, 8 on a 200 MB plan: 1.6 GB.
LOAD_MEMORY_TIMES = 3.5
_LOAD_IN_A_PROCESS = """
import sys
import onnx, onnxruntime
from device_runtime.plan import load_plan

def kib(field):  # VmRSS: held now; VmHWM: the most held (ru_maxrss keeps the forking parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

with open(sys.argv[1], "rb") as f:
    data = f.read()
before = kib("VmRSS")
plan = load_plan(data)
print((kib("VmHWM") - before) * 1024 / len(data))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the process's memory from /proc")
def test_loading_a_plan_takes_a_few_times_its_size_in_memory_not_eight(plan, tmp_path):
    """A plan whose work graph holds 6 MB of frozen weights (an initializer a MatMul reads)."""
    model = onnx.ModelProto.FromString(plan.work)
    frozen = np.random.default_rng(0).standard_normal((8, 3 << 16), dtype=np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(frozen, "frozen"))
    model.graph.node.append(onnx.helper.make_node("MatMul", ["x", "frozen"], ["frozen_features"]))
    path = tmp_path / "large.plan"
    path.write_bytes(serialize_plan(dataclasses.replace(plan, work=model.SerializeToString())))
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_PROCESS, str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert float(done.stdout) < LOAD_MEMORY_TIMES, done.stdout
