"""The plan executor on onnxruntime: the device side runs the plan's ``work`` graph over the
device's batches; the server side runs its MapReduceForm part (``zero``, ``accumulate``,
``merge``, ``report``, ``update``, ``prepare``). Callers only see dicts keyed by plain tensor names;
the ``acc/``, ``upd/``, ``a/``, ``b/``, ``state/``, ``agg/`` prefixes of the server graphs stay in here.

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
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from .plan import Plan, PlanError, UpdateMismatchError

NUM_EXAMPLES = "num_examples"
# Server optimizer state (FedAvgM's momentum, FedAdam's moments): tensors the ``update`` graph
# reads as ``state/server_state/...`` and writes as ``server_state/...``. They live in the server's
# checkpoint beside the weights, start at zero when absent (an initial checkpoint holds only the
# weights) and are never broadcast (``prepare`` does not take them).
SERVER_STATE_PREFIX = "server_state/"
_SERVER_GRAPHS = ("prepare", "zero", "accumulate", "merge", "report", "update")
_T = TypeVar("_T")


class TrainingInterrupted(Exception):
    """``should_abort()`` returned True between batches; the partial result was discarded."""


@dataclass(frozen=True)
class DeviceResult:
    update: dict[str, np.ndarray]
    metrics: dict[str, float]
    num_examples: int


def make_session(model_bytes: bytes) -> ort.InferenceSession:
    """One onnxruntime session on the CPU provider with one thread, no spinning, sequential."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return ort.InferenceSession(model_bytes, sess_options=opts, providers=["CPUExecutionProvider"])


def _io_specs(model_bytes: bytes) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(inputs, outputs) of a model: name -> (shape with None for symbolic dims, numpy dtype)."""
    model = onnx.ModelProto.FromString(model_bytes)

    def spec(values) -> dict[str, tuple]:
        out = {}
        for v in values:
            tt = v.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            out[v.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        return out

    return spec(model.graph.input), spec(model.graph.output)


def _f64(value: np.ndarray) -> np.ndarray:
    return np.asarray(value, dtype=np.float64, order="C")


def _f32(value: np.ndarray) -> np.ndarray:
    # np.asarray(order="C") rather than np.ascontiguousarray, which turns scalars into shape (1,)
    return np.asarray(value, dtype=np.float32, order="C")


class PlanExecutor:
    """Runs one plan. Sessions are created lazily (a device only ever creates ``work``); one
    executor may be shared by threads (session creation is locked; onnxruntime's ``run`` is
    thread-safe)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._io: dict[str, tuple[list[tuple[str, bool, list]], list[str]]] = {}
        self._lock = threading.Lock()
        self._work_io: tuple[dict, dict] | None = None
        self._update_spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._free_workspaces: list[_Workspace] = []

    # ------------------------------------------------------------------ sessions and specs

    def _session(self, which: str) -> ort.InferenceSession:
        sess = self._sessions.get(which)
        if sess is None:
            with self._lock:
                sess = self._sessions.get(which)
                if sess is None:
                    sess = make_session(self.plan.graphs()[which])
                    self._sessions[which] = sess
        return sess

    def _work_specs(self) -> tuple[dict, dict]:
        if self._work_io is None:
            self._work_io = _io_specs(self.plan.work)
        return self._work_io

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The model's weights: name -> (shape, dtype), from the work graph's inputs."""
        inputs, _ = self._work_specs()
        return {w: (tuple(inputs[w][0]), np.dtype(inputs[w][1])) for w in self.plan.weight_names}

    def client_update_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """What a valid client update holds: name -> (shape, dtype), read from the ``accumulate``
        graph's ``upd/`` inputs (the contract the server part actually runs)."""
        if self._update_spec is None:
            inputs, _ = _io_specs(self.plan.server.accumulate)
            spec = {}
            for name, (shape, dtype) in inputs.items():
                if name.startswith("upd/"):
                    if any(d is None for d in shape):
                        raise PlanError(f"the accumulate graph's input {name!r} has a dynamic shape; updates need static shapes")
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
        for name, (shape, _dtype) in spec.items():
            arr = _f32(weights[name])
            if arr.shape != shape:
                raise PlanError(f"weight {name!r} has shape {arr.shape}, the plan needs {shape}")
            out[name] = arr
        return out

    def _feeds(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        feeds = {}
        inputs, _ = self._work_specs()
        n = None
        for graph_name, example_name in self.plan.device.inputs.items():
            if example_name not in batch:
                raise PlanError(f"batch has no tensor {example_name!r} (keys {sorted(batch)}); the plan feeds it to {graph_name!r}")
            dtype = inputs[graph_name][1]
            arr = np.asarray(batch[example_name], dtype=dtype, order="C")
            if n is None:
                n = arr.shape[0] if arr.ndim else 0
            elif arr.ndim == 0 or arr.shape[0] != n:
                raise PlanError(f"batch tensors disagree on the batch size ({example_name!r} has shape {arr.shape})")
            feeds[graph_name] = arr
        if "y" in feeds and n:
            y = feeds["y"]
            num_classes = self._num_classes()
            if y.ndim != 1 or not _labels_within(y, num_classes):
                raise ValueError(f"labels must be class ids in [0, {num_classes}) of shape [N], got shape {y.shape}")
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
        space = self._take_workspace(sess, initial)
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
                    try:
                        sess.run_with_iobinding(binding, run_options)
                    except Exception as exc:
                        if run_options is not None and run_options.terminate:
                            raise TrainingInterrupted("training was stopped by force while a step was running") from exc
                        raise
                    for m, arr in metric_arrays.items():
                        sums[m] += float(arr)
                    total += n
                    step += 1
            # views of the workspace's buffers: the result is made from them before it is given back
            final = {w: space.sets[step % 2][w].numpy() for w in plan.weight_names} if train else {}
            return device_result(plan, initial, final, sums, total)
        finally:
            self._give_back(space)

    def _take_workspace(self, sess: ort.InferenceSession, initial: Mapping[str, np.ndarray]) -> "_Workspace":
        """A workspace holding ``initial``: a free one refilled, or a new one (one per session
        training at once; building its buffers and bindings cost as much as a short session's steps)."""
        with self._lock:
            space = self._free_workspaces.pop() if self._free_workspaces else None
        if space is None:
            return _Workspace(self.plan, sess, initial)
        for w in self.plan.weight_names:
            space.sets[0][w].update_inplace(initial[w])
        return space

    def _give_back(self, space: "_Workspace") -> None:
        with self._lock:
            self._free_workspaces.append(space)

    def final_weights(self, initial: Mapping[str, np.ndarray], result: DeviceResult) -> dict[str, np.ndarray]:
        """The device's trained weights, reconstructed from its update: w + delta*n / n."""
        n = max(result.num_examples, 1)
        return {w: (_f32(initial[w]) + result.update[w] / np.float32(n)).astype(np.float32) for w in self.plan.weight_names}

    def batches_from_examples(
        self,
        open_examples: Callable[[], Iterable[Mapping[str, np.ndarray]]],
        *,
        batched: bool = True,
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
        """
        dev = self.plan.device
        keys = list(dict.fromkeys(dev.inputs.values()))
        epoch = [0]
        seed = dev.shuffle_seed

        def open_batches() -> Iterator[dict[str, np.ndarray]]:
            if seed is None:
                rng = np.random.default_rng()
            else:
                rng = np.random.Generator(np.random.PCG64(_epoch_seeds(seed, epoch[0])))
            epoch[0] += 1
            chunks = _chunks(open_examples(), keys, batched)
            if dev.shuffle_buffer > 1:
                chunks = _shuffle(chunks, rng, dev.shuffle_buffer)
            return _rebatch(chunks, keys, dev.batch_size)

        return open_batches

    def evaluate(self, weights: Mapping[str, np.ndarray], batches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
        """Loss and accuracy of ``weights`` over ``batches`` (keyed by example tensor names) with
        the work graph's forward pass: ``eval_loss``, ``num_examples`` and, when the plan counts
        ``correct`` predictions (classification), ``eval_accuracy``; a regression plan (mse) has
        no accuracy. Meant for evaluation plans; on a training plan the weights are not updated either."""
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

    # ------------------------------------------------------------------ server side

    def _run(self, which: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self._session(which)
        names = self._graph_io(which)[1]
        return dict(zip(names, sess.run(names, feeds)))

    def _graph_io(self, which: str) -> tuple[list[tuple[str, bool, list]], list[str]]:
        """A graph's inputs (name, whether float64, shape) and output names: read from its
        session once (onnxruntime builds new objects on every ``get_inputs``; a server reads them
        for every report it aggregates)."""
        io = self._io.get(which)
        if io is None:
            sess = self._session(which)
            inputs = [(i.name, i.type == "tensor(double)", i.shape) for i in sess.get_inputs()]
            io = (inputs, [o.name for o in sess.get_outputs()])
            self._io[which] = io
        return io

    def _prefixed(self, which: str, prefix: str, values: Mapping[str, np.ndarray], feeds: dict) -> None:
        for name, double, shape in self._graph_io(which)[0]:
            if name.startswith(prefix):
                plain = name[len(prefix):]
                if plain not in values and prefix == "state/" and plain.startswith(SERVER_STATE_PREFIX):
                    if not all(isinstance(d, int) for d in shape):
                        raise PlanError(f"{which}: server state {plain!r} needs a static shape, not {shape}")
                    feeds[name] = np.zeros(shape, dtype=np.float64 if double else np.float32)
                    continue
                if plain not in values:
                    raise PlanError(f"{which}: {prefix[:-1]} is missing tensor {plain!r}")
                # server graphs may keep float64 accumulators; everything else is float32
                feeds[name] = _f64(values[plain]) if double else _f32(values[plain])

    def zero(self) -> dict[str, np.ndarray]:
        """An empty accumulator (same names and shapes as a client update, all zeros)."""
        return self._run("zero", {})

    def accumulate(self, acc: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {}
        self._prefixed("accumulate", "acc/", acc, feeds)
        self._prefixed("accumulate", "upd/", update, feeds)
        return self._run("accumulate", feeds)

    def merge(self, a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {}
        self._prefixed("merge", "a/", a, feeds)
        self._prefixed("merge", "b/", b, feeds)
        return self._run("merge", feeds)

    def report(self, acc: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The aggregate: mean delta per weight and averaged metrics."""
        feeds: dict[str, np.ndarray] = {}
        self._prefixed("report", "acc/", acc, feeds)
        return self._run("report", feeds)

    def update(
        self, state: Mapping[str, np.ndarray], aggregate: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(new server state = global weights and any server optimizer state, metrics as floats)."""
        feeds: dict[str, np.ndarray] = {}
        self._prefixed("update", "state/", state, feeds)
        self._prefixed("update", "agg/", aggregate, feeds)
        out = self._run("update", feeds)
        weights = {w: out[w] for w in self.plan.weight_names}
        weights.update({k: v for k, v in out.items() if k.startswith(SERVER_STATE_PREFIX)})
        metrics = {k: float(v) for k, v in out.items() if k not in weights}
        return weights, metrics

    def prepare(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What is broadcast to devices for this state (the weights)."""
        if not self.plan.weight_names:  # e.g. federated analytics: an empty graph onnxruntime will not load
            return {}
        feeds: dict[str, np.ndarray] = {}
        self._prefixed("prepare", "state/", state, feeds)
        return self._run("prepare", feeds)

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
            raise PlanError("the plan's server graph 'accumulate' takes an accumulator (acc/) unlike the client update (upd/)")
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
        except PlanError as exc:
            raise PlanError(f"the plan's {where} {which!r} does not fit the plan: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail, InvalidArgument, ...
            message = " ".join(str(exc).split())[:500] or type(exc).__name__
            raise PlanError(f"the plan's {where} {which!r} does not run on onnxruntime: {message}") from None

    def validate_update(self, update: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`UpdateMismatchError` naming the offending tensor if ``update`` does not
        hold exactly the client-update tensors with their shapes and dtype, with finite values and a
        non-negative ``num_examples``."""
        spec = self.client_update_spec()
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
                raise UpdateMismatchError(f"update tensor {name!r} has shape {tuple(value.shape)}, the plan needs {shape}")
            if not np.isfinite(value).all():
                raise UpdateMismatchError(f"update tensor {name!r} holds NaN or infinite values")
        if NUM_EXAMPLES in spec and float(update[NUM_EXAMPLES]) < 0:
            raise UpdateMismatchError(f"update tensor {NUM_EXAMPLES!r} is negative")


#: Batches up to this size have their labels checked in Python: a device's batches are a few
#: examples, for which numpy's min and max cost four times a list's (once per training step).
_SMALL_BATCH = 64


def _labels_within(y: np.ndarray, num_classes: int) -> bool:
    """Whether every label of the 1-D ``y`` is a class id in [0, num_classes)."""
    if y.size <= _SMALL_BATCH:
        labels = y.tolist()
        return min(labels) >= 0 and max(labels) < num_classes
    return bool(y.min() >= 0 and y.max() < num_classes)


class _Workspace:
    """The work graph's weight buffers and their bindings for one training session at a time.

    Training ping-pongs: step k reads the weights from set k%2 and writes them to set (k+1)%2
    (an evaluation plan reads its one set). The metric outputs land in ``metric_arrays``."""

    def __init__(self, plan: Plan, sess: ort.InferenceSession, initial: Mapping[str, np.ndarray]) -> None:
        train = plan.kind == "train"
        self.sets = [{w: ort.OrtValue.ortvalue_from_numpy(initial[w].copy()) for w in plan.weight_names}]
        if train:
            self.sets.append({w: ort.OrtValue.ortvalue_from_shape_and_type(initial[w].shape, np.float32) for w in plan.weight_names})
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


def _expect(which: str, outputs: Mapping[str, np.ndarray], promised: Mapping[str, tuple], *, exact: bool = True) -> None:
    """Refuse outputs that lack a promised tensor or give it another shape or dtype (a dynamic
    dimension, None, matches any size); with ``exact``, also outputs that were not promised."""
    where = "device graph" if which == "work" else "server graph"
    missing = sorted(set(promised) - set(outputs))
    extra = sorted(set(outputs) - set(promised)) if exact else []
    if missing or extra:
        raise PlanError(f"the plan's {where} {which!r} returns {sorted(outputs)}: missing {missing}, unexpected {extra}")
    for name, (shape, dtype) in promised.items():
        value = np.asarray(outputs[name])
        fits = value.ndim == len(shape) and all(d is None or d == v for d, v in zip(shape, value.shape))
        if not fits or value.dtype != np.dtype(dtype):
            raise PlanError(
                f"the plan's {where} {which!r} returns {name!r} as {value.dtype}{list(value.shape)}, "
                f"the plan promises {np.dtype(dtype)}{list(shape)}"
            )


# ---------------------------------------------------------------------- streaming data helpers


@functools.lru_cache(maxsize=256)
def _epoch_seeds(seed: int, epoch: int) -> np.random.SeedSequence:
    """The seed sequence ``default_rng([seed, epoch])`` would hash, so shuffles stay those of
    earlier runtimes: the same for every device of a plan, so hashed once (hashing it took a
    quarter of the data pipeline's time in a simulated day of 10,000 devices)."""
    return np.random.SeedSequence([seed, epoch])


def _chunks(source: Iterable[Mapping[str, np.ndarray]], keys: list[str], batched: bool) -> Iterator[dict[str, np.ndarray]]:
    for item in source:
        missing = [k for k in keys if k not in item]
        if missing:
            raise PlanError(f"examples have no tensor(s) {missing} (keys {sorted(item)})")
        chunk = {k: np.asarray(item[k]) for k in keys}
        if not batched:
            chunk = {k: v[None, ...] for k, v in chunk.items()}
        sizes = {v.shape[0] if v.ndim else -1 for v in chunk.values()}
        if len(sizes) != 1 or -1 in sizes:
            raise PlanError(f"example tensors disagree on the number of examples in a chunk: { {k: v.shape for k, v in chunk.items()} }")
        if sizes.pop() > 0:
            yield chunk


def _take(chunk: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in chunk.items()}


def _size(chunk: dict[str, np.ndarray]) -> int:
    return next(iter(chunk.values())).shape[0]


def _shuffle(chunks: Iterator[dict], rng: np.random.Generator, capacity: int) -> Iterator[dict[str, np.ndarray]]:
    # The pool is the chunks read since it last overflowed, joined only when it does (or at the
    # end): joining each small chunk as it came copied the pool once per chunk.
    parts: list[dict[str, np.ndarray]] = []
    size = 0
    for chunk in chunks:
        parts.append(chunk)
        size += _size(chunk)
        if size > capacity:
            pool = _join(parts)
            perm = rng.permutation(size)
            yield _take(pool, perm[: size - capacity])
            parts, size = [_take(pool, perm[size - capacity :])], capacity
    if size:
        yield _take(_join(parts), rng.permutation(size))


def _join(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _rebatch(chunks: Iterator[dict], keys: list[str], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    pending: dict[str, np.ndarray] | None = None
    for chunk in chunks:
        pending = chunk if pending is None else _join([pending, chunk])
        size = _size(pending)
        if size < batch_size:
            continue
        full = size - size % batch_size
        for start in range(0, full, batch_size):
            yield {k: v[start : start + batch_size] for k, v in pending.items()}
        pending = {k: v[full:] for k, v in pending.items()} if full < size else None
    if pending is not None and _size(pending):
        yield pending


def device_result(
    plan: Plan, initial: Mapping[str, np.ndarray], final: Mapping[str, np.ndarray], sums: Mapping[str, float], total: int
) -> DeviceResult:
    """The client update of a device that trained from ``initial`` to ``final`` over ``total``
    examples (see the module doc: weight deltas times n, metric sums per epoch, the example count);
    every executor, in process or in a release's worker, reports through this one definition."""
    epochs = plan.device.epochs
    n_per_epoch = total / epochs
    update: dict[str, np.ndarray] = {}
    if plan.kind == "train":
        for w in plan.weight_names:
            delta = np.asarray(final[w], dtype=np.float32) - np.asarray(initial[w], dtype=np.float32)
            update[w] = (delta * np.float32(n_per_epoch)).astype(np.float32, copy=False)
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
