"""The privacy accountant: epsilon at a task's delta after its committed rounds, over Google's
``dp-accounting`` library.

What it assumes, by default: each committed round is ONE Gaussian mechanism at noise multiplier z
on the sum of the whole population's clipped updates (sensitivity: one device's clip, C, under
add-or-remove-one-device neighbouring, so the guarantee is per device, over all of its data).
Nothing is assumed about how devices were chosen, so there is no amplification by sampling: a
device may have taken part in every round. k rounds at multipliers z_1..z_k then compose exactly
to one Gaussian mechanism at z = (sum z_i^-2)^-1/2 (the privacy loss of a Gaussian mechanism is
Gaussian, and Gaussians compose by adding their means and variances), whose epsilon
``dp_accounting.get_epsilon_gaussian`` gives exactly (Balle and Wang 2018, the analytic Gaussian
mechanism): that is the PLD answer without discretization, which ``PLDAccountant`` approaches from
above, at a cost per round that does not grow with the rounds. ``method="rdp"`` uses
``RdpAccountant`` instead (looser, for comparison with papers that report RDP); a Renyi divergence
it computes below 0 (cancellation, at a tiny sampling probability and a large multiplier) is left
out of its conversion to epsilon, which would read it as epsilon 0 (``_rdp_epsilon``).

The opt-in ``sampling_probability`` q assumes that each device takes part in each round
independently with probability q (Poisson sampling) and that nobody, the server included, can
make a device's participation more likely than q: the eligibility policies and pace steering
must enforce that bound for every device (a device that checks in more often, or a server that
picks it, breaks the assumption and the epsilon is then wrong). Each round is then a
``PoissonSampledDpEvent`` of the Gaussian, composed by ``PLDAccountant``'s privacy loss
distributions (or RDP). A task's composed distribution is kept (``_sampled_pld``): the next
commit composes one more round onto it, as a ``PLDAccountant`` fed one event per commit does,
instead of composing every round again; the distribution's support still widens with the rounds,
so a commit costs more late in a long task, only not the whole composition again. The sampled
PLD's grid grows as 1 / z^2, so a sampled task takes ``MIN_SAMPLED_NOISE_MULTIPLIER`` at least.

DP-FTRL (``tree_rounds``, ``server_stub.central_dp.tree_step``) is accounted per tree: a tree of n
rounds is one ``SingleEpochTreeAggregationDpEvent`` at z with n steps, which assumes each device
takes part in at most one round of a tree (the eligibility policies must enforce that, as for
sampling), and the trees compose. dp-accounting has it for RDP only, under its
``REPLACE_SPECIAL`` neighbouring (one device's updates replaced by nothing): the tree's epsilon
is RdpAccountant's whatever ``method`` says.

Pure: values in, values out. ``PrivacyLedger`` is a frozen value a task keeps (its rounds per
noise multiplier), so a server can persist it as its counts and rebuild it after a restart.
"""

from __future__ import annotations

import collections
import functools
import math
import numbers
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # dp_accounting (and the scipy it loads) is imported where used: about a second of
    # start-up that every server and CLI process without a DP task would pay
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

Method = Literal["pld", "rdp"]

#: The PLD's grid of privacy-loss values for sampled rounds: dp-accounting's default.
PLD_DISCRETIZATION = 1e-4
#: The least noise multiplier above 0 a task takes (``DPConfig``): one round below it is already epsilon
#: above 5000 at delta 1e-5, no privacy worth the name, and near 1e-300 the composition underflows.
MIN_NOISE_MULTIPLIER = 0.01
#: The least noise multiplier above 0 a task with ``sampling_probability`` takes: the sampled round's
#: PLD grows as 1 / z^2 (measured: 0.3 builds in about 5 s and 290 MB once per process, 0.1 in 20 s
#: and 530 MB, 1e-3 asks for 38 GiB), and one sampled round below it costs epsilon above 10 anyway.
MIN_SAMPLED_NOISE_MULTIPLIER = 0.3
#: How many tasks' composed sampled PLDs a process keeps (each up to tens of MB in a long task).
PLD_CACHE_SIZE = 4


class AccountingError(ValueError):
    """An accounting parameter out of range; the message names it."""


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}")


def _check_noise(noise_multiplier: float) -> None:
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise AccountingError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")


def _check_sampling(q: float | None) -> None:
    if q is not None and not (0.0 < q <= 1.0):
        raise AccountingError(f"sampling_probability must be in (0, 1], got {q!r}")


def _check_count(name: str, value: object) -> None:
    """A number of rounds: an int >= 0 (a float, NaN among them, or a bool is refused: NaN rounds
    once read as no rounds at all, epsilon 0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise AccountingError(f"{name} must be an integer >= 0, got {value!r}")


def _check_method(method: str) -> None:
    if method not in ("pld", "rdp"):
        raise AccountingError(f"method must be 'pld' or 'rdp', got {method!r}")


def composed_noise_multiplier(rounds: dict[float, int]) -> float:
    """The one Gaussian mechanism's multiplier that k unsampled rounds compose to:
    (sum_i count_i / z_i^2)^-1/2; 0 if any round had no noise; inf for no rounds."""
    total = 0.0
    for z, count in rounds.items():
        if count <= 0:
            continue
        if z == 0:
            return 0.0
        total += count / z / z  # overflows to inf for a tiny z, where z * z would underflow to 0
    if total == 0:
        return math.inf
    return 0.0 if math.isinf(total) else total**-0.5


@functools.lru_cache(maxsize=32)
def _sampled_round_pld(noise_multiplier: float, q: float) -> pld_lib.PrivacyLossDistribution:
    """One Poisson-sampled Gaussian round's PLD (a second or two to build, so built once)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sampling_prob=q,
        value_discretization_interval=PLD_DISCRETIZATION,
    )


#: Below this composed multiplier dp-accounting's analytic-Gaussian solver fails to converge; the
#: epsilon there is above 1e199, and inf is the bound reported.
_SMALLEST_SOLVED = 1e-100

_Counts = tuple[tuple[float, int], ...]
_composed: collections.OrderedDict[tuple[float, _Counts], pld_lib.PrivacyLossDistribution] = collections.OrderedDict()
_composed_lock = threading.Lock()


def _sampled_pld(live: dict[float, int], q: float) -> pld_lib.PrivacyLossDistribution:
    """The composed PLD of ``live`` rounds (multiplier -> count, all > 0) sampled at ``q``. Kept
    per (q, counts) for the ``PLD_CACHE_SIZE`` latest: when the counts are one round more than
    kept ones, that round is composed onto them (the commit's case); otherwise each multiplier's
    round is self-composed (after a restart, or for counts never seen)."""
    counts: _Counts = tuple(sorted(live.items()))
    with _composed_lock:
        hit = _composed.get((q, counts))
        if hit is not None:
            _composed.move_to_end((q, counts))
            return hit
        base: tuple[pld_lib.PrivacyLossDistribution, float] | None = None
        for z, _ in counts:
            fewer = tuple((w, n - (w == z)) for w, n in counts if n - (w == z) > 0)
            kept = _composed.get((q, fewer))
            if kept is not None:
                base = (kept, z)
                break
    if base is not None:
        composed = base[0].compose(_sampled_round_pld(base[1], q))
    else:
        parts = [_sampled_round_pld(z, q).self_compose(c) for z, c in counts]
        composed = functools.reduce(lambda a, b: a.compose(b), parts)
    with _composed_lock:
        _composed[(q, counts)] = composed
        while len(_composed) > PLD_CACHE_SIZE:
            _composed.popitem(last=False)
    return composed


def _rdp_epsilon(acc: rdp_lib.RdpAccountant, delta: float) -> float:
    """``acc``'s epsilon at ``delta`` over the orders whose Renyi divergence it computed as a number
    >= 0. For a tiny sampling probability at a large multiplier (q 1e-7 at z 4000, say) its sum for
    the divergence cancels to below 0 at some orders, and dp-accounting converts a negative
    divergence to epsilon 0 whatever the delta: an epsilon of 0 where the mechanism is not
    (0, delta)-DP. The conversion at each order is a bound on its own, so the least over the others
    still is; inf if none is left."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    rdp, orders = acc.rdp, acc.orders
    sound = rdp >= 0  # NaN compares False
    if not sound.any():
        return math.inf
    return float(rdp_lib.compute_epsilon(orders[sound], rdp[sound], delta)[0])


@functools.lru_cache(maxsize=1024)
def _cached_epsilon(counts: _Counts, delta: float, q: float | None, method: Method) -> float:
    """``_epsilon`` per counts: a round's budget check and its metrics read the same ledger value."""
    return _epsilon(dict(counts), delta, q, method)


def _epsilon(rounds: dict[float, int], delta: float, q: float | None, method: Method) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    live = {z: c for z, c in rounds.items() if c > 0}
    if not live:
        return 0.0
    if any(z == 0 for z in live):
        return math.inf
    if q is None or q == 1.0:
        z_eff = composed_noise_multiplier(live)
        if z_eff < _SMALLEST_SOLVED:
            return math.inf
        if method == "pld":
            return float(dp_accounting.get_epsilon_gaussian(z_eff, delta))
        acc = rdp_lib.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(z_eff))
        return _rdp_epsilon(acc, delta)
    pld = math.inf if method == "rdp" else float(_sampled_pld(live, q).get_epsilon_for_delta(delta))
    if math.isfinite(pld):
        return pld
    # RDP, asked for, or where the PLD has none: its grid moves the mass of the tails it truncates
    # (about 1e-15 a round) to infinity, so a delta below that mass had epsilon inf, published as
    # null, which reads as no noise at all. RDP's bound holds at any delta.
    acc = rdp_lib.RdpAccountant()
    for z, count in sorted(live.items()):
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        acc.compose(event, count)
    return _rdp_epsilon(acc, delta)


@functools.lru_cache(maxsize=256)
def tree_epsilon(trees: tuple[tuple[float, int], ...], delta: float) -> float:
    """Epsilon at ``delta`` of DP-FTRL trees, each (z, rounds): one ``SingleEpochTreeAggregationDpEvent``
    per tree, composed by ``RdpAccountant`` (0 before any round; inf if a tree had no noise)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    _check_delta(delta)
    for z, n in trees:
        _check_noise(z)
        _check_count("a tree's rounds", n)
    live = [(z, n) for z, n in trees if n > 0]
    if not live:
        return 0.0
    if any(z == 0 for z, _ in live):
        return math.inf
    acc = rdp_lib.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    for z, n in live:
        acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, n))
    return _rdp_epsilon(acc, delta)


def epsilon(
    noise_multiplier: float,
    rounds: int,
    delta: float,
    *,
    sampling_probability: float | None = None,
    method: Method = "pld",
) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds of the Gaussian mechanism at
    ``noise_multiplier`` (no amplification by sampling unless ``sampling_probability`` is given;
    see the module docstring for what that assumes). A multiplier of 0 is no privacy: inf."""
    _check_delta(delta)
    _check_noise(noise_multiplier)
    _check_sampling(sampling_probability)
    _check_method(method)
    _check_count("rounds", rounds)
    return _epsilon({noise_multiplier: rounds}, delta, sampling_probability, method)


def rounds_within(
    max_epsilon: float,
    noise_multiplier: float,
    delta: float,
    *,
    sampling_probability: float | None = None,
    method: Method = "pld",
    limit: int = 1_000_000,
) -> int:
    """The most rounds at ``noise_multiplier`` whose epsilon at ``delta`` stays within
    ``max_epsilon`` (0 if not even one does; at most ``limit``). Without sampling and with PLD
    this is closed-form: k rounds are one Gaussian at z / sqrt(k), so k = floor((z / s)^2) where
    s is the multiplier one Gaussian needs for (max_epsilon, delta); otherwise a bisection."""
    _check_delta(delta)
    _check_noise(noise_multiplier)
    _check_sampling(sampling_probability)
    _check_method(method)
    if not (max_epsilon > 0 and math.isfinite(max_epsilon)):
        raise AccountingError(f"max_epsilon must be a positive finite number, got {max_epsilon!r}")
    if noise_multiplier == 0:
        return 0

    def within(k: int) -> bool:
        return (
            epsilon(
                noise_multiplier,
                k,
                delta,
                sampling_probability=sampling_probability,
                method=method,
            )
            <= max_epsilon
        )

    lo, hi = 0, 1
    if (sampling_probability is None or sampling_probability == 1.0) and method == "pld":
        import dp_accounting

        s = float(dp_accounting.get_sigma_gaussian(max_epsilon, delta))
        guess = min(limit, int(math.floor((noise_multiplier / s) ** 2)))
        lo, hi = (
            max(0, guess - 2),
            min(limit, guess + 2),
        )  # the float closed form, checked near its answer
        while lo > 0 and not within(lo):
            lo -= 1
        while lo < hi and within(lo + 1):
            lo += 1
        return lo
    while hi <= limit and within(hi):  # bracket, then bisect: epsilon grows with the rounds
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if within(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class PrivacyLedger:
    """A task's privacy spend: how many committed rounds ran at each noise multiplier.

    ``add_round(z)`` returns the ledger with one more round; ``epsilon`` is read (and cached) per
    ledger value. Without sampling a read costs one analytic-Gaussian solve whatever the number of
    rounds; with ``sampling_probability`` (PLD) it composes one round onto the distribution the
    ledger one round shorter had, kept per process (``_sampled_pld``): each multiplier's one-round
    distribution is built once per process, and the whole composition only after a restart."""

    delta: float
    sampling_probability: float | None = None
    method: Method = "pld"
    max_epsilon: float | None = None
    counts: tuple[tuple[float, int], ...] = ()
    tree_rounds: int | None = None
    trees: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        _check_delta(self.delta)
        _check_sampling(self.sampling_probability)
        _check_method(self.method)
        if self.max_epsilon is not None and not (self.max_epsilon > 0 and math.isfinite(self.max_epsilon)):
            raise AccountingError(f"max_epsilon must be a positive finite number, got {self.max_epsilon!r}")
        for z, c in (*self.counts, *self.trees):
            _check_noise(z)
            _check_count("a round count", c)
        if self.tree_rounds is not None and self.tree_rounds < 1:
            raise AccountingError(f"tree_rounds must be >= 1, got {self.tree_rounds}")

    @property
    def rounds(self) -> int:
        return sum(c for _, c in self.counts)

    def add_round(self, noise_multiplier: float, count: int = 1) -> PrivacyLedger:
        """The ledger after ``count`` more committed rounds at ``noise_multiplier``."""
        _check_noise(noise_multiplier)
        _check_count("count", count)
        merged = dict(self.counts)
        merged[noise_multiplier] = merged.get(noise_multiplier, 0) + count
        return replace(self, counts=tuple(sorted(merged.items())))

    def add_tree_round(self, noise_multiplier: float, new_tree: bool) -> PrivacyLedger:
        """The ledger of a DP-FTRL task after one more committed round: in a new tree when
        ``new_tree`` (the server lost the last tree's noise, or it starts the task), when the last
        tree holds ``tree_rounds`` rounds or ran at another multiplier; else in the last tree."""
        if self.tree_rounds is None:
            raise AccountingError("add_tree_round is for a ledger with tree_rounds")
        last = self.trees[-1] if self.trees else None
        if new_tree or last is None or last[0] != noise_multiplier or last[1] >= self.tree_rounds:
            trees = (*self.trees, (noise_multiplier, 1))
        else:
            trees = (*self.trees[:-1], (noise_multiplier, last[1] + 1))
        return replace(self.add_round(noise_multiplier), trees=trees)

    @property
    def epsilon(self) -> float:
        """Epsilon at ``delta`` for the rounds so far (0 before any; inf after a noiseless one)."""
        if self.tree_rounds is not None:  # both reads are cached per counts, so a round's budget
            return tree_epsilon(self.trees, self.delta)  # check and its metrics solve once
        return _cached_epsilon(self.counts, self.delta, self.sampling_probability, self.method)

    def allows(self, noise_multiplier: float, *, new_tree: bool = False) -> bool:
        """Whether one more round at ``noise_multiplier`` (for DP-FTRL: in a new tree or not)
        stays within ``max_epsilon`` (always, without a budget): the check a task makes before it
        starts a round, so it stops at its budget instead of overshooting it."""
        if self.max_epsilon is None:
            return True
        after = (
            self.add_tree_round(noise_multiplier, new_tree)
            if self.tree_rounds is not None
            else self.add_round(noise_multiplier)
        )
        return after.epsilon <= self.max_epsilon


__all__ = [
    "MIN_NOISE_MULTIPLIER",
    "MIN_SAMPLED_NOISE_MULTIPLIER",
    "AccountingError",
    "Method",
    "PrivacyLedger",
    "composed_noise_multiplier",
    "epsilon",
    "rounds_within",
    "tree_epsilon",
]
