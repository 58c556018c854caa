"""The privacy accountant (server_stub.accounting) against dp-accounting and the analytic Gaussian."""

from __future__ import annotations

import dataclasses
import math

import dp_accounting
import mpmath
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_stub import accounting as acc

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
deltas = st.sampled_from([1e-3, 1e-5, 1e-7])


@SETTINGS
@given(
    z=st.floats(0.3, 30),
    k=st.integers(1, 5000),
    more=st.integers(1, 5000),
    delta=deltas,
)
def test_epsilon_grows_with_rounds(z: float, k: int, more: int, delta: float) -> None:
    assert acc.epsilon(z, k + more, delta) > acc.epsilon(z, k, delta)


@SETTINGS
@given(
    z=st.floats(0.3, 30),
    factor=st.floats(1.01, 10),
    k=st.integers(1, 5000),
    delta=deltas,
)
def test_epsilon_falls_as_the_noise_multiplier_rises(z: float, factor: float, k: int, delta: float) -> None:
    assert acc.epsilon(z * factor, k, delta) < acc.epsilon(z, k, delta)


@SETTINGS
@given(z=st.floats(0.3, 30), k=st.integers(1, 5000), delta=deltas)
def test_the_epsilon_solves_the_analytic_gaussian_equation(z: float, k: int, delta: float) -> None:
    """Balle and Wang 2018, Theorem 8: a Gaussian mechanism with multiplier s is (eps, delta)-DP iff
    Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s) <= delta; k rounds are one at s = z / sqrt(k)."""
    eps = acc.epsilon(z, k, delta)
    with mpmath.workdps(60):  # the difference cancels badly in floats: evaluate it in 60 digits
        s = mpmath.mpf(z) / mpmath.sqrt(k)
        e = mpmath.mpf(eps)
        exact = mpmath.ncdf(1 / (2 * s) - e * s) - mpmath.exp(e) * mpmath.ncdf(-1 / (2 * s) - e * s)
        assert float(exact) == pytest.approx(delta, rel=1e-6)


@pytest.mark.parametrize("eps", [0.1, 0.5, 0.9])
def test_the_classic_gaussian_calibration_is_within_its_published_epsilon(
    eps: float,
) -> None:
    """Dwork and Roth 2014, Theorem A.1: z = sqrt(2 ln(1.25 / delta)) / eps gives (eps, delta)-DP for
    eps < 1; the exact accountant can only be tighter, and not absurdly so."""
    delta = 1e-5
    z = math.sqrt(2 * math.log(1.25 / delta)) / eps
    assert 0.6 * eps < acc.epsilon(z, 1, delta) <= eps


@pytest.mark.parametrize(("z", "k"), [(1.0, 1), (2.0, 10)])
def test_epsilon_equals_dp_accountings_pld_accountant(z: float, k: int) -> None:
    delta = 1e-5
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(z), k)
    ours = acc.epsilon(z, k, delta)
    assert ours == pytest.approx(pld.get_epsilon(delta), rel=1e-6)
    assert ours <= pld.get_epsilon(delta)  # the discretized PLD is pessimistic


@pytest.mark.parametrize(("z", "k"), [(0.8, 1), (1.0, 100), (5.0, 1000), (20.0, 50)])
def test_rdp_is_a_slightly_looser_bound_on_the_same_mechanism(z: float, k: int) -> None:
    pld, rdp = acc.epsilon(z, k, 1e-5), acc.epsilon(z, k, 1e-5, method="rdp")
    assert pld <= rdp <= 1.3 * pld


@SETTINGS
@given(z=st.floats(0.3, 30), k=st.integers(0, 3000), delta=deltas)
def test_no_amplification_unless_the_sampling_opt_in_is_given(z: float, k: int, delta: float) -> None:
    plain = acc.epsilon(z, k, delta)
    assert acc.epsilon(z, k, delta, sampling_probability=None) == plain
    assert acc.epsilon(z, k, delta, sampling_probability=1.0) == plain
    assert acc.PrivacyLedger(delta=delta).add_round(z, k).epsilon == plain


def test_the_sampling_opt_in_is_dp_accountings_poisson_sampled_gaussian() -> None:
    z, q, k, delta = 2.0, 0.05, 20, 1e-5
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    reference = pld_privacy_accountant.PLDAccountant()
    reference.compose(event, k)
    sampled = acc.epsilon(z, k, delta, sampling_probability=q)
    assert sampled == pytest.approx(reference.get_epsilon(delta), rel=1e-6)
    assert sampled < acc.epsilon(z, k, delta)
    rdp = acc.epsilon(z, k, delta, sampling_probability=q, method="rdp")
    assert sampled <= rdp <= 2.0 * sampled


def test_the_ledger_adds_rounds_one_by_one_to_the_same_epsilon() -> None:
    ledger = acc.PrivacyLedger(delta=1e-6)
    assert ledger.epsilon == 0.0 and ledger.rounds == 0
    seen = []
    for _ in range(200):
        ledger = ledger.add_round(4.0)
        seen.append(ledger.epsilon)
    assert ledger.rounds == 200
    assert seen == sorted(seen)
    assert ledger.epsilon == acc.epsilon(4.0, 200, 1e-6)


def test_rounds_at_different_multipliers_compose_to_one_gaussian() -> None:
    ledger = acc.PrivacyLedger(delta=1e-5).add_round(2.0, 30).add_round(3.0, 45).add_round(2.0, 10)
    assert dict(ledger.counts) == {2.0: 40, 3.0: 45}
    z_eff = (40 / 4 + 45 / 9) ** -0.5
    assert acc.composed_noise_multiplier(dict(ledger.counts)) == pytest.approx(z_eff)
    assert ledger.epsilon == pytest.approx(acc.epsilon(z_eff, 1, 1e-5), rel=1e-9)


def test_a_round_without_noise_spends_everything() -> None:
    assert acc.epsilon(0.0, 1, 1e-5) == math.inf
    assert acc.PrivacyLedger(delta=1e-5).add_round(1.0).add_round(0.0).epsilon == math.inf


@pytest.mark.parametrize("q", [None, 0.02])
def test_the_budget_allows_exactly_the_rounds_within_it(q: float | None) -> None:
    z, delta, budget = 3.0, 1e-5, 4.0
    k = acc.rounds_within(budget, z, delta, sampling_probability=q, method="rdp" if q else "pld")
    method: acc.Method = "rdp" if q else "pld"
    assert k >= 1
    assert acc.epsilon(z, k, delta, sampling_probability=q, method=method) <= budget
    assert acc.epsilon(z, k + 1, delta, sampling_probability=q, method=method) > budget
    ledger = acc.PrivacyLedger(delta=delta, sampling_probability=q, method=method, max_epsilon=budget)
    assert ledger.add_round(z, k - 1).allows(z)
    assert not ledger.add_round(z, k).allows(z)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 1e-5, "sampling_probability": 0.0}, "sampling_probability"),
        ({"delta": 1e-5, "method": "moments"}, "method"),
        ({"delta": 1e-5, "max_epsilon": -1.0}, "max_epsilon"),
    ],
)
def test_out_of_range_parameters_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(acc.AccountingError, match=field):
        acc.PrivacyLedger(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(acc.AccountingError, match="noise_multiplier"):
        acc.epsilon(-1.0, 1, 1e-5)


@SETTINGS
@given(z=st.floats(5e-324, 1e4), k=st.integers(0, 10**6), delta=deltas, method=st.sampled_from(["pld", "rdp"]))
def test_any_noise_multiplier_the_accountant_takes_gives_an_epsilon_never_an_exception(
    z: float, k: int, delta: float, method: acc.Method
) -> None:
    """A multiplier so small that z^2 underflows (1e-300) once ended a server's commit in a
    ZeroDivisionError; the epsilon there is astronomically large, and inf is its bound."""
    eps = acc.epsilon(z, k, delta, method=method)
    assert isinstance(eps, float) and eps >= 0.0  # 0 for no rounds, or when delta covers them all
    if k and z < 1e-120:
        assert eps == math.inf


def _sampled_reference(z: float, q: float, rounds: int, delta: float) -> list[float]:
    """dp-accounting's own accountant fed one Poisson-sampled Gaussian event per committed round."""
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    reference = pld_privacy_accountant.PLDAccountant()
    out = []
    for _ in range(rounds):
        reference.compose(event)
        out.append(reference.get_epsilon(delta))
    return out


def test_a_sampled_ledger_composes_each_commit_onto_the_last_and_reports_dp_accountings_epsilon() -> None:
    z, q, delta, rounds = 1.5, 0.2, 1e-5, 6  # past PLD_CACHE_SIZE (4): the cache evicts
    acc._composed.clear()
    ledger = acc.PrivacyLedger(delta=delta, sampling_probability=q)
    seen = []
    for _ in range(rounds):
        assert ledger.allows(z)  # the check before a round reads the ledger one round on ...
        ledger = ledger.add_round(z)
        seen.append(ledger.epsilon)  # ... and the commit reads it again: one composition, kept
        assert len(acc._composed) <= acc.PLD_CACHE_SIZE
    assert seen == pytest.approx(_sampled_reference(z, q, rounds, delta), rel=1e-9)
    # a restarted server composes the rounds on record at once (self_compose): the same epsilon
    acc._composed.clear()
    assert acc._epsilon(dict(ledger.counts), delta, q, "pld") == pytest.approx(seen[-1], rel=1e-9)


def test_a_sampled_ledger_at_two_multipliers_composes_like_dp_accounting() -> None:
    q, delta = 0.1, 1e-6
    ledger = acc.PrivacyLedger(delta=delta, sampling_probability=q)
    reference = pld_privacy_accountant.PLDAccountant()
    for z in [1.0, 2.0, 1.0, 2.0, 2.0]:
        ledger = ledger.add_round(z)
        reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
        assert ledger.epsilon == pytest.approx(reference.get_epsilon(delta), rel=1e-9)
    assert dict(ledger.counts) == {1.0: 2, 2.0: 3}


def test_a_dp_ftrl_ledger_accounts_each_tree_as_dp_accountings_tree_aggregation_event() -> None:
    z, delta = 3.0, 1e-5
    ledger = acc.PrivacyLedger(delta=delta, tree_rounds=4)
    for i in range(10):
        ledger = ledger.add_tree_round(z, new_tree=(i == 6))  # a restart after round 6 starts a tree
    assert ledger.trees == ((z, 4), (z, 2), (z, 4)) and ledger.rounds == 10
    reference = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    for steps in (4, 2, 4):
        reference.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, steps))
    assert ledger.epsilon == pytest.approx(reference.get_epsilon(delta), rel=1e-12)
    # one tree of 10 rounds costs less than ten rounds of fresh noise at z, each a Gaussian
    assert acc.tree_epsilon(((z, 10),), delta) < acc.epsilon(z, 10, delta, method="rdp")
    spent = dataclasses.replace(ledger, max_epsilon=ledger.epsilon)  # the budget is what ten rounds cost
    assert not spent.allows(z, new_tree=True)
    assert dataclasses.replace(ledger, max_epsilon=ledger.epsilon * 2).allows(z, new_tree=True)
    assert acc.tree_epsilon(((0.0, 1),), delta) == math.inf and acc.tree_epsilon((), delta) == 0.0


#: Moments accountant orders (Abadi et al. 2016 computed the log moments for lambda = 1..32).
MA_ORDERS = list(range(2, 33))


def moments_accountant_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """Epsilon as Abadi et al. 2016 and McMahan et al. 2018 computed it: the Renyi divergence (log
    moments) of the Poisson-sampled Gaussian, the event the ledger composes for a sampled round, at
    orders 2..32, converted by their tail bound eps = min_a RDP(a) + log(1/delta) / (a - 1).
    dp-accounting's own conversion (Balle et al. 2020; Canonne, Kamath and Steinke 2020) is tighter."""
    acc_ = rdp_privacy_accountant.RdpAccountant(MA_ORDERS)
    acc_.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return min(r + math.log(1 / delta) / (a - 1) for a, r in zip(MA_ORDERS, acc_._rdp, strict=True))


#: McMahan et al. 2018, Table 1: users K, expected users a round C (q = C / K), noise multiplier z,
#: delta = K^-1.1, and the epsilon they published after 1, 10, ..., 10^6 rounds.
MCMAHAN_2018 = [
    (10**5, 10**2, 1.0, (0.97, 0.98, 1.00, 1.07, 1.18, 2.21, 7.50)),
    (10**6, 10**1, 1.0, (0.68, 0.69, 0.69, 0.69, 0.69, 0.72, 0.73)),
    (10**6, 10**3, 1.0, (1.17, 1.17, 1.20, 1.28, 1.39, 2.44, 8.13)),
    (10**6, 10**4, 1.0, (1.73, 1.92, 2.08, 3.06, 8.49, 32.38, 187.01)),
    (10**9, 10**3, 1.0, (0.84, 0.84, 0.84, 0.85, 0.88, 0.88, 0.88)),
]
ROUNDS = (1, 10, 100, 10**3, 10**4, 10**5, 10**6)


def test_the_sampled_round_reproduces_the_published_moments_accountant_figures() -> None:
    """Abadi et al. 2016, section 3.1: q = 0.01, sigma = 4, delta = 1e-5, 10,000 steps give epsilon
    1.26 by the moments accountant; McMahan et al. 2018, Table 1, to its two decimals. The ledger's
    RDP epsilon is dp-accounting's on the same event (above), tighter than the published figure by
    the conversion only; its PLD epsilon (the default) is tighter still."""
    assert moments_accountant_epsilon(0.01, 4.0, 10_000, 1e-5) == pytest.approx(1.26, abs=0.005)
    assert acc.epsilon(4.0, 10_000, 1e-5, sampling_probability=0.01, method="rdp") == pytest.approx(1.035, abs=1e-3)
    for users, sampled, z, published in MCMAHAN_2018:
        q, delta = sampled / users, users**-1.1
        for rounds, figure in zip(ROUNDS, published, strict=True):
            assert moments_accountant_epsilon(q, z, rounds, delta) == pytest.approx(figure, abs=0.005)
            assert acc.epsilon(z, rounds, delta, sampling_probability=q, method="rdp") < figure
    assert acc.epsilon(4.0, 10_000, 1e-5, sampling_probability=0.01) == pytest.approx(0.947, abs=1e-3)
    q, delta = 1e-3, 1e5**-1.1  # the first row's PLD, where it is quick
    pld = [acc.epsilon(1.0, k, delta, sampling_probability=q) for k in (1, 100, 10**4)]
    assert pld == pytest.approx([0.01, 0.07, 0.52], abs=0.005)


@pytest.mark.slow
def test_the_pld_epsilon_of_every_published_row_is_below_the_published_figure() -> None:
    """The default accountant over the whole of McMahan et al.'s Table 1 (10 s or more of PLD)."""
    for users, sampled, z, published in MCMAHAN_2018:
        q, delta = sampled / users, users**-1.1
        for rounds, figure in zip(ROUNDS, published, strict=True):
            assert acc.epsilon(z, rounds, delta, sampling_probability=q) < figure


@pytest.mark.parametrize("rounds", [math.nan, 1.5, True, -1, "3"])
def test_a_number_of_rounds_that_is_not_a_count_is_refused(rounds: object) -> None:
    """NaN rounds once read as no round at all (epsilon 0), 1.5 as a fraction of one."""
    with pytest.raises(acc.AccountingError, match="rounds must be an integer"):
        acc.epsilon(1.0, rounds, 1e-5)  # type: ignore[arg-type]
    with pytest.raises(acc.AccountingError, match="count must be an integer"):
        acc.PrivacyLedger(delta=1e-5).add_round(1.0, rounds)  # type: ignore[arg-type]


@pytest.mark.parametrize("delta", [1e-15, 1e-30, 1e-300])
def test_a_sampled_task_at_a_delta_below_the_plds_truncated_tails_still_reports_a_finite_epsilon(delta: float) -> None:
    """The PLD's grid moves about 1e-15 of each round's tails to infinity: at a delta below that its
    epsilon was inf, which the round's metrics publish as null, as for no noise at all. RDP's
    bound, finite at any delta, stands in; above that delta the PLD's (tighter) figure is kept."""
    z, q, k = 1.0, 0.01, 100
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), k)
    assert acc.epsilon(z, k, delta, sampling_probability=q) == pytest.approx(reference.get_epsilon(delta))
    assert acc.PrivacyLedger(delta=delta, sampling_probability=q).add_round(z, k).epsilon < math.inf
    assert acc.epsilon(z, k, 1e-12, sampling_probability=q) < reference.get_epsilon(1e-12)


def _one_round_total_variation(z: float, q: float) -> float:
    """The total variation between one round's outputs with and without a device: q times that of
    N(1, z^2) and N(0, z^2), 2 Phi(1 / (2z)) - 1 (the sampled output is the mixture). k rounds'
    joint output holds the first round's, so their total variation is at least this: at a delta
    below it no number of rounds is (0, delta)-DP, and epsilon must be above 0."""
    with mpmath.workdps(40):
        return float(mpmath.mpf(q) * mpmath.erf(1 / (2 * mpmath.sqrt(2) * mpmath.mpf(z))))


@pytest.mark.parametrize(
    ("z", "q", "k", "delta", "method"),
    [(3000.0, 1e-8, 1, 1e-30, "rdp"), (1e4, 1e-7, 1, 1e-20, "rdp"), (1e4, 1e-7, 100, 1e-30, "pld")],
)
def test_an_rdp_divergence_that_cancels_below_zero_never_reads_as_epsilon_0(
    z: float, q: float, k: int, delta: float, method: acc.Method
) -> None:
    """At a tiny q and a large z dp-accounting's Renyi divergence cancels to below 0 at some orders
    and converts to epsilon 0 at any delta (the PLD falls back to RDP below its truncated tails):
    0 where the mechanism is provably not (0, delta)-DP. Those orders are left out."""
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), k)
    assert (reference.rdp < 0).any() and reference.get_epsilon(delta) == 0  # the library's failure
    assert delta < _one_round_total_variation(z, q)
    assert acc.epsilon(z, k, delta, sampling_probability=q, method=method) > 0


def test_an_rdp_epsilon_of_0_is_kept_where_the_mechanism_is_0_delta_dp() -> None:
    """z 1, q 1e-7, 1000 rounds: RDP says 0 and the PLD 7.7e-5, below its grid of 1e-4. RDP is right:
    the rounds' KL divergence is at most their order-2 Renyi divergence, 1000 log(1 + q^2 (e^(1/z^2)
    - 1)) (exact for the sampled Gaussian), so their total variation is at most
    sqrt(1 - e^-KL) (Bretagnolle and Huber), 2.9e-6, below delta 1e-5."""
    z, q, k, delta = 1.0, 1e-7, 1000, 1e-5
    with mpmath.workdps(40):
        kl = k * mpmath.log1p(mpmath.mpf(q) ** 2 * mpmath.expm1(1 / mpmath.mpf(z) ** 2))
        assert mpmath.sqrt(-mpmath.expm1(-kl)) < delta
    assert acc.epsilon(z, k, delta, sampling_probability=q, method="rdp") == 0
    assert 0 < acc.epsilon(z, k, delta, sampling_probability=q) <= acc.PLD_DISCRETIZATION


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    z=st.floats(0.3, 1e4),
    q=st.floats(1e-9, 1.0),
    k=st.integers(1, 100_000),
    share=st.floats(1e-20, 0.99),
)
def test_epsilon_is_above_0_wherever_the_mechanism_is_not_0_delta_dp(z: float, q: float, k: int, share: float) -> None:
    delta = max(1e-30, share * _one_round_total_variation(z, q))
    if not delta < _one_round_total_variation(z, q):
        return
    assert acc.epsilon(z, k, delta, sampling_probability=q, method="rdp") > 0
    assert acc.epsilon(z, k, delta, method="rdp") > 0
