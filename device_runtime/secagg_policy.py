"""The device's privacy floor for Secure Aggregation: what the app (or the SDK's default) holds,
never the server.

A server that sends a weak configuration (a threshold of 2, a tiny group, no ConsistencyCheck, a
sparse graph whose neighbourhoods colluders could fill) could rebuild one device's update; the
device checks the server's parameters against this floor before it advertises a key and refuses
anything below it. The bounds are those the ``secagg`` library uses to choose parameters:
t > 2n/3 over the complete graph (Bonawitz et al. 2017: a malicious server colluding with fewer
than n/3 clients learns nothing beyond the sum), and t > n(1 + c)/2 where the app assumes a corrupt
fraction c above 1/3 (a server showing two halves of the honest members two survivor lists needs t
shares from each half with its colluders': 2t <= n + cn), and for SecAgg+ (Bell et al. 2020) a degree at
least the one ``secagg_plus_parameters`` gives for the assumed corrupt fraction and drop-out rate,
with a threshold that no neighbourhood's colluders reach except with probability 2^-sigma / n,
that is a majority of the neighbourhood, and that leaves a server splitting survivor lists too
few corrupt holders to answer both ways (see ``secagg.graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from secagg import SecAggConfig, complete_graph_threshold, least_secagg_plus_degree
from secagg.graphs import binom_tail_ge

from .errors import InvalidSetting, check_count


@dataclass(frozen=True)
class SecAggPolicy:
    """The floor a device enforces on every Secure Aggregation group it joins.

    ``min_group_size``: k, the fewest devices whose sum may be released (the group, and every
    completed sum); ``corrupt_fraction`` / ``dropout_rate`` / ``sigma`` / ``eta``: the
    assumptions and the security / correctness parameters behind the SecAgg+ bounds;
    ``require_consistency_check``: the ConsistencyCheck round must run (with False, a group
    without it is still refused under a SecAgg+ graph, whose devices would see only their
    neighbourhood's survivors and could not hold ``min_group_size`` on the sum; over the complete
    graph it is taken, each device refusing a survivor list shorter than ``min_group_size``, but
    not seeing whether its peers were shown the same list);
    ``require_attested_cohort``: this device signs its keys with its attested device key and
    accepts only peers certified by the attestation authority, each device once, from the group
    the committed seed gives it; ``require_graph_commitment``: groups and graphs must derive from
    a seed the server committed to before the cohort was known.

    The attested cohort is on by default. Without it a malicious server can fill a device's
    group with clients of its own, subtract their inputs from the sum and read the device's
    update, whatever the threshold: every other part of the floor assumes the cohort is real
    devices. So the floor fails closed: an ``FLRuntime`` given an ``attestor`` and the
    authority's ``trust_anchor`` runs attested groups, and one missing either refuses every
    Secure Aggregation task before it advertises a key (``SECAGG_NEEDS_ATTESTATION``, recorded
    in opstats and told to the server) instead of quietly joining a cohort it cannot check. An
    app that accepts that risk (a test fleet, a server it runs itself) says so with
    ``SecAggPolicy(require_attested_cohort=False)``; its keys and messages stay signed and bound
    to the session, but sybils are not stopped.
    """

    min_group_size: int = 5
    corrupt_fraction: float = 1 / 3
    dropout_rate: float = 0.05
    sigma: int = 40
    eta: int = 30
    require_consistency_check: bool = True
    require_attested_cohort: bool = True
    require_graph_commitment: bool = True

    def __post_init__(self) -> None:
        """Values of the wrong kind raise ``InvalidSetting`` (a ``ValueError``): a ``min_group_size``
        of "5" failed with a bare TypeError, a flag of "no" would hold."""
        # a sum of one device is that device's update
        check_count("SecAggPolicy.min_group_size", self.min_group_size, least=2)
        for name in ("sigma", "eta"):
            check_count(f"SecAggPolicy.{name}", getattr(self, name), least=1)
        for name in ("corrupt_fraction", "dropout_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise InvalidSetting(
                    f"SecAggPolicy.{name} is a fraction from 0 up to (not including) 1, not {value!r:.100}"
                )
        for name in ("require_consistency_check", "require_attested_cohort", "require_graph_commitment"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSetting(f"SecAggPolicy.{name} is True or False, not {getattr(self, name)!r:.100}")

    def violation(self, config: SecAggConfig, group_size: int) -> str | None:
        """Why ``config`` for a group of ``group_size`` devices is below this floor, or None.
        (Judged on the parameters alone: ``config.allow_unsafe`` is the caller's flag, not the
        server's.)"""
        n, t, k = group_size, config.threshold, config.degree
        if n < self.min_group_size:
            return f"group of {n} devices, below the minimum of {self.min_group_size}"
        if config.min_summed < self.min_group_size:
            return (
                f"the server would release sums of {config.min_summed} devices, "
                f"below the minimum of {self.min_group_size}"
            )
        if self.require_consistency_check and not config.consistency_check:
            return "ConsistencyCheck is off; this device requires it"
        if not config.consistency_check and k is not None and k < n - 1:
            # without it a SecAgg+ client is shown only its neighbourhood's part of the survivor
            # list (secagg.client._check_u3): nothing it sees bounds how many inputs the sum holds
            return (
                f"SecAgg+ (degree {k}) without ConsistencyCheck: this device would see only its "
                f"neighbourhood's survivors and could not hold the minimum of {self.min_group_size} "
                "inputs in a sum"
            )
        if self.require_graph_commitment and not config.graph_commitment:
            return "the server committed to no seed before selection; this device requires it"
        if t > n:
            return f"threshold {t} exceeds the group of {n}"
        if k is None or k >= n - 1:
            if 3 * t <= 2 * n:
                return f"threshold {t} is not above 2n/3 for a group of {n} (at least {complete_graph_threshold(n)})"
            lowest = complete_graph_threshold(n, self.corrupt_fraction)
            if t < lowest:  # past 2n/3 only where more than n/3 collude
                return (
                    f"threshold {t} is too low for a group of {n} of which a fraction {self.corrupt_fraction:g} may "
                    "collude with the server: splitting the survivor list, they could collect both shares of a device "
                    f"(t > n(1 + c)/2: at least {lowest})"
                )
            return None
        # k is below secagg_plus_parameters(n).degree exactly when no even degree up to k meets the
        # bounds: looking no further than k bounds the device's cost by what the server sent
        least = least_secagg_plus_degree(
            n, self.corrupt_fraction, self.dropout_rate, sigma=self.sigma, eta=self.eta, up_to=k
        )
        if least is None:
            return (
                f"SecAgg+ degree {k} is below the least for n = {n} under these assumptions (none up to {k} meets them)"
            )
        if 2 * t <= k + 1:
            return f"SecAgg+ threshold {t} is not a majority of a neighbourhood of {k + 1}"
        bound = 2.0**-self.sigma / n
        if binom_tail_ge(k, t, self.corrupt_fraction) > bound:
            return f"SecAgg+ threshold {t} is too low for degree {k}: colluders could fill a neighbourhood"
        if binom_tail_ge(k, 2 * t - (k + 1), self.corrupt_fraction) > bound:
            return (
                f"SecAgg+ threshold {t} is too low for degree {k}: a server splitting survivor lists "
                "could collect both shares of a device"
            )
        return None


DEFAULT_SECAGG_POLICY = SecAggPolicy()
