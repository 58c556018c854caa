"""Who masks with whom: the complete graph (Bonawitz et al. 2017) or SecAgg+ (Bell et al. 2020).

SecAgg+ replaces the complete graph by a random Harary graph H(n, k): the n clients are placed
on a ring in a uniformly random order and each is joined to the k/2 nearest clients on either
side (k even), so the graph is k-regular and connected. Masks and key shares are exchanged only
between neighbours and the Shamir threshold t applies per neighbourhood (a client's shares are
held by itself and its k neighbours).

Parameter choice (``secagg_plus_parameters``), following the analysis of Bell et al. 2020
(Sec. 3, Thm. 3.6 and the numerical parameter tables it derives), with the hypergeometric
sampling of a neighbourhood approximated by a binomial and a union bound over the n clients:

  security    : P[Bin(k, gamma) >= t]     <= 2^-sigma / n   (no neighbourhood holds t corrupt
                                                             clients, so colluders never rebuild
                                                             an honest secret)
  correctness : P[Bin(k, 1 - delta) < t]  <= 2^-eta / n     (every neighbourhood keeps t
                                                             survivors, so dropped clients can be
                                                             unmasked)
  majority    : 2t > k + 1                                 (a server cannot collect t shares of
                                                             both b_u and s_u from two disjoint
                                                             groups of honest neighbours)
  split       : P[Bin(k, gamma) >= 2t - (k+1)] <= 2^-sigma / n  (a malicious server that tells
                                                             some of u's holders that u survived
                                                             and others that it dropped gets t
                                                             shares of both only if the holders
                                                             answering both ways, all corrupt,
                                                             number 2t - (k+1); ConsistencyCheck
                                                             cannot stop this inside a sparse
                                                             graph, so t must leave no room)

We take the smallest even k (and for it the smallest t) meeting all four (the split bound only
with ``malicious_server``, the default: Bell et al.'s semi-honest parameters omit it); the tails shrink
exponentially in k while the union bound grows with n, so k = O(log n). When that k is >= n - 1
the complete graph is used with t past 2n/3 and past n(1 + gamma)/2 (``complete_graph_threshold``:
with ConsistencyCheck, a server splitting the survivor list gets t shares from each half of the
honest clients with its colluders' unless 2t > n + gamma n; Bonawitz et al.'s t > 2n/3 is that
at gamma = 1/3).
Defaults: gamma = 1/3 corrupt, delta = 5% drop-out, sigma = 40, eta = 30.
The search (``least_secagg_plus_degree``) bisects on t for each k, skips a k when a few binomial
terms prove it has no threshold, and stops at the degree past which the bounds contradict each
other; a device judging a server's degree searches no further than that degree.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def _log_binom_pmf(k: int, i: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if i == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if i == k else -math.inf
    return math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1) + i * math.log(p) + (k - i) * math.log1p(-p)


_lgamma_table = np.zeros(1)  # lgamma(i + 1) for i = 0.., grown on demand


def _lgammas(k: int) -> np.ndarray:
    """math.lgamma(i + 1) for i = 0..k (the same floats, computed once each)."""
    global _lgamma_table
    table = _lgamma_table  # one read: another thread may replace it meanwhile
    have = len(table)
    if have <= k:
        more = [math.lgamma(i + 1) for i in range(have, max(k + 1, 2 * have))]
        table = np.concatenate([table, np.asarray(more)])
        if len(table) > len(_lgamma_table):
            _lgamma_table = table
    return table[: k + 1]


@functools.lru_cache(maxsize=64)
def _binom_pmf(k: int, p: float) -> tuple[float, ...]:
    """P[Bin(k, p) = i] for i = 0..k: every tail of one (k, p) sums these, so the k + 1 terms are
    computed once, not once per threshold. (64 entries: at most 64 (k + 1) floats held.) The logs
    are ``_log_binom_pmf``'s, bit for bit: the same lgammas, subtracted and added in the same
    order, one array operation each; the exponentials are math.exp's, as numpy's may differ in
    the last bit."""
    if not 0.0 < p < 1.0:
        return tuple(math.exp(_log_binom_pmf(k, i, p)) for i in range(k + 1))
    lg = _lgammas(k)
    i = np.arange(k + 1, dtype=np.float64)
    logs = lg[k] - lg - lg[::-1] + i * math.log(p) + (k - i) * math.log1p(-p)
    return tuple(map(math.exp, logs.tolist()))


def binom_tail_ge(k: int, t: int, p: float) -> float:
    """P[Bin(k, p) >= t] (the terms summed from i = t up, in that order).

    As computed it never grows with t: each partial sum of the longer tail is at least the
    shorter tail's (rounding to nearest is monotone), which is what lets the parameter search
    bisect on t instead of trying each threshold."""
    if t <= 0:
        return 1.0
    return min(1.0, sum(_binom_pmf(k, p)[t:]))


#: How far above the correctness bound a single term of the survivors' lower tail must be before
#: it proves that bound fails: the computed tail (k + 1 terms, each within lgamma's few ulps of
#: k log k of its log, summed with k rounding errors) is off by less than 2^-20 for k < 2^26.
_MARGIN = 2.0**-16
_CERTIFIED_UP_TO = 2**26


def _certainly_too_few_survivors(
    k: int, gamma: float, q: float, sec_bound: float, cor_bound: float, malicious_server: bool
) -> bool:
    """True only if degree ``k`` has no threshold (O(log k) terms instead of the k + 1 a search
    for t needs). A single term bounds a computed tail from below, bit for bit: if
    P[Bin(k, gamma) = i] > sec_bound, every threshold t <= i (and with ``malicious_server`` every
    t with 2t - (k + 1) <= i) fails the security or the split bound, so the least t meeting both
    is at least ``least``; if even there a single term of the survivors' lower tail is far above
    any correctness bound, that t fails correctness, and so does every larger one."""
    if not (0.0 < gamma < 1.0 and 0.0 < q < 1.0 and k < _CERTIFIED_UP_TO):
        return False
    mode = min(k, int((k + 1) * gamma))
    if math.exp(_log_binom_pmf(k, mode, gamma)) <= sec_bound:
        return False
    lo, hi = mode, k + 1  # the term at lo is above the bound; past the mode the terms fall
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if math.exp(_log_binom_pmf(k, mid, gamma)) > sec_bound:
            lo = mid
        else:
            hi = mid
    least = max(k // 2 + 1, (lo + k + 3) // 2 if malicious_server else lo + 1)
    i = min(least - 2, int((k + 1) * q))  # the lower tail's largest term at or below t - 2
    return i >= 0 and math.exp(_log_binom_pmf(k, i, q)) > cor_bound + _MARGIN


def _smallest_threshold(
    k: int, n: int, gamma: float, delta: float, sigma: int, eta: int, malicious_server: bool = True
) -> int | None:
    """The least t >= k/2 + 1 meeting the security and split bounds, if it meets correctness.
    Both tails fall as t grows (see ``binom_tail_ge``) and correctness only worsens, so the least
    t is found by bisecting for the first index j whose tail is within the bound: O(log k) tails,
    where trying each t summed O(k) tails of O(k) terms."""
    sec_bound = 2.0**-sigma / n
    cor_bound = 2.0**-eta / n
    t_min = k // 2 + 1  # majority of the k + 1 holders (the client and its k neighbours)
    lo, hi = 0, k + 1  # tail(0) = 1 is above the bound, tail(k + 1) = 0 is within it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if binom_tail_ge(k, mid, gamma) > sec_bound:
            lo = mid
        else:
            hi = mid
    t = max(t_min, hi, -(-(hi + k + 1) // 2) if malicious_server else hi)
    # survivors among the k neighbours plus the client itself must reach t
    if 1.0 - binom_tail_ge(k, t - 1, 1.0 - delta) > cor_bound:
        return None  # larger t only makes correctness worse
    return t


def _never_above(gamma: float, delta: float, malicious_server: bool) -> int | None:
    """A degree no feasible k exceeds, or None. A binomial's median lies between the floor and
    the ceiling of its mean, so a tail from either side of it is at least 1/2, far above any
    bound. Correctness then needs t - 2 < ceil(k q) (q = 1 - delta), so t < k q + 2; the
    majority needs t >= k/2 + 1, security t > floor(k gamma), so t > k gamma, and the split
    bound 2t - (k + 1) > floor(k gamma). Together: k (1/2 - q) < 1, k (gamma - q) < 2 and, with
    ``malicious_server``, k (1 + gamma - 2q) < 3. (In exact fractions of the floats the tails
    use.)"""
    g, q = Fraction(gamma), Fraction(1.0 - delta)
    limits = [(Fraction(1, 2) - q, 1), (g - q, 2)] + ([(1 + g - 2 * q, 3)] if malicious_server else [])
    bounds = [math.floor(c / slack) for slack, c in limits if slack > 0]
    return min(bounds) if bounds else None


def least_secagg_plus_degree(
    n: int,
    corrupt_fraction: float = 1 / 3,
    dropout_rate: float = 0.05,
    sigma: int = 40,
    eta: int = 30,
    *,
    malicious_server: bool = True,
    up_to: int | None = None,
) -> tuple[int, int] | None:
    """The smallest even degree k < n (and its threshold) meeting the bounds of the module
    docstring, looking no further than ``up_to``; None if there is none.

    A device judging a server's degree k only asks whether some degree up to k qualifies, so
    its cost is bounded by the k it was sent, not by n. Degrees are skipped without their
    k + 1 terms when a few terms prove they have no threshold, and not tried at all past the
    degree where the bounds contradict each other (``_never_above``)."""
    last = n - 1 if up_to is None else min(n - 1, up_to)
    never = _never_above(corrupt_fraction, dropout_rate, malicious_server)
    if never is not None:
        last = min(last, never)
    sec_bound = 2.0**-sigma / n
    cor_bound = 2.0**-eta / n
    q = 1.0 - dropout_rate
    for k in range(2, last + 1, 2):
        if _certainly_too_few_survivors(k, corrupt_fraction, q, sec_bound, cor_bound, malicious_server):
            continue
        t = _smallest_threshold(k, n, corrupt_fraction, dropout_rate, sigma, eta, malicious_server)
        if t is not None:
            return k, t
    return None


@dataclass(frozen=True)
class GraphParameters:
    """Degree k (k = n - 1 means the complete graph) and per-neighbourhood threshold t."""

    n: int
    degree: int
    threshold: int

    @property
    def complete(self) -> bool:
        return self.degree >= self.n - 1


def complete_graph_threshold(n: int, corrupt_fraction: float = 1 / 3) -> int:
    """Default t for the complete graph: more than 2n/3 (Bonawitz et al.: secure against an
    actively malicious server colluding with up to n/3 clients), at least 2; with a larger
    ``corrupt_fraction`` c, more than n(1 + c)/2: a server showing two halves of the honest clients
    two survivor lists (one holding a client, one not) gets t shares from each half with its
    colluders', who give theirs to both, unless 2t > n + cn. Counted exactly, as the fraction
    written (0.4 is 2/5): in floats 90 x 1.4 / 2 is 62.99..., and t = 63 let 36 colluders reach it
    with either half."""
    half = n * (1 + Fraction(str(corrupt_fraction))) / 2
    return max(2, min(n, max((2 * n) // 3, math.floor(half)) + 1))


def secagg_plus_parameters(
    n: int,
    corrupt_fraction: float = 1 / 3,
    dropout_rate: float = 0.05,
    sigma: int = 40,
    eta: int = 30,
    *,
    malicious_server: bool = True,
) -> GraphParameters:
    """Degree and threshold for a cohort of ``n`` (see the module docstring for the formula)."""
    if n < 2:
        raise ValueError("need at least 2 clients")
    least = least_secagg_plus_degree(n, corrupt_fraction, dropout_rate, sigma, eta, malicious_server=malicious_server)
    if least is not None:
        return GraphParameters(n, *least)
    return GraphParameters(n, n - 1, complete_graph_threshold(n, corrupt_fraction))


def harary_neighbours(
    ids: Sequence[int], degree: int, random_bytes: Callable[[int], bytes]
) -> dict[int, tuple[int, ...]]:
    """Random H(n, k): ids on a ring in random order, each joined to k/2 on either side.

    Returns id -> sorted neighbour ids (excluding itself). ``degree`` >= n - 1 gives the
    complete graph.
    """
    ids = sorted(ids)
    n = len(ids)
    if degree >= n - 1:
        return {u: tuple(v for v in ids if v != u) for u in ids}
    if degree % 2 or degree < 2:
        raise ValueError("degree must be even and >= 2")
    keys = np.frombuffer(random_bytes(8 * n), dtype=np.uint64)
    ring = np.asarray(ids, dtype=np.int64)[np.argsort(keys, kind="stable")]
    return _ring_neighbours(ring, degree)


def keyed_ring(ids: Sequence[int], key: bytes) -> np.ndarray:
    """The ids in ring order: sorted by AES-256_key(id), a pseudorandom order nobody can steer
    without changing ``key`` (which the driver derives from a committed seed and every
    advertised key, so any change to the roster reshuffles the whole ring)."""
    ordered = np.asarray(sorted(ids), dtype=np.int64)
    blocks = np.zeros((len(ordered), 2), dtype="<u8")
    blocks[:, 0] = ordered
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    out = np.frombuffer(enc.update(blocks.tobytes()) + enc.finalize(), dtype="<u8").reshape(-1, 2)
    ring: np.ndarray = ordered[np.lexsort((out[:, 1], out[:, 0]))]
    return ring


def seeded_harary(ids: Sequence[int], degree: int, key: bytes) -> dict[int, tuple[int, ...]]:
    """H(n, k) on the ring ``keyed_ring(ids, key)``: every client can recompute it from the key
    and the ids, so a server cannot hand-pick anyone's neighbours (Bell et al. 2020 assume the
    graph is sampled honestly; this makes that checkable)."""
    n = len(ids)
    if degree >= n - 1:
        return {u: tuple(v for v in sorted(ids) if v != u) for u in ids}
    if degree % 2 or degree < 2:
        raise ValueError("degree must be even and >= 2")
    return _ring_neighbours(keyed_ring(ids, key), degree)


def _ring_neighbours(ring: np.ndarray, degree: int) -> dict[int, tuple[int, ...]]:
    n = len(ring)
    half = degree // 2
    offsets = np.concatenate([np.arange(-half, 0), np.arange(1, half + 1)])
    idx = (np.arange(n)[:, None] + offsets[None, :]) % n
    nbrs = np.sort(ring[idx], axis=1)
    return {int(u): tuple(int(v) for v in row) for u, row in zip(ring, nbrs)}


def group_key(seed: bytes, members: Sequence[bytes]) -> bytes:
    """The key that orders a round's devices into groups: the revealed seed mixed with every
    member's key, so a change to any member reshuffles every group."""
    h = hashlib.sha256(b"secagg/groups\x00" + seed)
    for m in sorted(members):
        h.update(len(m).to_bytes(2, "little") + m)
    return h.digest()


def assign_groups(seed: bytes, members: Sequence[bytes], min_size: int, spare: int = 0) -> list[list[bytes]]:
    """Split ``members`` (distinct keys) into as many groups of at least ``min_size + spare`` as
    possible (one group when there are at least ``min_size`` but fewer than that), in the
    pseudorandom order ``group_key`` gives: every device can recompute its group from the
    revealed seed and the member list, and nobody picks who shares its group. ``spare``: members
    a group can lose and still sum ``min_size``."""
    if min_size < 1 or spare < 0:
        raise ValueError("min_size must be >= 1 and spare >= 0")
    if len(set(members)) != len(members):
        raise ValueError("member keys must be distinct")
    count = len(members) // (min_size + spare) or (1 if len(members) >= min_size else 0)
    if count == 0:
        return []
    key = group_key(seed, members)
    order = sorted(members, key=lambda m: hashlib.sha256(key + m).digest())
    size, extra = divmod(len(order), count)
    out, at = [], 0
    for i in range(count):
        end = at + size + (1 if i < extra else 0)
        out.append(order[at:end])
        at = end
    return out


def group_seed(seed: bytes, index: int) -> bytes:
    """The graph seed of group ``index``, derived from the round's revealed seed."""
    return hashlib.sha256(b"secagg/group-seed\x00" + seed + index.to_bytes(4, "little")).digest()
