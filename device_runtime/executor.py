"""The plan executor on onnxruntime: the device side runs the plan's ``work`` graph over the
device's batches (made by ``batching``); the server side runs its MapReduceForm part
(``server_ops``: ``zero``, ``accumulate``, ``merge``, ``report``, ``update``, ``prepare``); a deploy
runs the whole plan once (``smoke_test``).

The client update of a training plan (what :meth:`PlanExecutor.run_device` returns and the server
accumulates), all float32:

* ``<weight>``: (w_final - w_initial) * n, where n is the number of examples per epoch;
* ``<metric>`` (``loss_sum``, ``correct``, ``count``): the sum over all batches of all epochs,
  divided by the number of epochs (so ``count == n``; the loss is that of the pre-step weights of
  each batch, averaged over the epochs);
* ``num_examples``: n.

An evaluation plan's update holds only the metric sums and ``num_examples``.

Performance: the training loop binds inputs and outputs with ``IOBinding`` and keeps the weights
in two sets of OrtValues that swap roles each step (ping-pong), so a step copies nothing but the
batch pointers and three scalars.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from .batching import SHUFFLE_MAX_BYTES, batches_from_examples
from .plan import Plan, PlanError, UpdateMismatchError
from .server_ops import ServerOps, f32

NUM_EXAMPLES = "num_examples"
_SERVER_GRAPHS = ("prepare", "zero", "accumulate", "merge", "report", "update")
_T = TypeVar("_T")


class TrainingInterrupted(Exception):
    """``should_abort()`` returned True between batches; the partial result was discarded.
    ``reason``, where the one who stopped it knows why, is what the session records."""

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DeviceResult:
    update: dict[str, np.ndarray]
    metrics: dict[str, float]
    num_examples: int


#: onnxruntime's optimizers a session runs without: constant folding computes a graph's constant
#: subgraphs when the session is made, where a forced stop (``RunOptions.terminate``) does not
#: reach; a plan's chain of products of constant 2,000 x 2,000 matrices kept a device past its
#: training time for as long as they took, and the Loop the dynamo exporter writes for
#: nn.EmbeddingBag ended the process in a segmentation fault (onnxruntime 1.32). A plan's graphs
#: read their weights as inputs, so an honest plan has little to fold.
DISABLED_OPTIMIZERS = ("ConstantFolding",)


def make_session(model_bytes: bytes, *, optimized_to: str | None = None) -> ort.InferenceSession:
    """One onnxruntime session on the CPU provider with one thread, no spinning, sequential, and
    none of ``DISABLED_OPTIMIZERS``; ``optimized_to`` names a file where onnxruntime writes the
    graph it runs (a look at what it made of a plan)."""
    opts = ort.SessionOptions()
    if optimized_to is not None:
        opts.optimized_model_filepath = optimized_to
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    # fatal only: a step that fails raises with onnxruntime's message, which the runtime records; its
    # log's copy on stderr repeated each failed session's error, thousands of lines in a fleet
    opts.log_severity_level = 4
    return ort.InferenceSession(
        model_bytes,
        sess_options=opts,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(DISABLED_OPTIMIZERS),
    )


def stoppable_run_options() -> ort.RunOptions:
    """Options for a run that another thread may stop by force (``terminate``). They name no graph
    to capture (``gpu_graph_id`` -1): onnxruntime 1.32's Python binding reads that entry before
    every run, and when it is missing the lookup raises and catches a C++ exception, about 90 us a
    step (a fifth of a small plan's step). Other releases and the CPU provider ignore the entry."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options


def _io_specs(model_bytes: bytes) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(inputs, outputs) of a model: name -> (shape with None for symbolic dims, numpy dtype)."""
    return _specs(onnx.ModelProto.FromString(model_bytes))


#: Ops that pass an integer input's values on unchanged (their first input), in another shape or type:
#: every value, so that each is checked as an id. Not ``Slice``: the columns it drops may be no ids at
#: all (a count beside the tokens), and refusing them refused an honest model's examples.
_PASSING_IDS = frozenset({"Identity", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Expand"})


def lookup_tables(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """The graph's integer inputs that index a table's rows (an embedding's token ids) -> the
    table with the fewest rows they index, and its rows: each input whose values reach the indices
    of a ``Gather`` unchanged, on a tensor whose gathered axis has a static size. ONNX's Gather
    reads -1 as the last row, where torch's embedding refuses it: a padding id of -1 would silently
    train the table's last row."""
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    producers = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
        for name in node.output:
            producers[name] = node
    dims = {
        v.name: tuple(d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim)
        for v in [*graph.input, *graph.value_info]
    }
    dims.update((t.name, tuple(t.dims)) for t in graph.initializer)
    tables: dict[str, tuple[str, int]] = {}
    for value in graph.input:
        if value.type.tensor_type.elem_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            continue
        seen, todo = set(), [value.name]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for node, i in consumers.get(name, ()):
                if node.op_type in _PASSING_IDS and i == 0:
                    todo.extend(node.output)
                elif node.op_type == "Gather" and i == 1:
                    table = node.input[0]
                    while table not in dims and table in producers and producers[table].op_type == "Identity":
                        table = producers[table].input[0]
                    shape = dims.get(table, ())
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    rows = shape[axis] if -len(shape) <= axis < len(shape) else 0
                    if rows > 0 and rows < tables.get(value.name, ("", rows + 1))[1]:
                        tables[value.name] = (node.input[0], int(rows))
    return tables


def _specs(model: onnx.ModelProto) -> tuple[dict[str, tuple], dict[str, tuple]]:
    def spec(values) -> dict[str, tuple]:
        out = {}
        for v in values:
            tt = v.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            out[v.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        return out

    return spec(model.graph.input), spec(model.graph.output)


class PlanExecutor(ServerOps):
    """Runs one plan. Sessions are created lazily (a device only ever creates ``work``); one
    executor may be shared by threads (session creation is locked; onnxruntime's ``run`` is
    thread-safe)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._io: dict[str, tuple[list[tuple[str, bool, list]], list[str]]] = {}
        self._lock = threading.Lock()
        self._work_io: tuple[dict, dict] | None = None
        self._lookups: dict[str, int] = {}  # see lookup_tables: read with _work_io
        self._update_spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._free_workspaces: list[_Workspace] = []

    # ------------------------------------------------------------------ sessions and specs

    def _session(self, which: str) -> ort.InferenceSession:
        sess = self._sessions.get(which)
        if sess is None:
            with self._lock:
                sess = self._sessions.get(which)
                if sess is None:
                    try:
                        sess = make_session(self.plan.graphs()[which])
                    except Exception as exc:  # noqa: BLE001 - onnxruntime's own classes (Fail, InvalidGraph, ...)
                        raise _NotLoaded(which, exc) from None
                    self._sessions[which] = sess
        return sess

    def _work_specs(self) -> tuple[dict, dict]:
        if self._work_io is None:
            model = onnx.ModelProto.FromString(self.plan.work)
            self._lookups = {name: rows for name, (_, rows) in lookup_tables(model.graph).items()}
            self._work_io = _specs(model)
        return self._work_io

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The model's weights: name -> (shape, dtype), from the work graph's inputs."""
        inputs, _ = self._work_specs()
        return {w: (tuple(inputs[w][0]), np.dtype(inputs[w][1])) for w in self.plan.weight_names}

    def example_bytes(self) -> int:
        """The bytes one example takes at least as the work graph is fed it: each fed input's dims
        after the batch's, a dim the graph leaves open counted as 1, times its dtype's size."""
        inputs, _ = self._work_specs()
        total = 0
        for graph_name in dict.fromkeys(self.plan.device.inputs):
            shape, dtype = inputs.get(graph_name, ((), np.float32))
            # Python ints: a hostile graph's dims of 10^10 x 10^10 would wrap around in int64
            total += math.prod(1 if d is None else max(d, 0) for d in shape[1:]) * np.dtype(dtype).itemsize
        return total

    def client_update_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """What a valid client update holds: name -> (shape, dtype), read from the ``accumulate``
        graph's ``upd/`` inputs (the contract the server part actually runs)."""
        if self._update_spec is None:
            inputs, _ = _io_specs(self.plan.server.accumulate)
            spec = {}
            for name, (shape, dtype) in inputs.items():
                if name.startswith("upd/"):
                    if any(d is None for d in shape):
                        raise PlanError(
                            f"the accumulate graph's input {name!r} has a dynamic shape; updates need static shapes"
                        )
                    spec[name[4:]] = (tuple(shape), np.dtype(dtype))
            self._update_spec = spec
        return dict(self._update_spec)

    # ------------------------------------------------------------------ device side

    def check_weights(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The plan's weights from ``weights`` as float32; raises PlanError naming a missing one or
        a wrong shape (a checkpoint that is not this plan's)."""
        spec = self.weight_spec()
        missing = sorted(set(spec) - set(weights))
        if missing:
            raise PlanError(f"weights {missing} are missing; the plan needs {sorted(spec)}")
        out = {}
        with np.errstate(over="ignore"):  # a float64 past float32's range is infinite: the caller's to refuse
            for name, (shape, _dtype) in spec.items():
                arr = f32(weights[name])
                if arr.shape != shape:
                    raise PlanError(f"weight {name!r} has shape {arr.shape}, the plan needs {shape}")
                out[name] = arr
        return out

    @functools.cached_property
    def _builder_labels(self) -> str | None:
        """``y`` where it holds the class ids of a plan that records none in ``class_ids``
        (``plan_builder``'s plans, and plans written before the field existed): the integer input
        ``y`` of a plan without ``class_ids`` whose inputs are the builder's ``x`` and ``y``. A
        model's input named ``y`` beside the toolchain's own label input (``label``, which
        ``class_ids`` names for cross-entropy and nothing names for mse or binary cross-entropy) is
        a feature like any other."""
        inputs, _ = self._work_specs()
        if self.plan.device.class_ids or set(self.plan.device.inputs) != {"x", "y"} or "y" not in inputs:
            return None
        return "y" if np.dtype(inputs["y"][1]).kind in "iu" else None

    def _feeds(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        feeds = {}
        inputs, _ = self._work_specs()
        labels = self._builder_labels
        n = None
        for graph_name, example_name in self.plan.device.inputs.items():
            if example_name not in batch:
                raise PlanError(
                    f"batch has no tensor {example_name!r} (keys {sorted(batch)}); the plan feeds it to {graph_name!r}"
                )
            expected, dtype = inputs[graph_name]
            raw = batch[example_name]
            arr = _as_fed(example_name, raw, dtype)
            if arr.dtype.kind in "iu" and not _held_exactly(raw, arr):
                if graph_name in self.plan.device.class_ids or graph_name == labels:
                    classes = self.plan.device.class_ids.get(graph_name) or self._num_classes()
                    raise PlanError(
                        f"example tensor {example_name!r} holds fractions, but the plan reads class ids (whole numbers "
                        f"0 to {classes - 1}); store the labels as integers ({_first_changed(raw, arr)})"
                    )
                limits = np.iinfo(arr.dtype)
                raise PlanError(
                    f"example tensor {example_name!r} holds values that the plan's {arr.dtype} input {graph_name!r} "
                    f"cannot hold exactly ({_first_changed(raw, arr)}); store whole numbers from {limits.min} to "
                    f"{limits.max}"
                )
            if n is None:
                n = arr.shape[0] if arr.ndim else 0
            elif arr.ndim == 0 or arr.shape[0] != n:
                raise PlanError(f"batch tensors disagree on the batch size ({example_name!r} has shape {arr.shape})")
            if (
                graph_name != labels  # the labels' own check below says more
                and expected
                and arr.ndim
                and (arr.ndim != len(expected) or any(d not in (None, a) for d, a in zip(expected[1:], arr.shape[1:])))
            ):  # a store's examples of another shape: said here, not as onnxruntime's error in the step
                per_example = tuple("?" if d is None else d for d in expected[1:])
                raise PlanError(
                    f"example tensor {example_name!r} has shape {arr.shape[1:]} per example; the plan takes {per_example}"
                )
            feeds[graph_name] = arr
        for graph_name, classes in self.plan.device.class_ids.items():
            ids = feeds[graph_name]
            if n and not _labels_within(ids, classes):
                raise PlanError(
                    f"example tensor {self.plan.device.inputs[graph_name]!r} holds class ids from {ids.min()} to "
                    f"{ids.max()}, but the plan scores {classes} classes (ids 0 to {classes - 1}); number the classes "
                    "from 0, or train a model with an output per class"
                )
        for graph_name, rows in self._lookups.items():
            if graph_name not in feeds or not n or graph_name in self.plan.device.class_ids or graph_name == labels:
                continue
            if not _labels_within(token_ids := feeds[graph_name], rows):
                raise PlanError(
                    f"example tensor {self.plan.device.inputs[graph_name]!r} holds ids from {token_ids.min()} to "
                    f"{token_ids.max()}, "
                    f"but the plan looks them up in a table of {rows} rows (ids 0 to {rows - 1}); store ids in that "
                    "range (a padding id of -1 would read the table's last row), or grow the model's table"
                )
        if labels is not None and n:
            y = feeds[labels]
            num_classes = self._num_classes()
            if y.ndim != 1 or not _labels_within(y, num_classes):
                seen = f" from {y.min()} to {y.max()}" if y.ndim == 1 else ""
                raise PlanError(
                    f"labels must be class ids in [0, {num_classes}) of shape [N], got shape {y.shape}{seen}"
                )
        return feeds, n or 0

    def _num_classes(self) -> int:
        inputs, _ = self._work_specs()
        last = self.plan.weight_names[-1]
        return int(inputs[last][0][-1])

    def run_device(
        self,
        weights: Mapping[str, np.ndarray],
        open_batches: Callable[[], Iterable[Mapping[str, np.ndarray]]],
        *,
        should_abort: Callable[[], bool] | None = None,
        run_options: ort.RunOptions | None = None,
    ) -> DeviceResult:
        """Train (or evaluate) on the device's data: for each of ``plan.device.epochs`` epochs call
        ``open_batches()`` (it must re-open the data; batches are dicts keyed by example tensor
        names, see :meth:`batches_from_examples`), run the work step on each batch and feed the new
        weights back. ``should_abort`` is checked before every batch; when it returns True,
        :class:`TrainingInterrupted` is raised. Setting ``run_options.terminate`` from another thread
        stops a step in flight (the forced stop), also as :class:`TrainingInterrupted`. Returns the
        client update (see the module doc)."""
        plan = self.plan
        initial = self.check_weights(weights)
        sess = self._session("work")
        sums = {m: 0.0 for m in plan.metric_names}
        total = 0
        train = plan.kind == "train"
        # a training session's first step reads the weights where they are (the workspace's first
        # set is only written by the second step): copying ResNet-18's 11M weights in took 4 ms
        space = self._take_workspace(sess, initial, fill=not train)
        try:
            bindings, metric_arrays = space.bindings, space.metric_arrays
            input_map = list(plan.device.inputs.items())
            step = 0
            for _epoch in range(plan.device.epochs):
                for batch in open_batches():
                    if should_abort is not None and should_abort():
                        raise TrainingInterrupted("training was interrupted: the device's conditions stopped holding")
                    feeds, n = self._feeds(batch)
                    if n == 0:
                        continue
                    binding = bindings[step % len(bindings)]
                    for graph_name, _ in input_map:
                        binding.bind_cpu_input(graph_name, feeds[graph_name])
                    if train and step == 0:
                        for w in plan.weight_names:
                            binding.bind_ortvalue_input(w, ort.OrtValue.ortvalue_from_numpy(initial[w]))
                    try:
                        sess.run_with_iobinding(binding, run_options)
                    except Exception as exc:
                        if run_options is not None and run_options.terminate:
                            raise TrainingInterrupted("training was stopped by force while a step was running") from exc
                        # a graph that asks for more memory than there is, or fails on its inputs
                        raise PlanError(
                            f"the plan's 'work' graph failed at step {step}: {_first_line(exc)}; no update was made"
                        ) from None
                    finally:
                        if train and step == 0:
                            for w in plan.weight_names:
                                binding.bind_ortvalue_input(w, space.sets[0][w])
                    finite = True
                    for m, arr in metric_arrays.items():
                        value = float(arr)
                        sums[m] += value
                        finite = finite and math.isfinite(value)
                    total += n
                    step += 1
                    if not finite:
                        # a step's NaN or infinite loss makes an update no one may send: the batch's
                        # own NaN or infinite values are the data's fault, said here; else training
                        # diverged, and it stops here rather than train on to an update it drops.
                        # An evaluation goes on: its other batches' metrics and count are still true
                        _refuse_non_finite(feeds, plan.device.inputs, step - 1)
                        if train:
                            break
                else:
                    continue
                break
            # views of the workspace's buffers: the result is made from them before it is given back
            final = {w: space.sets[step % 2][w].numpy() for w in plan.weight_names} if train and step else {}
            if train and not step:
                final = dict(initial)
            return device_result(plan, initial, final, sums, total)
        finally:
            self._give_back(space)

    def _take_workspace(
        self, sess: ort.InferenceSession, initial: Mapping[str, np.ndarray], *, fill: bool = True
    ) -> _Workspace:
        """A workspace holding ``initial`` (with ``fill``; else a free one's first set is left as
        it is): a free one refilled, or a new one (one per session training at once; building its
        buffers and bindings cost as much as a short session's steps)."""
        with self._lock:
            space = self._free_workspaces.pop() if self._free_workspaces else None
        if space is None:
            return _Workspace(self.plan, sess, initial)
        if fill:
            for w in self.plan.weight_names:
                space.sets[0][w].update_inplace(initial[w])
        return space

    def _give_back(self, space: _Workspace) -> None:
        with self._lock:
            self._free_workspaces.append(space)

    def final_weights(self, initial: Mapping[str, np.ndarray], result: DeviceResult) -> dict[str, np.ndarray]:
        """The device's trained weights, reconstructed from its update: w + delta*n / n."""
        n = max(result.num_examples, 1)
        return {
            w: (f32(initial[w]) + result.update[w] / np.float32(n)).astype(np.float32) for w in self.plan.weight_names
        }

    def batches_from_examples(
        self,
        open_examples: Callable[[], Iterable[Mapping[str, np.ndarray]]],
        *,
        batched: bool = True,
        max_held_bytes: int = SHUFFLE_MAX_BYTES,
    ) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
        """Wrap a source of examples into the ``open_batches`` callable :meth:`run_device` takes.

        ``open_examples()`` returns an iterable over chunks of examples: dicts keyed by example
        tensor names whose arrays share a leading example axis (any chunk size; with
        ``batched=False`` each item is a single example without that axis). Only the tensors the
        plan feeds (``plan.device.inputs`` values) are kept.

        Each call of the returned callable re-opens the source and yields dicts of exactly
        ``plan.device.batch_size`` examples (the last one may be smaller), shuffled through a
        bounded buffer of ``plan.device.shuffle_buffer`` examples: whenever the buffer holds more,
        a uniformly random subset of the excess is emitted and the rest kept; at the end the
        remainder is emitted in random order. Memory stays bounded by the buffer plus one chunk,
        whatever the size of the collection. The order is a function of ``plan.device.shuffle_seed``,
        the epoch (the number of times the callable was called) and the chunking of the source;
        ``shuffle_seed=None`` draws a fresh seed from the OS; ``shuffle_buffer <= 1`` keeps order.
        The buffer never holds more than ``max_held_bytes`` of examples (``SHUFFLE_MAX_BYTES``,
        256 MiB, by default; a runtime gives its device's ``examples_share``), at the largest size
        per example read so far, whatever the plan's
        ``shuffle_buffer``: a plan cannot make a device hold its whole collection at once.
        """
        return batches_from_examples(self.plan.device, open_examples, batched=batched, max_held_bytes=max_held_bytes)

    def evaluate(
        self, weights: Mapping[str, np.ndarray], batches: Iterable[Mapping[str, np.ndarray]]
    ) -> dict[str, float]:
        """Loss and accuracy of ``weights`` over ``batches`` (keyed by example tensor names) with
        the work graph's forward pass: ``eval_loss``, ``num_examples`` and, when the plan counts
        ``correct`` predictions (classification), ``eval_accuracy``; a regression plan (mse) has
        no accuracy. Meant for evaluation plans; on a training plan the weights are not updated either,
        but its forward pass is the training step's (BatchNorm by each batch's statistics, Dropout
        dropping units), so a model with them scores otherwise than its evaluation plan."""
        w = self.check_weights(weights)
        sess = self._session("work")
        outputs = list(self.plan.metric_names)
        sums = dict.fromkeys(outputs, 0.0)
        for batch in batches:
            feeds, n = self._feeds(batch)
            if n == 0:
                continue
            feeds.update(w)
            for name, value in zip(outputs, sess.run(outputs, feeds)):
                sums[name] += float(value)
        count = sums.get("count", 0.0)
        out = {"eval_loss": sums["loss_sum"] / count if count else float("nan"), "num_examples": count}
        if "correct" in sums:
            out["eval_accuracy"] = sums["correct"] / count if count else float("nan")
        return out

    # ------------------------------------------------------------------ deploy-time check

    def smoke_test(self, weights: Mapping[str, np.ndarray]) -> None:
        """Run the whole plan once on dummy data; raise :class:`PlanError` naming the first graph
        that does not run or whose outputs break the contract.

        ``load_plan`` only proves that the graphs parse and pass the ONNX checker; onnxruntime can
        still refuse a graph when it builds the session or runs a node (a ``ConstantOfShape`` of
        shape ``[-1]`` passes the checker). A server that finds out when its first round starts or
        commits has already stored the task and fails on every restart, so it runs this at deploy.

        The server part runs as in a round with one all-zero report (``zero``, ``accumulate`` of
        it, ``merge``, ``report``, ``update(weights, report)``, ``prepare(weights)``); the ``work``
        graph runs once on an all-zero batch of one example (every dynamic dimension is 1, so the
        zeros are also valid class ids). Values are not checked, only names, shapes and dtypes:
        ``zero``, ``accumulate`` and ``merge`` must give what ``accumulate`` takes as ``acc/``
        (the client update's names and shapes; the dtype may be wider, e.g. float64 sums)."""
        state = self.check_weights(weights)
        weight_spec = self.weight_spec()
        update_spec = self.client_update_spec()
        acc_inputs, _ = _io_specs(self.plan.server.accumulate)
        acc_spec = {n[4:]: (s, np.dtype(d)) for n, (s, d) in acc_inputs.items() if n.startswith("acc/")}
        if {n: s for n, (s, _) in acc_spec.items()} != {n: s for n, (s, _) in update_spec.items()}:
            raise PlanError(
                "the plan's server graph 'accumulate' takes an accumulator (acc/) unlike the client update (upd/)"
            )
        zero = self._smoke("zero", self.zero)
        _expect("zero", zero, acc_spec)
        empty_update = {n: np.zeros(s, dtype=d) for n, (s, d) in update_spec.items()}
        acc = self._smoke("accumulate", lambda: self.accumulate(zero, empty_update))
        _expect("accumulate", acc, acc_spec)
        merged = self._smoke("merge", lambda: self.merge(acc, acc))
        _expect("merge", merged, acc_spec)
        aggregate = self._smoke("report", lambda: self.report(merged))
        _expect("report", aggregate, self._declared_outputs("report"))
        feeds: dict[str, np.ndarray] = {}
        self._smoke("update", lambda: self._prefixed("update", "state/", state, feeds))
        self._smoke("update", lambda: self._prefixed("update", "agg/", aggregate, feeds))
        new_state = self._smoke("update", lambda: self._run("update", feeds))
        _expect("update", new_state, weight_spec, exact=False)
        broadcast = self._smoke("prepare", lambda: self.prepare(state))
        _expect("prepare", broadcast, weight_spec, exact=False)
        self._smoke_work(state, weight_spec)

    def _smoke_work(self, state: dict[str, np.ndarray], weight_spec: dict) -> None:
        plan = self.plan
        inputs, _ = self._work_specs()
        feeds = dict(state)
        for graph_name in plan.device.inputs:
            shape, dtype = inputs[graph_name]
            feeds[graph_name] = np.zeros(tuple(1 if d is None else d for d in shape), dtype=dtype)
        names = [*plan.weight_outputs, *plan.metric_names]
        sess = self._smoke("work", lambda: self._session("work"))
        values = self._smoke("work", lambda: sess.run(names, feeds))
        out = dict(zip(names, values))
        promised = {o: weight_spec[w] for w, o in zip(plan.weight_names, plan.weight_outputs)}
        promised.update({m: ((), np.dtype(np.float32)) for m in plan.metric_names})
        _expect("work", out, promised)

    def _declared_outputs(self, which: str) -> dict[str, tuple[tuple, np.dtype]]:
        _, outputs = _io_specs(self.plan.graphs()[which])
        return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in outputs.items()}

    def _smoke(self, which: str, step: Callable[[], _T]) -> _T:
        where = "device graph" if which == "work" else "server graph"
        try:
            return step()
        except _NotLoaded as exc:
            raise PlanError(f"the plan's {where} {which!r} does not run on onnxruntime: {exc.words}") from None
        except PlanError as exc:
            raise PlanError(f"the plan's {where} {which!r} does not fit the plan: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail, InvalidArgument, ...
            message = " ".join(str(exc).split())[:500] or type(exc).__name__
            raise PlanError(f"the plan's {where} {which!r} does not run on onnxruntime: {message}") from None

    def validate_update(self, update: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`UpdateMismatchError` naming the offending tensor if ``update`` does not
        hold exactly the client-update tensors with their shapes and dtype, with finite values and a
        non-negative ``num_examples``.

        A device checks its own update before it leaves, and the server each report: the usual
        update (the plan's arrays, finite: ``all_finite``) passes in one look per tensor; anything
        else is looked at tensor by tensor below, which names what is wrong."""
        spec = self.client_update_spec()
        if len(update) == len(spec):
            for name, (shape, dtype) in spec.items():
                value = update.get(name)
                if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape:
                    break
                if not all_finite(value):
                    break
            else:
                if NUM_EXAMPLES not in spec or float(update[NUM_EXAMPLES]) >= 0:
                    return
        missing = sorted(set(spec) - set(update))
        extra = sorted(set(update) - set(spec))
        if missing:
            raise UpdateMismatchError(f"update is missing tensor(s) {missing}")
        if extra:
            raise UpdateMismatchError(f"update holds unexpected tensor(s) {extra}")
        for name, (shape, dtype) in spec.items():
            value = update[name]
            if not isinstance(value, np.ndarray):
                raise UpdateMismatchError(f"update tensor {name!r} is a {type(value).__name__}, not an array")
            if value.dtype != dtype:
                raise UpdateMismatchError(f"update tensor {name!r} has dtype {value.dtype}, the plan needs {dtype}")
            if tuple(value.shape) != shape:
                raise UpdateMismatchError(
                    f"update tensor {name!r} has shape {tuple(value.shape)}, the plan needs {shape}"
                )
            if not np.isfinite(value).all():
                raise UpdateMismatchError(f"update tensor {name!r} holds NaN or infinite values")
        if NUM_EXAMPLES in spec and float(update[NUM_EXAMPLES]) < 0:
            raise UpdateMismatchError(f"update tensor {NUM_EXAMPLES!r} is negative")


_SUM = np.add.reduce


def all_finite(value: np.ndarray) -> bool:
    """Whether every value of the numeric array ``value`` is finite. A float32 (or smaller)
    array's sum in float64 says it in one pass without a temporary array: the sum cannot
    overflow, and one NaN or infinity makes it NaN or infinite (a device checks each update and
    checkpoint, the server each report)."""
    if value.dtype.kind == "f" and value.itemsize <= 4:
        return math.isfinite(_SUM(value, axis=None, dtype=np.float64))
    return bool(np.isfinite(value).all())


#: Batches up to this size have their labels checked in Python: a device's batches are a few
#: examples, for which numpy's min and max cost four times a list's (once per training step).
_SMALL_BATCH = 64


def _as_fed(example_name: str, raw: object, dtype: np.dtype) -> np.ndarray:
    """``raw`` as the work graph's input of ``dtype``; raises :class:`PlanError` naming the example
    tensor when numpy cannot convert it (strings for a float input). A float's cast to an integer
    or a narrower float type says nothing here of the NaN or the overflow it meets: ``_held_exactly``
    refuses the ones an integer type meets, and a float32 past its range is an infinity that the
    step's loss shows (``_refuse_non_finite``)."""
    try:
        if isinstance(raw, np.ndarray) and raw.dtype.kind == "f" and raw.dtype != dtype:
            with np.errstate(invalid="ignore", over="ignore"):
                return np.asarray(raw, dtype=dtype, order="C")
        return np.asarray(raw, dtype=dtype, order="C")
    except (TypeError, ValueError, OverflowError) as exc:
        held = raw.dtype if isinstance(raw, np.ndarray) else type(raw).__name__
        raise PlanError(
            f"example tensor {example_name!r} ({held}) cannot be read as the plan's {np.dtype(dtype)}: {_first_line(exc)}"
        ) from None


def _refuse_non_finite(feeds: Mapping[str, np.ndarray], inputs: Mapping[str, str], step: int) -> None:
    """Raise :class:`PlanError` naming the first float input of a step's batch that holds a NaN or
    an infinity (a feature, a regression label; a float64 past float32's range became one), the
    example and the step; nothing when the batch is finite."""
    for graph_name, example_name in inputs.items():
        value = feeds[graph_name]
        if value.dtype.kind == "f" and not all_finite(value):
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
            raise PlanError(
                f"example tensor {example_name!r} holds {value[at].item()} (example {at[0] if at else 0} of the batch "
                f"at step {step}, as the plan's {value.dtype}), and the step's loss was not finite; no update was made: "
                "drop or fix the example in the app's store"
            )


def _held_exactly(raw: object, fed: np.ndarray) -> bool:
    """Whether ``fed``, ``raw`` cast to an integer type, holds each of its values: a cast that
    numpy cannot do without loss (a float to an integer, int64 to int32 or uint8) would train a
    float label of 7.5 as class 7, a feature of 300 fed to uint8 as 44 and a token id of 2^32 + 3
    fed to int32 as 3. A safe cast (int32 to int64, the usual same dtype) is not looked at."""
    if isinstance(raw, np.ndarray) and np.can_cast(raw.dtype, fed.dtype, "safe"):
        return True
    return bool(np.array_equal(fed, np.asarray(raw)))


def _first_changed(raw: object, fed: np.ndarray) -> str:
    """The first value of ``raw`` that ``fed`` does not hold, and where: for an error message."""
    held = np.asarray(raw)
    if held.shape != fed.shape:
        return "after the cast"
    changed = np.argwhere(held != fed)
    if not len(changed):
        return "after the cast"
    at = tuple(int(i) for i in changed[0])
    where = f"example {at[0]} of the batch" if at else "the value"
    return f"{where} holds {held[at].item()!r}, which becomes {fed[at].item()!r}"


class _NotLoaded(PlanError):
    """onnxruntime could not make a session of one of the plan's graphs; ``words`` are its own."""

    def __init__(self, which: str, exc: Exception) -> None:
        super().__init__(f"onnxruntime cannot load the plan's {which!r} graph: {_first_line(exc)}")
        self.words = " ".join(str(exc).split())[:500] or type(exc).__name__


def _first_line(exc: BaseException) -> str:
    """An onnxruntime error's first line, without the source path it starts with, cut short."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line[:300]


def _labels_within(y: np.ndarray, num_classes: int) -> bool:
    """Whether every label of ``y`` is a class id in [0, num_classes)."""
    if y.size == 0:
        return True
    if y.size <= _SMALL_BATCH:
        labels = y.ravel().tolist()
        return min(labels) >= 0 and max(labels) < num_classes
    return bool(y.min() >= 0 and y.max() < num_classes)


class _Workspace:
    """The work graph's weight buffers and their bindings for one training session at a time.

    Training ping-pongs: step k reads the weights from set k%2 and writes them to set (k+1)%2,
    except that a session's first step reads them from the caller's arrays (an evaluation plan
    reads its one set). The metric outputs land in ``metric_arrays``."""

    def __init__(self, plan: Plan, sess: ort.InferenceSession, initial: Mapping[str, np.ndarray]) -> None:
        train = plan.kind == "train"
        self.sets = [{w: ort.OrtValue.ortvalue_from_numpy(initial[w].copy()) for w in plan.weight_names}]
        if train:
            # zeros, not the uninitialized memory of ortvalue_from_shape_and_type: a buffer the
            # graph would not write must not carry the app's old memory into an update
            self.sets.append(
                {w: ort.OrtValue.ortvalue_from_numpy(np.zeros(initial[w].shape, np.float32)) for w in plan.weight_names}
            )
        self.metric_arrays = {m: np.zeros((), dtype=np.float32) for m in plan.metric_names}
        metric_values = {m: ort.OrtValue.ortvalue_from_numpy(a) for m, a in self.metric_arrays.items()}
        self.bindings = []
        for k, src in enumerate(self.sets):
            binding = sess.io_binding()
            for w in plan.weight_names:
                binding.bind_ortvalue_input(w, src[w])
            if train:
                dst = self.sets[1 - k]
                for w, out in zip(plan.weight_names, plan.weight_outputs):
                    binding.bind_ortvalue_output(out, dst[w])
            for m in plan.metric_names:
                binding.bind_ortvalue_output(m, metric_values[m])
            self.bindings.append(binding)


def _expect(
    which: str, outputs: Mapping[str, np.ndarray], promised: Mapping[str, tuple], *, exact: bool = True
) -> None:
    """Refuse outputs that lack a promised tensor or give it another shape or dtype (a dynamic
    dimension, None, matches any size); with ``exact``, also outputs that were not promised."""
    where = "device graph" if which == "work" else "server graph"
    missing = sorted(set(promised) - set(outputs))
    extra = sorted(set(outputs) - set(promised)) if exact else []
    if missing or extra:
        raise PlanError(
            f"the plan's {where} {which!r} returns {sorted(outputs)}: missing {missing}, unexpected {extra}"
        )
    for name, (shape, dtype) in promised.items():
        value = np.asarray(outputs[name])
        fits = value.ndim == len(shape) and all(d is None or d == v for d, v in zip(shape, value.shape))
        if not fits or value.dtype != np.dtype(dtype):
            raise PlanError(
                f"the plan's {where} {which!r} returns {name!r} as {value.dtype}{list(value.shape)}, "
                f"the plan promises {np.dtype(dtype)}{list(shape)}"
            )


def device_result(
    plan: Plan,
    initial: Mapping[str, np.ndarray],
    final: Mapping[str, np.ndarray],
    sums: Mapping[str, float],
    total: int,
) -> DeviceResult:
    """The client update of a device that trained from ``initial`` to ``final`` over ``total``
    examples (see the module doc: weight deltas times n, metric sums per epoch, the example count);
    every executor, in process or in a release's worker, reports through this one definition."""
    epochs = plan.device.epochs
    n_per_epoch = total / epochs
    update: dict[str, np.ndarray] = {}
    if plan.kind == "train":
        scale = np.float32(n_per_epoch)
        for w in plan.weight_names:
            # scaled in place: a second array of the model's size cost as much as the subtraction
            # (ResNet-18's 11M weights: 23 against 6 ms a session)
            new, old = np.asarray(final[w], dtype=np.float32), np.asarray(initial[w], dtype=np.float32)
            delta = np.subtract(new, old, out=np.empty(np.broadcast_shapes(new.shape, old.shape), np.float32))
            update[w] = np.multiply(delta, scale, out=delta)  # an array also for a 0-d weight
    for m in plan.metric_names:
        update[m] = np.array(sums[m] / epochs, dtype=np.float32)
    update[NUM_EXAMPLES] = np.array(n_per_epoch, dtype=np.float32)
    metrics = {m: sums[m] / epochs for m in plan.metric_names}
    count = sums.get("count", 0.0)
    if "loss_sum" in sums and count > 0:
        metrics["loss"] = sums["loss_sum"] / count
    if "correct" in sums and count > 0:
        metrics["accuracy"] = sums["correct"] / count
    return DeviceResult(update=update, metrics=metrics, num_examples=int(round(n_per_epoch)))
