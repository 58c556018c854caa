"""Differential privacy in a task's rounds: the glue between ``FLService`` and the pure DP cores.

``server_stub.central_dp`` says how one round is made private and ``server_stub.accounting`` what
the rounds cost; this module holds what a running task keeps between them, so the service only
calls it at five points: deploy (``check_deploy``), task load (``TaskDP.load``), round open
(``TaskDP.open_round``), each plain report (``CentralRound.take``) and commit (``CentralRound.close``,
``TaskDP.after_commit``).

- Central DP (``dp.mode == "central"``, a plain training task): each report's mean update is
  clipped to the round's clip and weighted as it is summed, so the server keeps no update of its
  own; at commit the summed weight tensors get Gaussian noise of std z C and ``num_examples``
  becomes the DP denominator, and only then do the plan's ``report`` and ``update`` run (so the
  plan's accumulate must sum and its report divide the weight sums by ``num_examples``: every plan
  the builders and the toolchain make does). With adaptive clipping the count of reports at or
  below the clip is noised at commit and sets the next round's clip.
- The accountant, whatever the mode: a ``PrivacyLedger`` per task, rebuilt from the records of its
  rounds that spent privacy when the server loads it (a restarted server reports the same
  epsilon), advanced at each commit; a round's metrics carry ``epsilon``, ``delta``,
  ``dp_rounds``, ``noise_multiplier``, ``dp_mode`` and ``dp_clip`` (``ROUND_KEYS``). A task whose
  next round would pass ``max_epsilon`` completes instead. A round spends privacy when it commits,
  and under distributed DP also when it is abandoned after the server unmasked a group's noisy sum
  (``released_sums``): the server is not trusted there, and it has seen that sum whatever became
  of the round.
- DP-FTRL (``dp.tree_rounds``): the round's noise is its tree's step (``central_dp.tree_step``)
  instead of fresh noise; the open tree (``FtrlTree``) lives in memory only, so a restarted server
  starts a new tree, and each round records its tree and place (``TREE_KEYS``), from which the
  ledger's trees are rebuilt.

The noise comes from ``secure_generator``: numpy's PCG64 seeded with 128 bits from the operating
system's CSPRNG, a fresh one per round. numpy's floating-point Gaussian is not a hardened DP
sampler (a floating-point sample's low bits can reveal the value it was added to: Mironov 2012);
the distributed mode's discrete samplers (``device_runtime.ddp``) do not have that weakness.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from device_runtime.influence import NUM_EXAMPLES
from device_runtime.plan import Plan

from . import central_dp
from .accounting import PrivacyLedger
from .dp_config import DPConfig
from .errors import BadRequest
from .rounds import RoundConfig

#: The keys every DP round's metrics carry (the contract the fleet's summary and report read).
ROUND_KEYS = ("epsilon", "delta", "dp_rounds", "noise_multiplier", "dp_mode", "dp_clip")
#: The clip the next round starts from (adaptive clipping), kept so a restarted server goes on with it.
NEXT_CLIP_KEY = "dp_next_clip"
#: A DP-FTRL round's tree (numbered from 1 in the task) and its place in it (from 1).
TREE_KEYS = ("dp_tree", "dp_tree_round")


def secure_generator() -> np.random.Generator:
    """A round's noise source: PCG64 seeded with 128 bits of ``secrets`` (see the module docstring)."""
    return np.random.default_rng(secrets.randbits(128))


def check_deploy(name: str, plan: Plan, config: RoundConfig) -> None:
    """Refuse, with the field named, a DP setting the server cannot honour for this task."""
    dp = config.dp
    if dp is None:
        return
    if plan.kind != "train":
        raise BadRequest(
            f"task {name!r}: dp is set on a {plan.kind!r} task; differential privacy here applies to model updates, "
            "so only training tasks take dp (remove dp.mode from this task)",
            code="BAD_CONFIG",
        )
    state = client_optimizer_state(plan.weight_names)
    if state:
        shown = ", ".join(state[:3]) + (", ..." if len(state) > 3 else "")
        harm = (
            "the step count and moments would take the clip's share from the model's change (5 steps outweigh "
            "most models' deltas), and where the state carries over a noised second moment below zero makes "
            "every device's next step NaN"
            if any(_ADAM_STATE.fullmatch(w) for w in state)
            else "the momentum would take the clip's share from the model's change, and where the state carries "
            "over its noise moves every device's next steps"
        )
        raise BadRequest(
            f"task {name!r}: dp clips and noises each device's whole update, and this plan's holds its client "
            f"optimizer's state ({shown}): {harm}; build the plan with SGD (DP-FedAvg's clients), whose update is "
            "the model's alone",
            code="BAD_CONFIG",
        )
    if dp.mode == "central" and plan.server.secure_sum:
        raise BadRequest(
            f"task {name!r}: dp.mode 'central' needs the server to see each update, but this task runs under "
            'Secure Aggregation; use dp.mode "distributed" (the devices add the noise)',
            code="BAD_CONFIG",
        )
    if dp.mode == "central" and dp.target_quantile is not None and dp.noise_multiplier > 0:
        sigma_b = count_stddev(dp, config.goal_count)
        try:
            central_dp.update_noise_multiplier(dp.noise_multiplier, sigma_b)
        except central_dp.CentralDPError as exc:
            raise BadRequest(
                f"task {name!r}: dp.clipped_count_stddev ({sigma_b:g}{'' if dp.clipped_count_stddev else ', the default goal_count / 20'}) "
                f"is too small for dp.noise_multiplier: {exc}",
                code="BAD_CONFIG",
            ) from None
    if dp.max_epsilon is not None and not ledger(dp).allows(dp.noise_multiplier, new_tree=True):
        raise BadRequest(
            f"task {name!r}: dp.max_epsilon {dp.max_epsilon:g} is spent by a single round at dp.noise_multiplier "
            f"{dp.noise_multiplier:g} (delta {dp.delta:g}); raise dp.noise_multiplier or dp.max_epsilon",
            code="BAD_CONFIG",
        )


#: The toolchain's names for a client optimizer's state held as plan weights (``adam_step``,
#: ``<weight>.adam_m``, ``<weight>.adam_v``, ``<weight>.momentum``; ``emulator.toolchain.optimizers``),
#: with the ``__<n>`` its emitter adds to a name the model already uses.
_OPTIMIZER_STATE = re.compile(r"(?:(?P<weight>.+)\.(?:adam_m|adam_v|momentum)|adam_step)(?:__\d+)?")
_ADAM_STATE = re.compile(r"(?:.+\.(?:adam_m|adam_v)|adam_step)(?:__\d+)?")


def client_optimizer_state(weight_names: Iterable[str]) -> list[str]:
    """The plan weights that hold a client optimizer's state rather than the model's: ``adam_step``
    and the moments or momentum of another of the plan's weights (a model's own weight called
    ``momentum`` or ``head.momentum`` is the model's).

    DP-FedAvg (McMahan et al. 2018; TFF's and Flower's DP aggregators) clips and noises the model's
    change alone, with clients that run SGD or start their optimizer afresh each round; a plan whose
    update carries the optimizer's state would put it in the clipped norm and the noised sum."""
    names = list(weight_names)
    model = set(names) | {w.replace("/", "_") for w in names}  # a fresh name's "/" is "_"
    found = (_OPTIMIZER_STATE.fullmatch(w) for w in names)
    return [m.string for m in found if m and (m["weight"] is None or m["weight"] in model)]


def count_stddev(dp: DPConfig, goal_count: int) -> float:
    """The noise std on adaptive clipping's count: the task's, else goal_count / 20."""
    return (
        dp.clipped_count_stddev if dp.clipped_count_stddev is not None else central_dp.default_count_stddev(goal_count)
    )


def ledger(dp: DPConfig) -> PrivacyLedger:
    """An empty ledger with the task's accounting settings."""
    return PrivacyLedger(
        delta=dp.delta,
        sampling_probability=dp.sampling_probability,
        method=dp.accountant,
        max_epsilon=dp.max_epsilon,
        tree_rounds=dp.tree_rounds,
    )


def _json_epsilon(eps: float) -> float | None:
    """Epsilon as round metrics store it: JSON has no infinity, so a noiseless round's is null."""
    return eps if math.isfinite(eps) else None


@dataclass(eq=False)
class FtrlTree:
    """A DP-FTRL task's open tree, in memory only (a restarted server starts a new one, the noise of
    the last being gone): its number in the task (0 before any), its noise (None: the next round
    starts a tree) and the tree as the round being committed leaves it (``pending``)."""

    index: int = 0
    tree: central_dp.TreeNoise | None = None
    pending: central_dp.TreeNoise | None = None

    def next_is_new(self, tree_rounds: int) -> bool:
        return self.tree is None or self.tree.t >= tree_rounds

    @property
    def pending_is_new(self) -> bool:
        """Whether the round being committed began a tree."""
        return self.pending is None or self.pending.t == 1


@dataclass(frozen=True)
class TaskDP:
    """What a DP task keeps between rounds: its privacy ledger and the clip its next round uses
    (and, for DP-FTRL, its open tree)."""

    config: DPConfig
    goal_count: int
    ledger: PrivacyLedger
    clip: float
    ftrl: FtrlTree | None = None

    @classmethod
    def load(cls, config: RoundConfig, committed: Iterable[Mapping]) -> TaskDP | None:
        """The task's state from the metrics of its rounds that spent privacy (``spends_privacy``),
        oldest first (None without dp): one ledger entry per round at the multiplier it recorded,
        and the clip the last one handed on. Restart-safe: only what is on record counts."""
        dp = config.dp
        if dp is None:
            return None
        book, clip = ledger(dp), dp.clip
        tree: object = None
        trees = 0
        for metrics in committed:
            z = metrics.get("noise_multiplier")
            zf = float(z) if isinstance(z, (int, float)) else dp.noise_multiplier
            if dp.tree_rounds is not None:  # a record without its tree is counted as a tree of its own
                here = metrics.get("dp_tree")
                new_tree = here is None or here != tree
                book, tree, trees = book.add_tree_round(zf, new_tree), here, trees + new_tree
            else:
                book = book.add_round(zf)
            nxt = metrics.get(NEXT_CLIP_KEY)
            if isinstance(nxt, (int, float)) and math.isfinite(nxt) and nxt > 0:
                clip = float(nxt)
        ftrl = FtrlTree(index=trees) if dp.tree_rounds is not None else None
        return cls(dp, config.goal_count, book, clip, ftrl)

    def allows_next(self) -> bool:
        """Whether one more round stays within ``max_epsilon`` (checked before a round opens)."""
        if self.ftrl is not None and self.config.tree_rounds is not None:
            new_tree = self.ftrl.next_is_new(self.config.tree_rounds)
            return self.ledger.allows(self.config.noise_multiplier, new_tree=new_tree)
        return self.ledger.allows(self.config.noise_multiplier)

    def open_round(self, secure: bool) -> CentralRound | None:
        """The state of a central DP round about to open (None for distributed DP, whose devices
        clip and noise their own updates)."""
        if self.config.mode != "central" or secure:
            return None
        dp = self.config
        if self.ftrl is not None:
            self.ftrl.pending = None
            return CentralRound(dp, self.goal_count, self.clip, dp.noise_multiplier, ftrl=self.ftrl)
        if dp.target_quantile is None:
            return CentralRound(dp, self.goal_count, self.clip, dp.noise_multiplier)
        adaptive = central_dp.AdaptiveClip(
            clip=self.clip,
            target_quantile=dp.target_quantile,
            learning_rate=dp.clip_learning_rate,
            count_stddev=count_stddev(dp, self.goal_count),
            noise_multiplier=dp.noise_multiplier,
        )
        return CentralRound(dp, self.goal_count, self.clip, adaptive.updates_noise_multiplier, adaptive)

    def round_metrics(self, clip: float | None) -> tuple[dict, PrivacyLedger]:
        """The DP metrics (``ROUND_KEYS``) of a round that spent privacy (it commits, or released a
        group's sum) and the ledger once it is on record."""
        z = self.config.noise_multiplier
        tree: dict[str, int | None] = {}
        if self.ftrl is not None:  # the round's place in its tree, as its close left it
            pending, new_tree = self.ftrl.pending, self.ftrl.pending_is_new
            after = self.ledger.add_tree_round(z, new_tree)
            tree = {"dp_tree": self.ftrl.index + new_tree, "dp_tree_round": pending.t if pending else None}
        else:
            after = self.ledger.add_round(z)
        metrics = {
            "epsilon": _json_epsilon(after.epsilon),
            "delta": self.config.delta,
            "dp_rounds": after.rounds,
            "noise_multiplier": z,
            "dp_mode": self.config.mode,
            "dp_clip": self.config.clip if clip is None else clip,
            **tree,
        }
        return metrics, after

    def after_commit(self, after: PrivacyLedger, next_clip: float | None) -> TaskDP:
        """The state once a round that spent privacy is on record (``spends_privacy``; one that did
        not changes nothing)."""
        if self.ftrl is not None:
            self.ftrl.index += self.ftrl.pending_is_new
            self.ftrl.tree, self.ftrl.pending = self.ftrl.pending, None
        return replace(self, ledger=after, clip=self.clip if next_clip is None else next_clip)


def released_sums(metrics: Mapping) -> int:
    """How many Secure Aggregation groups of a round the server unmasked, as its record's ``secagg``
    statistics count them: the groups whose sums were used and those dropped after they were
    decoded. Under distributed DP each is a noisy sum of its devices' updates that the (untrusted)
    server has seen, so the round spent privacy even if it did not commit."""
    stats = metrics.get("secagg")
    if not isinstance(stats, Mapping):
        return 0
    completed = stats.get("completed")
    dropped = stats.get("dropped")
    return (completed if isinstance(completed, int) else 0) + (len(dropped) if isinstance(dropped, list) else 0)


def spends_privacy(status: str, metrics: Mapping) -> bool:
    """Whether a round on record spent privacy: it committed, or the server unmasked a group's
    noisy sum before it was abandoned (``released_sums``). A central DP round that did not commit
    published nothing (its noise is drawn at commit): it spent nothing."""
    return status == "committed" or released_sums(metrics) > 0


#: What a round's record says of how many devices took part and when they were done: its outcome
#: counts (``RoundCore.stats``), the session shapes its devices reported and its duration, which a
#: round that ends at ``goal_count`` reports owes to its last reporter. A task whose ``dp.counts``
#: is ``withheld`` publishes none of them (``withhold_counts``).
COUNT_KEYS = ("selected", "reported", "rejected_late", "aborted", "dropped", "shapes", "duration_s")


def counts_withheld(task_config: Mapping) -> bool:
    """Whether a task, by its stored config (``TaskRecord.config``), withholds its rounds' counts."""
    rounds = task_config.get("round")
    dp = rounds.get("dp") if isinstance(rounds, Mapping) else None
    return isinstance(dp, Mapping) and dp.get("counts") == "withheld"


def withhold_counts(metrics: Mapping) -> dict:
    """A round's metrics as a task with ``dp.counts="withheld"`` publishes them: without
    ``COUNT_KEYS``, which tell a round with a device from one without (the server keeps them on
    record; only what it publishes leaves them out), and with ``counts: "withheld"`` saying so."""
    out = {key: value for key, value in metrics.items() if key not in COUNT_KEYS}
    out["counts"] = "withheld"
    return out


def strip(metrics: dict) -> None:
    """Remove a round's DP keys: a round that published nothing spent nothing."""
    for key in (*ROUND_KEYS, NEXT_CLIP_KEY, *TREE_KEYS):
        metrics.pop(key, None)


@dataclass
class CentralRound:
    """One open central DP round: its clip, the updates' noise multiplier (z, or z_delta with
    adaptive clipping), how many reports were summed and how many were at or below the clip."""

    config: DPConfig
    goal_count: int
    clip: float
    updates_noise_multiplier: float
    adaptive: central_dp.AdaptiveClip | None = None
    reports: int = 0
    unclipped: int = 0
    ftrl: FtrlTree | None = None

    def take(
        self, update: Mapping[str, np.ndarray], weight_names: Sequence[str], max_examples: int
    ) -> dict[str, np.ndarray]:
        """One report as the round sums it: its weight tensors become its weighted, clipped mean
        update (``central_dp.report_contribution``) and its ``num_examples`` its weight; its other
        tensors (metric sums) pass unchanged, for a plan whose report reads them (they are not
        published). The report's count must already be capped (``bound_update``)."""
        names = [w for w in weight_names if w in update]
        n = float(np.asarray(update[NUM_EXAMPLES], dtype=np.float64).reshape(())) if NUM_EXAMPLES in update else 1.0
        weight = central_dp.report_weight(n, self.config.weighting, float(max_examples))
        flat = (
            np.concatenate([np.asarray(update[w], dtype=np.float64).reshape(-1) for w in names])
            if names
            else np.zeros(0)
        )
        part, within = central_dp.report_contribution(flat, n, clip=self.clip, weight=weight)
        out = dict(update)
        out.update(_unflatten(part, {w: np.shape(update[w]) for w in names}))
        if NUM_EXAMPLES in update:
            out[NUM_EXAMPLES] = np.asarray(weight, dtype=np.float32).reshape(np.shape(update[NUM_EXAMPLES]))
        self.reports += 1
        self.unclipped += int(within)
        return out

    def close(
        self, accumulator: Mapping[str, np.ndarray], weight_names: Sequence[str], rng: np.random.Generator
    ) -> tuple[dict[str, np.ndarray], float | None]:
        """The round's accumulated sum made private for the plan's ``report``: Gaussian noise of
        std z C on the summed weight tensors, ``num_examples`` set to the DP denominator; and,
        with adaptive clipping, the next round's clip from the noised count (else None)."""
        names = [w for w in weight_names if w in accumulator]
        out = dict(accumulator)
        if self.ftrl is not None and self.config.tree_rounds is not None:  # DP-FTRL: the tree's step
            tree = self.ftrl.tree
            if tree is None or self.ftrl.next_is_new(self.config.tree_rounds):
                tree = central_dp.TreeNoise(std=self.updates_noise_multiplier * self.clip)
            shapes = {w: np.shape(accumulator[w]) for w in names}
            noise, self.ftrl.pending = central_dp.tree_step(tree, sum(int(np.prod(s)) for s in shapes.values()), rng)
            for w, part in _split(noise, shapes).items():
                total = np.asarray(accumulator[w], dtype=np.float64) + part
                out[w] = total.astype(np.asarray(accumulator[w]).dtype, copy=False)
        else:
            for w in names:
                noised = central_dp.noised_sum(
                    accumulator[w], clip=self.clip, noise_multiplier=self.updates_noise_multiplier, rng=rng
                )
                out[w] = noised.astype(np.asarray(accumulator[w]).dtype, copy=False)
        den = central_dp.denominator(self.config.weighting, self.reports, self.goal_count, counts=self.config.counts)
        if NUM_EXAMPLES in accumulator:
            out[NUM_EXAMPLES] = np.full(
                np.shape(accumulator[NUM_EXAMPLES]), den, dtype=np.asarray(accumulator[NUM_EXAMPLES]).dtype
            )
        if self.adaptive is None:
            return out, None
        sigma_b = self.adaptive.count_stddev if self.adaptive.noise_multiplier > 0 else 0.0
        expected = self.goal_count if self.config.counts == "withheld" else None
        b = central_dp.noised_fraction(self.unclipped, self.reports, sigma_b, rng, expected=expected)
        return out, central_dp.next_clip(self.adaptive, b).clip


def _split(flat: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """``flat`` cut into the named tensors, in order (views, in its own dtype)."""
    out: dict[str, np.ndarray] = {}
    start = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = flat[start : start + size].reshape(shape)
        start += size
    return out


def _unflatten(flat: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {name: part.astype(np.float32) for name, part in _split(flat, shapes).items()}


__all__ = [
    "COUNT_KEYS",
    "NEXT_CLIP_KEY",
    "ROUND_KEYS",
    "TREE_KEYS",
    "CentralRound",
    "FtrlTree",
    "TaskDP",
    "check_deploy",
    "counts_withheld",
    "released_sums",
    "secure_generator",
    "spends_privacy",
    "strip",
    "withhold_counts",
]
