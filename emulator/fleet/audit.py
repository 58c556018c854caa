"""The one-shot empirical privacy audit of Andrew, Kairouz, Oh, Oprea, McMahan and Suriyakumar
("One-shot Empirical Privacy Estimation for Federated Learning", ICLR 2024).

Canary clients join an ordinary training run: each holds a random unit direction in the model's
parameter space (drawn from the audit's seed) and, whenever it is selected, reports that direction
scaled to the clip instead of a trained update. After the run, the final model's delta (final
weights minus initial) is compared with every canary: the cosine with an inserted canary carries
its contributions, the cosine with a fresh canary (drawn from the same seed, never inserted) is
null, about N(0, 1/d) in d dimensions. The estimate fits a Gaussian N(mu, sigma^2) to the inserted
canaries' cosines and reports the epsilon at delta of the Gaussian mechanism that separates it from
the null: sensitivity mu over noise sigma, that is noise multiplier sigma / mu, whose epsilon
``dp_accounting`` gives (``server_stub.accounting.epsilon``, one round). The paper proves the estimate
right for the Gaussian mechanism in high dimension; here it checks the accountant from the other
side: with the noise on it stays below the accountant's epsilon (which assumes the adversary sees
every round and a device in all of them), with the noise off it is large, so the audit can fail.

Pure: values in, values out (directions from a seed; cosines and the estimate from arrays).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from server_stub.accounting import epsilon as gaussian_epsilon

FloatArray = npt.NDArray[np.float64]
#: Keeps the canaries' stream apart from every other use of the fleet's seed.
_CANARY_STREAM = 0xCA9A21E5


class AuditError(ValueError):
    """Audit inputs that cannot give an estimate; the message says what to change."""


def canary_direction(seed: int, index: int, dim: int) -> FloatArray:
    """Canary ``index``'s unit direction in ``dim`` dimensions, from the audit's ``seed``: isotropic
    (a normalized standard Gaussian), the same for the device that reports it and the auditor."""
    if dim < 1:
        raise AuditError(f"dim must be >= 1, got {dim}")
    if index < 0:
        raise AuditError(f"index must be >= 0, got {index}")
    v = np.random.default_rng([_CANARY_STREAM, seed, index]).standard_normal(dim)
    out: FloatArray = v / np.linalg.norm(v)
    return out


def canary_directions(seed: int, count: int, dim: int, *, start: int = 0) -> FloatArray:
    """Canaries ``start`` to ``start + count - 1``, one per row. The fleet inserts indices 0..K-1;
    the null canaries are the next ones, never inserted."""
    if count < 0:
        raise AuditError(f"count must be >= 0, got {count}")
    return np.array([canary_direction(seed, start + i, dim) for i in range(count)]).reshape(count, dim)


def flatten(arrays: Mapping[str, npt.ArrayLike], names: Sequence[str]) -> FloatArray:
    """The model's parameters ``names`` (in that order) as one float64 vector."""
    return np.concatenate([np.asarray(arrays[n], dtype=np.float64).reshape(-1) for n in names])


def unflatten(
    vector: npt.ArrayLike, shapes: Mapping[str, tuple[int, ...]], names: Sequence[str]
) -> dict[str, FloatArray]:
    """The inverse of ``flatten``: ``vector`` cut into the parameters ``names`` of ``shapes``."""
    v = np.asarray(vector, dtype=np.float64).reshape(-1)
    out: dict[str, FloatArray] = {}
    at = 0
    for n in names:
        size = math.prod(shapes[n])
        out[n] = v[at : at + size].reshape(shapes[n])
        at += size
    if at != v.size:
        raise AuditError(f"the vector has {v.size} entries; the parameters hold {at}")
    return out


def cosines(delta: npt.ArrayLike, directions: npt.ArrayLike) -> FloatArray:
    """The cosine of the model's ``delta`` with each row of ``directions`` (unit rows)."""
    d = np.asarray(delta, dtype=np.float64).reshape(-1)
    rows = np.asarray(directions, dtype=np.float64)
    norm = float(np.linalg.norm(d))
    if not math.isfinite(norm):
        raise AuditError("the model's delta is not finite")
    if norm == 0.0:
        return np.zeros(rows.shape[0])
    out: FloatArray = rows @ d / norm
    return out


@dataclass(frozen=True)
class AuditEstimate:
    """The one-shot estimate: ``epsilon`` at ``delta``; the inserted canaries' cosines' ``mean`` and
    ``std`` (the fitted Gaussian), the noise multiplier ``std / mean`` of the Gaussian mechanism
    that separates them from the null (inf: no signal at all), and the null's ``null_mean`` /
    ``null_std`` (the fresh canaries' when given, else N(0, 1/d)) for a reader to compare."""

    epsilon: float
    delta: float
    canaries: int
    mean: float
    std: float
    noise_multiplier: float
    null_mean: float
    null_std: float


def one_shot_epsilon(
    inserted: npt.ArrayLike,
    *,
    delta: float,
    dim: int,
    null: npt.ArrayLike | None = None,
) -> AuditEstimate:
    """Epsilon at ``delta`` from the inserted canaries' cosines (at least 2) with the final delta.

    A mean cosine at or below 0 is no evidence of the canaries at all: epsilon 0. A spread of 0
    with a positive mean separates them perfectly: epsilon inf."""
    c = np.asarray(inserted, dtype=np.float64).reshape(-1)
    if c.size < 2:
        raise AuditError(f"need the cosines of at least 2 inserted canaries to fit a Gaussian, got {c.size}")
    if not np.isfinite(c).all():
        raise AuditError("the canaries' cosines are not finite")
    if dim < 1:
        raise AuditError(f"dim must be >= 1, got {dim}")
    mean, std = float(c.mean()), float(c.std(ddof=1))
    if null is None:
        null_mean, null_std = 0.0, 1.0 / math.sqrt(dim)
    else:
        n = np.asarray(null, dtype=np.float64).reshape(-1)
        null_mean = float(n.mean()) if n.size else 0.0
        null_std = float(n.std(ddof=1)) if n.size > 1 else 1.0 / math.sqrt(dim)
    if mean <= 0.0:
        z, eps = math.inf, 0.0
    elif std == 0.0:
        z, eps = 0.0, math.inf
    else:
        z = std / mean
        eps = gaussian_epsilon(z, 1, delta)
    return AuditEstimate(
        epsilon=eps,
        delta=delta,
        canaries=int(c.size),
        mean=mean,
        std=std,
        noise_multiplier=z,
        null_mean=null_mean,
        null_std=null_std,
    )


def per_participation(inserted: npt.ArrayLike, participations: npt.ArrayLike) -> FloatArray:
    """The cosines of the canaries that took part, each scaled to the mean participation count:
    a canary's signal grows with the rounds its report was summed in, and in a fleet (where a canary
    takes part only when selected) that count varies from canary to canary. Left alone, the spread of
    the counts widens the fitted Gaussian, which the Gaussian mechanism it stands for does not have,
    and caps the estimate whatever the noise; scaled, each canary speaks for the mean count. The
    auditor knows the counts (it ran the canaries); canaries that never took part carry nothing and
    are left out."""
    c = np.asarray(inserted, dtype=np.float64).reshape(-1)
    m = np.asarray(participations, dtype=np.float64).reshape(-1)
    if m.size != c.size:
        raise AuditError(f"{m.size} participation counts for {c.size} canaries")
    took_part = m > 0
    out: FloatArray = c[took_part] * (m[took_part].mean() / m[took_part]) if took_part.any() else c[:0]
    return out


def audit(
    initial: npt.ArrayLike,
    final: npt.ArrayLike,
    *,
    seed: int,
    canaries: int,
    delta: float,
    null_canaries: int | None = None,
    participations: npt.ArrayLike | None = None,
) -> AuditEstimate:
    """The whole audit of one run: the model's delta (``final`` - ``initial``, flat), its cosines with
    the ``canaries`` inserted ones (indices 0..K-1 of ``seed``) and with as many fresh ones
    (``null_canaries``, default the same count), and the estimate. ``participations``: how many of
    each canary's reports were summed into committed rounds, when they varied (see
    ``per_participation``); None when every canary took part alike (the paper's setting)."""
    d = np.asarray(final, dtype=np.float64).reshape(-1) - np.asarray(initial, dtype=np.float64).reshape(-1)
    k_null = canaries if null_canaries is None else null_canaries
    inserted = cosines(d, canary_directions(seed, canaries, d.size))
    if participations is not None:
        inserted = per_participation(inserted, participations)
    null = cosines(d, canary_directions(seed, k_null, d.size, start=canaries))
    return one_shot_epsilon(inserted, delta=delta, dim=d.size, null=null)


__all__ = [
    "AuditError",
    "AuditEstimate",
    "audit",
    "canary_direction",
    "canary_directions",
    "cosines",
    "flatten",
    "one_shot_epsilon",
    "per_participation",
    "unflatten",
]
