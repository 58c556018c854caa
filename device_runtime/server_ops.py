"""The server's side of a plan: its MapReduceForm graphs (``zero``, ``accumulate``, ``merge``,
``report``, ``update``, ``prepare``) run on onnxruntime. Callers only see dicts keyed by plain
tensor names; the ``acc/``, ``upd/``, ``a/``, ``b/``, ``state/``, ``agg/`` prefixes of the server
graphs stay in here."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from .plan import Plan, PlanError

# Server optimizer state (FedAvgM's momentum, FedAdam's moments): tensors the ``update`` graph
# reads as ``state/server_state/...`` and writes as ``server_state/...``. They live in the server's
# checkpoint beside the weights, start at zero when absent (an initial checkpoint holds only the
# weights) and are never broadcast (``prepare`` does not take them).
SERVER_STATE_PREFIX = "server_state/"


def f64(value: np.ndarray) -> np.ndarray:
    return np.asarray(value, dtype=np.float64, order="C")


def f32(value: np.ndarray) -> np.ndarray:
    # np.asarray(order="C") rather than np.ascontiguousarray, which turns scalars into shape (1,)
    return np.asarray(value, dtype=np.float32, order="C")


class ServerOps:
    """The server graphs of ``plan``, for ``PlanExecutor`` (which holds the sessions: ``_session``
    builds one per graph on first use, ``_io`` keeps each graph's inputs and outputs)."""

    plan: Plan
    _io: dict[str, tuple[list[tuple[str, bool, list]], list[str]]]

    def _session(self, which: str) -> ort.InferenceSession:
        raise NotImplementedError

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
                plain = name[len(prefix) :]
                if plain not in values and prefix == "state/" and plain.startswith(SERVER_STATE_PREFIX):
                    if not all(isinstance(d, int) for d in shape):
                        raise PlanError(f"{which}: server state {plain!r} needs a static shape, not {shape}")
                    feeds[name] = np.zeros(shape, dtype=np.float64 if double else np.float32)
                    continue
                if plain not in values:
                    raise PlanError(f"{which}: {prefix[:-1]} is missing tensor {plain!r}")
                # server graphs may keep float64 accumulators; everything else is float32
                feeds[name] = f64(values[plain]) if double else f32(values[plain])

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
