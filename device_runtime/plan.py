"""The FL plan: one serialized artifact holding the device part (the ``work`` graph and how to feed
it), the server part (MapReduceForm: ``prepare``, ``zero``, ``accumulate``, ``merge``, ``report``,
``update``, all ONNX graphs) and metadata (opset, IR version, supported runtime versions, budgets).

Container layout (all integers little-endian)::

    MAGIC (8 bytes)  b"FLPLAN\\r\\n"
    format_version   u16
    header_length    u32
    total_length     u64   length of the whole file, trailer included
    header           JSON (UTF-8): every field of the plan, and for each graph blob its
                     offset, length and sha256
    blobs            the serialized ONNX models, back to back
    trailer          sha256 over everything before it (32 bytes)

No pickle anywhere: the header is JSON and the graphs are ONNX protobufs, each checked with
``onnx.checker`` on load. :func:`load_plan` refuses a plan the given (or installed) onnxruntime
cannot run, with a :class:`PlanError` that says what is wrong and what to do.

Naming convention of the server graphs (the executor hides it; callers see plain names):

* ``zero``:       no inputs -> ``<name>`` for each client-update tensor
* ``accumulate``: ``acc/<name>``, ``upd/<name>`` -> ``<name>``
* ``merge``:      ``a/<name>``, ``b/<name>`` -> ``<name>``
* ``report``:     ``acc/<name>`` -> ``<aggregate name>``
* ``update``:     ``state/<weight>``, ``agg/<aggregate name>`` -> ``<weight>`` and the metrics
* ``prepare``:    ``state/<weight>`` -> ``<weight>`` (the broadcast)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from pydantic_core import from_json

from .errors import OverBudget, RuntimeSdkError
from .shape_fold import fold_shape_values
from .versions import version_tuple

if TYPE_CHECKING:  # example_store is imported lazily at load time
    from example_store import ExampleSelector

PLAN_FORMAT_VERSION = 1
MAGIC = b"FLPLAN\r\n"
_PREFIX = struct.Struct("<8sHIQ")  # magic, format version, header length, total length
_DIGEST_LEN = 32
MAX_HEADER_BYTES = 1 << 20
MAX_PLAN_BYTES = 1 << 31
#: The most bytes one tensor of a plan's graph may take where its size is known before the graph
#: runs (ONNX shape inference over its inputs' and initializers' shapes, the work graph's batch
#: taken at the plan's batch size): no device gives a plan more (the default device class gives
#: 2048 MB). A ConstantOfShape, Expand, Tile, Range or OneHot to 10^12 elements was allocated by
#: onnxruntime when the session was made (constant folding) or at the first step, before any check
#: between steps: on a phone, that ends the app.
MAX_TENSOR_BYTES = 1 << 31
GRAPH_FIELDS = ("work", "prepare", "zero", "accumulate", "merge", "report", "update")
PLAN_KINDS = ("train", "eval")

# Opset and IR version each onnxruntime release loads and runs, as measured on the real wheels by
# `python -m emulator.releases.support` (one row per minor release of 1.x: the latest patch, a probe
# model at every opset and IR version) and shipped as package data in ort_support.json. Read, not
# written here, so a re-measurement changes one file and the tests check the code against it.
ORT_SUPPORT_RESOURCE = "ort_support.json"


def _ort_support_rows(raw: list[dict[str, Any]]) -> tuple[tuple[int, int, int, int], ...]:
    """The record as (first minor, last minor, max opset, max IR version) rows, oldest first.

    Consecutive minors with equal support share a row; a minor with no measurement of its own (a gap
    in the record) takes the row of the nearest older measured one, which by monotonicity is the
    conservative answer. A malformed record fails the import: plans cannot be checked without it.
    """
    measured = sorted((int(r["minor"]), int(r["max_opset"]), int(r["max_ir"])) for r in raw)
    if not measured or len({minor for minor, _, _ in measured}) != len(measured):
        raise ValueError(f"{ORT_SUPPORT_RESOURCE}: expected one row per onnxruntime minor release, got {raw!r}")
    rows: list[list[int]] = []
    for minor, max_opset, max_ir in measured:
        if rows and (max_opset < rows[-1][2] or max_ir < rows[-1][3]):
            raise ValueError(f"{ORT_SUPPORT_RESOURCE}: onnxruntime 1.{minor} supports less than an older release")
        if rows and (rows[-1][2], rows[-1][3]) == (max_opset, max_ir):
            rows[-1][1] = minor
        else:
            if rows:
                rows[-1][1] = minor - 1
            rows.append([minor, minor, max_opset, max_ir])
    return tuple((first, last, opset, ir) for first, last, opset, ir in rows)


def load_ort_support_record() -> list[dict[str, Any]]:
    """The measured record as shipped: one ``{"release", "minor", "max_opset", "max_ir", "measured_on"}``
    per onnxruntime minor release."""
    return json.loads(resources.files(__package__).joinpath(ORT_SUPPORT_RESOURCE).read_text(encoding="utf-8"))


_ORT_SUPPORT: tuple[tuple[int, int, int, int], ...] = _ort_support_rows(load_ort_support_record())
OLDEST_SUPPORTED_RUNTIME = f"1.{_ORT_SUPPORT[0][0]}.0"


class PlanError(RuntimeSdkError, ValueError):
    """A plan is corrupt, inconsistent or cannot run on this runtime; the message says what to do."""


class UpdateMismatchError(PlanError):
    """A client update does not match what the plan's server part expects."""


def _ort_row(version: str) -> tuple[int, int, int, int]:
    try:
        major, minor, _ = version_tuple(version)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if major != 1 or minor < _ORT_SUPPORT[0][0]:
        if major > 1:
            return _ORT_SUPPORT[-1]
        raise PlanError(
            f"onnxruntime {version} is older than the oldest runtime plans support ({OLDEST_SUPPORTED_RUNTIME}); "
            "update the runtime"
        )
    for row in _ORT_SUPPORT:
        if row[0] <= minor <= row[1]:
            return row
    return _ORT_SUPPORT[-1]  # newer than the table: at least what the newest known release runs


def max_opset_for_runtime(version: str) -> int:
    """The highest ONNX (default-domain) opset onnxruntime ``version`` runs, e.g. '1.17.3' -> 20."""
    return _ort_row(version)[2]


def max_ir_version_for_runtime(version: str) -> int:
    """The highest ONNX IR version onnxruntime ``version`` loads, e.g. '1.20.0' -> 10."""
    return _ort_row(version)[3]


def min_runtime_for_opset(opset: int) -> str:
    """The oldest onnxruntime release (from the table) that runs ``opset``."""
    for first, _last, max_opset, _ir in _ORT_SUPPORT:
        if opset <= max_opset:
            return f"1.{first}.0"
    raise PlanError(f"no known onnxruntime release runs opset {opset}; the newest known supports {_ORT_SUPPORT[-1][2]}")


def ir_version_for_opset(opset: int) -> int:
    """The lowest IR version that carries ``opset`` (what plans are written with, for the widest reach)."""
    if opset <= 14:
        return 7
    if opset <= 18:
        return 8
    if opset <= 20:
        return 9
    if opset <= 22:
        return 10
    if opset <= 23:
        return 11
    if opset <= 24:
        return 12
    return 13


def installed_runtime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


@dataclass(frozen=True)
class DeviceConfig:
    """How a device feeds the work graph: which examples, in what batches, how many epochs.

    ``resume`` asks the runtime to continue reading where this device's last completed session of
    the same task and collection stopped (a resumption token kept on the device), or where a later
    one stopped that the app was killed in once its update had started to leave (the server may
    hold that update), so that successive sessions of a selector with a ``limit`` train on
    successive slices of the data."""

    selector: ExampleSelector
    batch_size: int
    epochs: int
    shuffle_seed: int | None
    shuffle_buffer: int
    inputs: dict[str, str]  # work-graph input name -> example tensor name
    resume: bool = False
    #: Work-graph inputs that take class ids -> the number of classes: the device refuses a batch
    #: whose ids fall outside [0, n) (a one-hot loss would otherwise count such an example as
    #: nothing and train on the others without a word).
    class_ids: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ServerPart:
    """MapReduceForm of serialized ONNX models (see the module docstring for the naming convention)."""

    prepare: bytes
    zero: bytes
    accumulate: bytes
    merge: bytes
    report: bytes
    update: bytes
    bitwidth: int | None = None
    secure_sum: tuple[str, ...] = ()
    clip_range: float | None = None  # secure sum: each entry is clipped to [-clip_range, clip_range]


@dataclass(frozen=True)
class PlanMetadata:
    opset: int
    ir_version: int
    min_runtime_version: str
    max_runtime_version: str | None
    memory_budget_mb: int | None = None
    time_budget_s: float | None = None
    # Weights the model itself ties (one tensor several of its modules read, such as tied input and
    # output embeddings): each is one weight in the plan and takes the sum of its uses' gradients.
    shared_weights: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    name: str
    kind: str  # "train" | "eval"
    format_version: int
    device: DeviceConfig
    work: bytes
    weight_names: tuple[str, ...]
    weight_outputs: tuple[str, ...]  # work outputs aligned with weight_names; empty for eval
    metric_names: tuple[str, ...]  # work outputs that are per-batch sums
    server: ServerPart
    metadata: PlanMetadata

    def graphs(self) -> dict[str, bytes]:
        s = self.server
        return {
            "work": self.work,
            "prepare": s.prepare,
            "zero": s.zero,
            "accumulate": s.accumulate,
            "merge": s.merge,
            "report": s.report,
            "update": s.update,
        }


# ----------------------------------------------------------------------------- serialization


def serialize_plan(plan: Plan) -> bytes:
    """The plan as one artifact (see the module docstring); :func:`load_plan` reads it back."""
    graphs = plan.graphs()
    blobs = []
    index = {}
    offset = 0
    for field in GRAPH_FIELDS:
        blob = bytes(graphs[field])
        index[field] = {"offset": offset, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        blobs.append(blob)
        offset += len(blob)
    dev = plan.device
    meta = plan.metadata
    header = {
        "name": plan.name,
        "kind": plan.kind,
        "format_version": plan.format_version,
        "device": {
            "selector": dev.selector.to_dict(),
            "batch_size": dev.batch_size,
            "epochs": dev.epochs,
            "shuffle_seed": dev.shuffle_seed,
            "shuffle_buffer": dev.shuffle_buffer,
            "inputs": dict(dev.inputs),
            # Written only when set, so that plans that do not resume keep their bytes (and ids).
            **({"resume": True} if dev.resume else {}),
            **({"class_ids": dict(dev.class_ids)} if dev.class_ids else {}),
        },
        "weight_names": list(plan.weight_names),
        "weight_outputs": list(plan.weight_outputs),
        "metric_names": list(plan.metric_names),
        "server": {
            "bitwidth": plan.server.bitwidth,
            "secure_sum": list(plan.server.secure_sum),
            "clip_range": plan.server.clip_range,
        },
        "metadata": {
            "opset": meta.opset,
            "ir_version": meta.ir_version,
            "min_runtime_version": meta.min_runtime_version,
            "max_runtime_version": meta.max_runtime_version,
            "memory_budget_mb": meta.memory_budget_mb,
            "time_budget_s": meta.time_budget_s,
            # Written only when set, so that plans without tied weights keep their bytes (and ids).
            **({"shared_weights": list(meta.shared_weights)} if meta.shared_weights else {}),
        },
        "graphs": index,
    }
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = b"".join(blobs)
    total = _PREFIX.size + len(header_bytes) + len(body) + _DIGEST_LEN
    head = _PREFIX.pack(MAGIC, plan.format_version, len(header_bytes), total)
    content = head + header_bytes + body
    return content + hashlib.sha256(content).digest()


def _field(d: Any, key: str, types: type | tuple[type, ...], where: str, *, optional: bool = False) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise PlanError(f"plan header is missing {where}{key}; the plan was not written by serialize_plan")
    value = d[key]
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise PlanError(f"plan header field {where}{key} has the wrong type (bool)")
    if not isinstance(value, types):
        raise PlanError(f"plan header field {where}{key} has the wrong type ({type(value).__name__})")
    return value


def _names(d: Any, key: str, where: str = "") -> tuple[str, ...]:
    values = _field(d, key, list, where)
    if not all(isinstance(v, str) and v for v in values) or len(set(values)) != len(values):
        raise PlanError(f"plan header field {where}{key} must be a list of distinct non-empty names")
    return tuple(values)


def load_plan(data: bytes, *, runtime_version: str | None = None, max_nodes: tuple[int, str] | None = None) -> Plan:
    """Parse and verify a plan; refuses (PlanError) anything corrupt, inconsistent or that
    onnxruntime ``runtime_version`` (default: the installed one) cannot run.

    The [min, max] runtime range the plan claims is enforced only when ``runtime_version`` is
    given (a server loads plans for devices of other versions). ``max_nodes``: the most nodes a
    device takes in the plan's graphs, and why (``nodes_bound``); past it the load stops in
    ``OverBudget`` saying so, before the graphs' checks, which cost in proportion."""
    view = memoryview(data)
    if len(view) < len(MAGIC) or bytes(view[: len(MAGIC)]) != MAGIC:
        raise PlanError("not a plan: the magic bytes are missing (was this written by serialize_plan?)")
    if len(view) < _PREFIX.size + _DIGEST_LEN:
        raise PlanError(f"plan is truncated: {len(view)} bytes is shorter than the fixed prefix; download it again")
    _, format_version, header_len, total = _PREFIX.unpack_from(view, 0)
    if format_version != PLAN_FORMAT_VERSION:
        if format_version > PLAN_FORMAT_VERSION:
            raise PlanError(
                f"plan format version {format_version} is newer than this runtime reads ({PLAN_FORMAT_VERSION}); "
                "update the runtime or publish the plan in format version 1"
            )
        raise PlanError(
            f"plan format version {format_version} is not supported (this runtime reads {PLAN_FORMAT_VERSION})"
        )
    if len(view) < total:
        raise PlanError(f"plan is truncated: {len(view)} of {total} bytes; download it again")
    if len(view) > total:
        raise PlanError(f"plan has {len(view) - total} bytes of trailing data after its declared end; it is corrupt")
    if total > MAX_PLAN_BYTES or header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len + _DIGEST_LEN > total:
        raise PlanError("plan header length is out of range; the plan is corrupt")
    content = view[: total - _DIGEST_LEN]
    if hashlib.sha256(content).digest() != bytes(view[total - _DIGEST_LEN : total]):
        raise PlanError("plan checksum mismatch: the data is corrupt or was altered; download it again")
    try:
        # pydantic-core's parser refuses deep nesting and NaN/Infinity with an error (json.loads
        # recurses until RecursionError on ~1,000 nested brackets)
        header = from_json(bytes(view[_PREFIX.size : _PREFIX.size + header_len]), allow_inf_nan=False)
    except ValueError as exc:
        raise PlanError(f"plan header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PlanError("plan header is not a JSON object")
    body = view[_PREFIX.size + header_len : total - _DIGEST_LEN]
    plan = _plan_from_header(header, body, format_version)
    _check_plan(plan, runtime_version, max_nodes)
    return plan


def _plan_from_header(header: dict, body: memoryview, format_version: int) -> Plan:
    from example_store import ExampleSelector

    if _field(header, "format_version", int, "") != format_version:
        raise PlanError("plan header and prefix disagree on the format version; the plan is corrupt")
    graphs_index = _field(header, "graphs", dict, "")
    blobs: dict[str, bytes] = {}
    end = 0
    for field in GRAPH_FIELDS:
        entry = _field(graphs_index, field, dict, "graphs.")
        offset = _field(entry, "offset", int, f"graphs.{field}.")
        length = _field(entry, "length", int, f"graphs.{field}.")
        digest = _field(entry, "sha256", str, f"graphs.{field}.")
        if offset < 0 or length < 0 or offset + length > len(body):
            raise PlanError(f"graph {field!r} lies outside the plan's data; the plan is corrupt or truncated")
        blob = bytes(body[offset : offset + length])
        if hashlib.sha256(blob).hexdigest() != digest:
            raise PlanError(f"graph {field!r} does not match its sha256; the plan is corrupt")
        blobs[field] = blob
        end = max(end, offset + length)
    if end != len(body):
        raise PlanError("plan data holds bytes that belong to no graph; the plan is corrupt")

    dev = _field(header, "device", dict, "")
    try:
        selector = ExampleSelector.from_dict(_field(dev, "selector", dict, "device."))
    except ValueError as exc:
        raise PlanError(f"plan's example selector is invalid: {exc}") from None
    inputs = _field(dev, "inputs", dict, "device.")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in inputs.items()):
        raise PlanError("plan field device.inputs must map graph input names to example tensor names")
    shuffle_seed = _field(dev, "shuffle_seed", int, "device.", optional=True)
    resume = dev.get("resume", False)  # absent in plans written before the field existed
    if not isinstance(resume, bool):
        raise PlanError(
            f"plan header field device.resume must be true or false, got {resume!r:.60} ({type(resume).__name__}); "
            "rebuild the plan with resume_examples=True or False"
        )
    class_ids = dev.get("class_ids", {})  # absent in plans written before the field existed
    if not isinstance(class_ids, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 1 for k, v in class_ids.items()
    ):
        raise PlanError(
            "plan header field device.class_ids must map graph input names to numbers of classes (>= 1); "
            "the plan is corrupt or was edited"
        )
    device = DeviceConfig(
        selector=selector,
        batch_size=_field(dev, "batch_size", int, "device."),
        epochs=_field(dev, "epochs", int, "device."),
        shuffle_seed=shuffle_seed,
        shuffle_buffer=_field(dev, "shuffle_buffer", int, "device."),
        inputs=dict(inputs),
        resume=resume,
        class_ids=dict(class_ids),
    )
    server = _field(header, "server", dict, "")
    bitwidth = _field(server, "bitwidth", int, "server.", optional=True)
    # absent in plans written before the field existed (as an unclipped plan's null)
    clip_range = (
        _field(server, "clip_range", (int, float), "server.", optional=True) if "clip_range" in server else None
    )
    meta = _field(header, "metadata", dict, "")
    time_budget = _field(meta, "time_budget_s", (int, float), "metadata.", optional=True)
    metadata = PlanMetadata(
        opset=_field(meta, "opset", int, "metadata."),
        ir_version=_field(meta, "ir_version", int, "metadata."),
        min_runtime_version=_field(meta, "min_runtime_version", str, "metadata."),
        max_runtime_version=_field(meta, "max_runtime_version", str, "metadata.", optional=True),
        memory_budget_mb=_field(meta, "memory_budget_mb", int, "metadata.", optional=True),
        time_budget_s=None if time_budget is None else float(time_budget),
        # absent in plans written before the field existed, and in plans without tied weights
        shared_weights=_names(meta, "shared_weights", "metadata.") if "shared_weights" in meta else (),
    )
    return Plan(
        name=_field(header, "name", str, ""),
        kind=_field(header, "kind", str, ""),
        format_version=format_version,
        device=device,
        work=blobs["work"],
        weight_names=_names(header, "weight_names"),
        weight_outputs=_names(header, "weight_outputs"),
        metric_names=_names(header, "metric_names"),
        server=ServerPart(
            prepare=blobs["prepare"],
            zero=blobs["zero"],
            accumulate=blobs["accumulate"],
            merge=blobs["merge"],
            report=blobs["report"],
            update=blobs["update"],
            bitwidth=bitwidth,
            secure_sum=_names(server, "secure_sum", "server."),
            clip_range=None if clip_range is None else float(clip_range),
        ),
        metadata=metadata,
    )


#: The largest value an ONNX dimension (an int64) holds: a plan's batch size is its inputs' first dim.
MAX_DIM = 2**63 - 1
#: Standard ONNX operators a plan may not use, and why: one node's run, which a forced stop
#: (``RunOptions.terminate``, checked between nodes) does not reach, takes a time that neither
#: the sizes the device bounds nor the plan's time budget bound. No training plan the toolchain
#: builds holds them (``emulator/toolchain/OP_COVERAGE.md``).
UNSTOPPABLE_OPS = {
    "NonMaxSuppression": (
        "whose one run takes the square of its boxes' count, where no forced stop reaches (16,000 boxes "
        "took 0.6 s, 4 million of 64 MB some 10 hours); plans may not use it"
    ),
    "RoiAlign": (
        "whose one run takes the square of its sampling ratio for each output, a count set by an attribute "
        "or the regions' sizes, where no forced stop reaches (a ratio of 1,000 took 0.1 s for one output "
        "value, 100,000 some 16 minutes); plans may not use it"
    ),
}


def _check_plan(plan: Plan, runtime_version: str | None, max_nodes: tuple[int, str] | None = None) -> None:
    import onnx

    if plan.kind not in PLAN_KINDS:
        raise PlanError(f"plan kind {plan.kind!r} is unknown; it must be one of {PLAN_KINDS}")
    dev = plan.device
    if dev.batch_size < 1 or dev.epochs < 1 or dev.shuffle_buffer < 0:
        raise PlanError("plan's batch_size and epochs must be >= 1 and shuffle_buffer >= 0")
    if dev.batch_size > MAX_DIM:
        raise PlanError(f"plan's batch_size {dev.batch_size:,} is past what an ONNX dimension holds ({MAX_DIM:,})")
    if dev.shuffle_seed is not None and dev.shuffle_seed < 0:
        raise PlanError(f"plan's shuffle_seed must be >= 0 or null, got {dev.shuffle_seed}")
    if dev.selector.resume_after is not None:
        raise PlanError(
            "plan's example selector names a resumption token (resume_after); a device keeps its own "
            "(device.resume), a plan carries none"
        )
    both = sorted(set(plan.weight_outputs) & set(plan.metric_names))
    if both:
        raise PlanError(
            f"plan's output {both[0]!r} is both a weight output and a metric; the plan is corrupt or was edited"
        )
    weights_fed = sorted(set(dev.inputs) & set(plan.weight_names))
    if weights_fed:
        raise PlanError(
            f"plan's device.inputs feeds examples to its weight {weights_fed[0]!r}; the plan is corrupt or was edited"
        )
    if plan.kind == "train" and len(plan.weight_outputs) != len(plan.weight_names):
        raise PlanError("a training plan needs one weight output per weight name")
    if plan.kind == "eval" and plan.weight_outputs:
        raise PlanError("an evaluation plan has no weight outputs")
    not_fed = [name for name in dev.class_ids if name not in dev.inputs]
    if not_fed:
        raise PlanError(
            f"plan's device.class_ids names {not_fed[0]!r}, which is not one of its inputs; the plan is corrupt "
            "or was edited"
        )
    unknown = [w for w in plan.metadata.shared_weights if w not in plan.weight_names]
    if unknown:
        raise PlanError(
            f"plan's metadata.shared_weights names {unknown[0]!r}, which is not one of its weights; the plan is "
            "corrupt or was edited"
        )
    server = plan.server
    if server.secure_sum:
        if server.bitwidth is None or not 1 <= server.bitwidth <= 52:
            raise PlanError("a plan with secure-sum outputs needs a bitwidth in [1, 52]")
        if server.clip_range is None or not (math.isfinite(server.clip_range) and server.clip_range > 0):
            raise PlanError("a plan with secure-sum outputs needs a positive clip_range")
    meta = plan.metadata
    if meta.time_budget_s is not None and not (math.isfinite(meta.time_budget_s) and meta.time_budget_s > 0):
        raise PlanError("plan's time budget must be a positive number of seconds")
    try:
        low = version_tuple(meta.min_runtime_version)
        high = None if meta.max_runtime_version is None else version_tuple(meta.max_runtime_version)
    except ValueError as exc:
        raise PlanError(f"plan's runtime version range is invalid: {exc}") from None
    target = runtime_version if runtime_version is not None else installed_runtime_version()
    if runtime_version is not None:
        have = version_tuple(runtime_version) if _is_version(runtime_version) else None
        if have is None:
            raise PlanError(f"runtime version {runtime_version!r} is not a version like '1.31.1'")
        if have < low or (high is not None and have > high):
            raise PlanError(
                f"plan {plan.name!r} supports runtimes {meta.min_runtime_version} to "
                f"{meta.max_runtime_version or 'any newer'}, not {runtime_version}; "
                "publish a plan version for this runtime or update the device"
            )
    max_opset = max_opset_for_runtime(target)
    max_ir = max_ir_version_for_runtime(target)
    if meta.opset > max_opset:
        raise PlanError(
            f"plan opset {meta.opset} is above what onnxruntime {target} runs (at most opset {max_opset}); "
            f"rebuild the plan with opset <= {max_opset} or use onnxruntime >= {_safe_min_runtime(meta.opset)}"
        )
    if meta.ir_version > max_ir:
        raise PlanError(
            f"plan IR version {meta.ir_version} is above what onnxruntime {target} loads (at most IR {max_ir}); "
            "rebuild the plan with an explicit lower ir_version"
        )
    nodes = 0
    for field, blob in plan.graphs().items():
        try:
            model = onnx.ModelProto.FromString(blob)
        except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
            raise PlanError(f"graph {field!r} is not an ONNX model ({exc}); the plan is corrupt") from None
        nodes += sum(len(graph.node) for graph in _subgraphs(model.graph))
        if max_nodes is not None and nodes > max_nodes[0]:
            raise OverBudget(f"plan {plan.name!r} holds more than {max_nodes[0]:,} nodes in its graphs: {max_nodes[1]}")
        outside = next((t.name for t in _tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL), None)
        if outside is not None:
            raise PlanError(
                f"graph {field!r} keeps tensor {outside[:100]!r} in an external file; a plan carries all its data "
                "(a path in it names a file of the device, which the ONNX checker would look for)"
            )
        # What follows reads the graph, not its weights: the model without them (``_without_weights``),
        # and the checker the bytes as they are (given the model, it serialized it again).
        model = _without_weights(model)
        try:
            onnx.checker.check_model(blob)
        except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError and others
            raise PlanError(
                f"graph {field!r} fails the ONNX checker: {str(exc).splitlines()[0] if str(exc) else exc}"
            ) from None
        unreadable = _unreadable_tensor(model)
        if unreadable is not None:
            raise PlanError(
                f"graph {field!r} holds tensor {unreadable[0][:100]!r}, whose data does not fit its type and shape "
                f"({unreadable[1][:100]}); the plan is corrupt"
            )
        if model.ir_version > max_ir or model.ir_version > meta.ir_version:
            raise PlanError(
                f"graph {field!r} has IR version {model.ir_version}, above the plan's {meta.ir_version} "
                f"or what onnxruntime {target} loads ({max_ir})"
            )
        for opset in model.opset_import:
            if opset.domain not in ("", "ai.onnx"):
                raise PlanError(
                    f"graph {field!r} uses operator domain {opset.domain!r}; plans may use only standard ONNX ops"
                )
            if opset.version > meta.opset or opset.version > max_opset:
                raise PlanError(
                    f"graph {field!r} imports opset {opset.version}, above the plan's opset {meta.opset} "
                    f"or what onnxruntime {target} runs ({max_opset})"
                )
        for graph in _subgraphs(model.graph):
            for node in graph.node:
                if node.op_type in UNSTOPPABLE_OPS:
                    raise PlanError(f"graph {field!r} uses {node.op_type}, {UNSTOPPABLE_OPS[node.op_type]}")
                overlap = _pool_overlap(node)
                if overlap is not None and overlap[0] > MAX_POOL_OVERLAP:
                    raise PlanError(
                        f"graph {field!r} uses a {node.op_type} of window {overlap[1]}, which reads each input "
                        f"value about {overlap[0]:,.0f} times in one node, where no forced stop reaches (a 512 x 512 "
                        f"window over 1 MB took 75 s); a device takes at most {MAX_POOL_OVERLAP:,}"
                    )
        _check_graph_names(plan, field, model)
        _check_tensor_types(field, model)
        largest = _largest_of(blob, plan.device if field == "work" else None, model=model)
        if largest is not None and largest[1] > MAX_TENSOR_BYTES:
            raise PlanError(
                f"graph {field!r} makes tensor {largest[0][:100]!r} of {largest[1]:,} bytes before it has run a step, "
                f"more than the {MAX_TENSOR_BYTES:,} a device gives one tensor"
            )
        if field == "work":
            _remember_largest(plan, largest)
    _NODES[id(plan)] = nodes
    weakref.finalize(plan, _NODES.pop, id(plan), None)


#: What one node of a plan's graphs takes on a device at the peak, about: checking the plan as it
#: loads (shape inference and the values folded from shapes) took 2.8 KB a node, then onnxruntime's
#: session of the work graph held 2.6 KB a node. 300,000 ``Add`` nodes are an 8 MB plan,
#: which took 842 MB and 29 s to load, then 781 MB and 59 s to make its session: an eighth of its
#: memory, what a 2 GB device downloads, holds ten million such nodes.
NODE_BYTES = 3 << 10
#: A plan's nodes take at most this share of a device's memory, ``NODE_BYTES`` each.
NODES_SHARE = 4
#: The nodes of each loaded plan's graphs, by the plan's id() while it lives (``plan_nodes``).
_NODES: dict[int, int] = {}


def nodes_bound(memory_mb: float, device: str) -> tuple[int, str]:
    """The most nodes a device of ``memory_mb`` takes in a plan's graphs, and why (``load_plan``'s
    ``max_nodes``)."""
    most = int(memory_mb * (1 << 20)) // (NODES_SHARE * NODE_BYTES)
    return most, (
        f"a {device} device of {memory_mb:g} MB takes at most {most:,} (1/{NODES_SHARE} of its memory, at about "
        f"{NODE_BYTES >> 10} KB a node to check and to run)"
    )


def plan_nodes(plan: Plan) -> int:
    """The nodes of ``plan``'s graphs, their subgraphs' (Loop, If and Scan bodies) included."""
    found = _NODES.get(id(plan))
    if found is None:
        import onnx

        found = sum(
            len(graph.node)
            for blob in plan.graphs().values()
            for graph in _subgraphs(onnx.ModelProto.FromString(blob).graph)
        )
    return found


#: The largest tensor of each loaded plan's work graph (``largest_work_tensor``), by the plan's id()
#: while it lives: plans hold dicts, so they cannot be keys themselves.
_LARGEST_WORK: dict[int, tuple[str, int] | None] = {}


def _remember_largest(plan: Plan, largest: tuple[str, int] | None) -> None:
    if id(plan) not in _LARGEST_WORK:
        _LARGEST_WORK[id(plan)] = largest
        weakref.finalize(plan, _LARGEST_WORK.pop, id(plan), None)


#: The largest tensor of each loaded plan's work graph at the input shapes a step is given
#: (``largest_work_tensor_at``), by the plan's id() and those shapes, while it lives.
_LARGEST_AT: dict[int, dict[tuple, tuple[str, int] | None]] = {}
#: The most input shapes remembered per plan: a device's batches come in one or two (the last may
#: be smaller), a fleet's devices in up to the batch size.
MAX_SHAPES_REMEMBERED = 256


def largest_work_tensor_at(plan: Plan, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int] | None:
    """The largest tensor the plan's work graph makes when its inputs have ``shapes`` (graph
    input name to dims: a batch's), as (name, bytes), where its size is known before the step
    runs: from the shapes, and the values the graph computes from them (``shape_fold``). Found
    once per plan and shapes."""
    key = tuple(sorted((name, tuple(int(d) for d in dims)) for name, dims in shapes.items()))
    found = _LARGEST_AT.get(id(plan))
    if found is not None and key in found:
        return found[key]
    largest = _largest_of(plan.work, plan.device, dict(key))
    if found is None:
        found = _LARGEST_AT[id(plan)] = {}
        weakref.finalize(plan, _LARGEST_AT.pop, id(plan), None)
    if len(found) >= MAX_SHAPES_REMEMBERED:
        found.pop(next(iter(found)), None)  # the oldest remembered
    found[key] = largest
    return largest


def largest_work_tensor(plan: Plan) -> tuple[str, int] | None:
    """The largest tensor the plan's work graph makes whose size is known before it runs, as (name,
    bytes) (see ``MAX_TENSOR_BYTES``): what a device compares with the memory it gives. Found once
    per plan, when it loads."""
    if id(plan) not in _LARGEST_WORK:
        _remember_largest(plan, _largest_of(plan.work, plan.device))
    return _LARGEST_WORK[id(plan)]


#: ``_largest_tensor`` of each graph's bytes (by their digest), the batch size and fed inputs its
#: work graph is pinned at, and a step's shapes: a fleet's devices each load the same plan's bytes
#: into a Plan of their own, and inference and folding (milliseconds a graph) give the same answer.
_LARGEST_BY_CONTENT: dict[tuple, tuple[str, int] | None] = {}
#: The most graphs and shapes remembered by content; the oldest is forgotten first.
MAX_CONTENT_REMEMBERED = 256


def _largest_of(
    blob: bytes,
    device: DeviceConfig | None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    model: Any = None,
) -> tuple[str, int] | None:
    """``_largest_tensor`` of the graph serialized as ``blob`` (``model`` when parsed already),
    found once per graph bytes, device batch and inputs, and shapes."""
    pinned_at = None if device is None else (device.batch_size, tuple(sorted(device.inputs)))
    key = (hashlib.sha256(blob).digest(), pinned_at, None if shapes is None else tuple(sorted(shapes.items())))
    if key in _LARGEST_BY_CONTENT:
        return _LARGEST_BY_CONTENT[key]
    if model is None:
        import onnx

        model = _without_weights(onnx.ModelProto.FromString(blob))
    largest = _largest_tensor(model, device, shapes)
    if len(_LARGEST_BY_CONTENT) >= MAX_CONTENT_REMEMBERED:
        _LARGEST_BY_CONTENT.pop(next(iter(_LARGEST_BY_CONTENT)), None)  # the oldest remembered
    _LARGEST_BY_CONTENT[key] = largest
    return largest


#: How many times the values computed from the work graph's shapes are folded and its shapes
#: inferred again (a value folded can make another tensor's shape, and so another value, known).
FOLD_ROUNDS = 3


def _largest_tensor(
    model: Any, device: DeviceConfig | None, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[str, int] | None:
    """The largest tensor ``model`` makes whose size ONNX shape inference knows before it runs, as
    (name, bytes), with a dim it cannot tell (symbolic, or known only from the examples' data)
    counted as 1: a size found is one the tensor has at least. For the work graph (``device``
    given), the first dim of each input the device feeds is its batch, taken at the plan's batch
    size, or each input has the dims ``shapes`` gives it (a step's); the values the graph computes
    from its tensors' shapes (``Shape(x) * 10^5``) are computed and folded in as constants
    (``shape_fold``), so a tensor sized from them is sized too.

    Shape inference runs without data propagation: onnx's propagation of a Range over constants
    materializes the range (10^12 elements took the process's memory); inference alone reads the
    constants' values where a shape needs them (ConstantOfShape, Expand, Tile, Range, Pad...)."""
    import onnx

    if device is not None:
        model = _pinned(model, device, shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - onnx's InferenceError and others: the declared shapes only
        inferred = model
    for _ in range(FOLD_ROUNDS if device is not None else 0):
        model, folded = fold_shape_values(model, _known_shapes(inferred))
        if not folded:
            break
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 - as above: what was inferred before
            break
    largest: tuple[str, int] | None = None
    for graph in _subgraphs(inferred.graph):
        for value in (*graph.value_info, *graph.output):
            size = _tensor_bytes(value.type)
            if size is not None and (largest is None or size > largest[1]):
                largest = (value.name, size)
        for sparse in graph.sparse_initializer:  # onnxruntime makes each dense when it makes the session
            size = _dense_bytes(sparse.dims, sparse.values.data_type)
            if largest is None or size > largest[1]:
                largest = (sparse.values.name, size)
    return largest


#: Operators whose ONNX shape inference reads only the shapes of their inputs, never their values.
_SHAPE_ONLY_OPS = frozenset(
    "Abs Add And BatchNormalization Cast Concat Conv ConvTranspose Cos Div Dropout Einsum Elu Equal Erf Exp "
    "Flatten Gather GatherElements Gelu Gemm Greater GreaterOrEqual HardSigmoid Identity InstanceNormalization "
    "LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax MatMul Max Mean Min Mul Neg Not Or PRelu Pow "
    "Reciprocal Relu Sigmoid Sign Sin Softmax Softplus Sqrt Sub Sum Tanh Transpose Where Xor".split()
)
#: Initializers of at most this many elements keep their values in ``_without_weights``.
_KEPT_ELEMENTS = 1024
_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _without_weights(model: Any) -> Any:
    """``model`` (consumed) as a model of its own without the values of its large initializers
    (more than ``_KEPT_ELEMENTS`` elements), which only ops that read their shape take
    (``_SHAPE_ONLY_OPS``, in the top-level graph): all that the checks of a plan and shape
    inference read. A device loading a plan held each graph's weights some eight times over (the
    model parsed, serialized again for the checker, copied, serialized and parsed again for shape
    inference): a 200 MB plan took 1.6 GB above its bytes."""
    graph = model.graph
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type if node.domain in ("", "ai.onnx") else "")
    from_subgraph = {name for sub in list(_subgraphs(graph))[1:] for node in sub.node for name in node.input}
    emptied = 0
    for tensor in graph.initializer:
        if (
            _elements_of(tensor) > _KEPT_ELEMENTS
            and tensor.name not in from_subgraph
            and readers.get(tensor.name, set()) <= _SHAPE_ONLY_OPS
        ):
            for data in _DATA_FIELDS:
                tensor.ClearField(data)
            emptied += 1
    if not emptied:
        return model
    return type(model).FromString(model.SerializeToString())  # the weights go with ``model``'s memory


def _elements_of(tensor: Any) -> int:
    n = 1
    for d in tensor.dims:
        n *= max(int(d), 0)
    return n


def _pinned(model: Any, device: DeviceConfig, shapes: Mapping[str, tuple[int, ...]] | None = None) -> Any:
    """A copy of the work graph whose inputs in ``shapes`` have those dims, or without ``shapes``
    whose fed inputs' first dim, where symbolic, is the batch size."""
    import onnx

    pinned = onnx.ModelProto()
    pinned.CopyFrom(model)
    for value in pinned.graph.input:
        dims = value.type.tensor_type.shape.dim
        if shapes is not None:
            if value.name in shapes and len(dims) == len(shapes[value.name]):
                for dim, size in zip(dims, shapes[value.name], strict=True):
                    dim.dim_value = size
        elif value.name in device.inputs and len(dims) > 0 and not dims[0].HasField("dim_value"):
            dims[0].dim_value = device.batch_size
    return pinned


def _known_shapes(model: Any) -> dict[str, tuple[int | None, ...]]:
    """Every tensor of ``model``'s graph whose rank is known, by name: its dims, None where unknown."""
    graph = model.graph
    out: dict[str, tuple[int | None, ...]] = {t.name: tuple(int(d) for d in t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            out[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return out


#: The most times a pooling node (``MaxPool``, ``AveragePool``, ``LpPool``) may read each value of its
#: input: its window's size over its strides' product (3 x 3 at stride 1 reads each 9 times, a
#: window that tiles its input once). Its run is one node, which a forced stop does not reach.
MAX_POOL_OVERLAP = 4096
_POOLS = frozenset(("MaxPool", "AveragePool", "LpPool"))


def _pool_overlap(node: Any) -> tuple[float, str] | None:
    """How many times the pooling ``node`` reads each input value, about, and its window as said
    (``512 x 512 at strides 1 x 1``); None for another node."""
    if node.op_type not in _POOLS or node.domain not in ("", "ai.onnx"):
        return None
    ints = {a.name: list(a.ints) for a in node.attribute if a.name in ("kernel_shape", "strides")}
    kernel = ints.get("kernel_shape", [])
    strides = ints.get("strides") or [1] * len(kernel)
    overlap = 1.0
    for k, s in zip(kernel, strides, strict=False):
        overlap *= max(k, 1) / max(s, 1)
    shown = " x ".join(map(str, kernel)) + " at strides " + " x ".join(map(str, strides))
    return overlap, shown


def _subgraphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every graph in its nodes' attributes (Loop, If and Scan bodies), depth first."""
    import onnx

    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _subgraphs(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _subgraphs(sub)


def _tensor_bytes(kind: Any) -> int | None:
    """The bytes a tensor of this type takes at least (its known dims), or None when not a tensor."""
    import onnx

    if not kind.HasField("tensor_type") or not kind.tensor_type.HasField("shape"):
        return None
    tensor = kind.tensor_type
    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    except (KeyError, ValueError, TypeError):
        item = 1
    size = item
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            size *= dim.dim_value
    return size


def _dense_bytes(dims: Any, elem_type: int) -> int:
    """The bytes a tensor of ``dims`` and ONNX element type ``elem_type`` takes dense. A sparse
    initializer of one value declared 20,000 x 20,000 is a few bytes of a plan that onnxruntime
    made into 1.6 GB (3.2 GB at its peak) when it made the session, before any check between steps."""
    import onnx

    try:
        item = onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize
    except (KeyError, ValueError, TypeError):
        item = 1
    return item * math.prod(max(int(d), 0) for d in dims)


def _tensors(model: Any) -> Iterator[Any]:
    """Every tensor a model holds: initializers (sparse ones' values and indices) and tensor
    attributes, in its graph, its subgraphs (Loop, If, Scan bodies) and its functions."""
    import onnx

    def in_attributes(attributes: Any) -> Iterator[Any]:
        for a in attributes:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
            elif a.type == onnx.AttributeProto.TENSORS:
                yield from a.tensors
            elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield from (a.sparse_tensor.values, a.sparse_tensor.indices)
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from in_graph(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from in_graph(g)

    def in_graph(graph: Any) -> Iterator[Any]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        for node in graph.node:
            yield from in_attributes(node.attribute)

    yield from in_graph(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from in_attributes(node.attribute)


def _unreadable_tensor(model: Any) -> tuple[str, str] | None:
    """The first small tensor of ``model`` (at most ``_KEPT_ELEMENTS`` elements: the values that
    checks and shape folding read) whose data cannot be read as its type and shape, and why. The
    ONNX checker refuses data too short for its shape, not data too long or kept in segments,
    which onnxruntime refuses too: reading such a shape vector raised numpy's ``ValueError`` out of
    the plan's load, an error that was not the SDK's."""
    from onnx import numpy_helper

    for tensor in _tensors(model):
        if _elements_of(tensor) <= _KEPT_ELEMENTS or tensor.HasField("segment"):
            try:
                numpy_helper.to_array(tensor)
            except Exception as exc:  # noqa: BLE001 - numpy's and onnx's ValueError, TypeError, ...
                return tensor.name, str(exc) or type(exc).__name__
    return None


def _safe_min_runtime(opset: int) -> str:
    try:
        return min_runtime_for_opset(opset)
    except PlanError:
        return "a newer release"


def _is_version(v: str) -> bool:
    try:
        version_tuple(v)
        return True
    except ValueError:
        return False


def _check_tensor_types(field: str, model: Any) -> None:
    """Refuse a graph whose inputs or outputs are not tensors of a type numpy holds (a sequence, an
    optional, a map, an undefined type): a device reads its inputs' shapes and dtypes to feed it."""
    import onnx

    for value in (*model.graph.input, *model.graph.output):
        kind = value.type.WhichOneof("value")
        if kind == "tensor_type":
            try:
                onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
                continue
            except (KeyError, ValueError, TypeError):
                kind = f"tensor of element type {value.type.tensor_type.elem_type}"
        raise PlanError(
            f"graph {field!r} takes or gives {value.name[:100]!r} as a {kind or 'value of no type'}; "
            "a plan's graphs take and give tensors"
        )


def _check_graph_names(plan: Plan, field: str, model: Any) -> None:
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    if field == "work":
        needed_in = set(plan.weight_names) | set(plan.device.inputs)
        needed_out = set(plan.weight_outputs) | set(plan.metric_names)
    elif field == "prepare":
        needed_in = {f"state/{w}" for w in plan.weight_names}
        needed_out = set(plan.weight_names)
    elif field == "update":
        needed_in = {f"state/{w}" for w in plan.weight_names}
        needed_out = set(plan.weight_names)
    else:
        return
    missing_in = sorted(needed_in - inputs)
    missing_out = sorted(needed_out - outputs)
    if missing_in or missing_out:
        raise PlanError(
            f"graph {field!r} does not match the plan: missing inputs {missing_in}, missing outputs {missing_out}"
        )
