"""Central DP's streamed form (server_stub.dp_rounds and its pure helpers in central_dp): what
one report adds to a round's sum, the noise step at commit, and the ledger a task rebuilds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from device_runtime.influence import NUM_EXAMPLES
from server_stub import DPConfig, RoundConfig
from server_stub import central_dp as cdp
from server_stub.accounting import PrivacyLedger
from server_stub.dp_rounds import NEXT_CLIP_KEY, ROUND_KEYS, CentralRound, TaskDP, released_sums, spends_privacy

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHTS = ("w", "b")
values = st.floats(-(2.0**100), 2.0**100, allow_nan=False, allow_infinity=False, width=32)


def _round(weighting: str = "unweighted", clip: float = 1.0, goal_count: int = 5) -> CentralRound:
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=clip, weighting=weighting)  # type: ignore[arg-type]
    task = TaskDP.load(RoundConfig(goal_count=goal_count, dp=dp), [])
    assert task is not None
    central = task.open_round(secure=False)
    assert central is not None
    return central


reports = st.fixed_dictionaries(
    {
        "w": arrays(np.float32, (3, 4), elements=values),
        "b": arrays(np.float32, (4,), elements=values),
        NUM_EXAMPLES: st.floats(0, 1000, width=32).map(lambda n: np.array(n, np.float32)),
        "loss_sum": st.just(np.array(1.0, np.float32)),
    }
)


def _weight_norm(update: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.square(np.asarray(update[w], np.float64)).sum()) for w in WEIGHTS))


@SETTINGS
@given(report=reports, clip=st.floats(1e-3, 1e3), weighting=st.sampled_from(["unweighted", "capped"]))
def test_one_report_moves_the_weighted_sum_by_at_most_the_clip_whatever_it_sends(
    report: dict[str, np.ndarray], clip: float, weighting: str
) -> None:
    central = _round(weighting, clip)
    taken = central.take(report, WEIGHTS, max_examples=100)
    # the round's sum with and without this report differ by exactly what it added
    assert _weight_norm(taken) <= clip * (1 + 1e-6)  # float32 rounding of the contribution
    assert 0.0 <= float(taken[NUM_EXAMPLES]) <= 1.0  # its weight: the denominator moves by at most 1
    assert central.reports == 1 and central.unclipped in (0, 1)


@SETTINGS
@given(mean=arrays(np.float64, 7, elements=st.floats(-1e3, 1e3)), n=st.floats(0.5, 1e4), clip=st.floats(1e-3, 1e3))
def test_a_report_within_the_clip_contributes_its_mean_unchanged(mean: np.ndarray, n: float, clip: float) -> None:
    part, within = cdp.report_contribution(mean * n, n, clip=clip, weight=1.0)
    norm = float(np.linalg.norm(mean))
    assert within == (np.linalg.norm(mean * n / n) <= clip)
    if norm <= clip * (1 - 1e-9):
        np.testing.assert_allclose(part, mean, rtol=1e-9, atol=1e-12)
    else:
        assert float(np.linalg.norm(part)) == pytest.approx(clip, rel=1e-9)


def test_a_report_of_no_examples_contributes_nothing() -> None:
    part, within = cdp.report_contribution(np.array([3.0, 4.0]), 0.0, clip=1.0, weight=1.0)
    assert not part.any() and not within


@pytest.mark.parametrize(("weighting", "denominator"), [("unweighted", 3.0), ("capped", 5.0)])
def test_the_sum_is_divided_by_the_reports_or_by_goal_count(weighting: str, denominator: float) -> None:
    central = _round(weighting, goal_count=5)
    central.updates_noise_multiplier = 0.0
    acc = {"w": np.ones((3, 4)), "b": np.ones(4), NUM_EXAMPLES: np.array(2.5)}
    central.reports = 3
    out, next_clip = central.close(acc, WEIGHTS, np.random.default_rng(0))
    assert float(out[NUM_EXAMPLES]) == denominator
    np.testing.assert_array_equal(out["w"], acc["w"])
    assert next_clip is None


def test_the_noise_step_adds_gaussian_noise_of_std_z_c() -> None:
    total = np.zeros(200_000)
    noised = cdp.noised_sum(total, clip=0.3, noise_multiplier=2.0, rng=np.random.default_rng(1))
    assert float(noised.std()) == pytest.approx(0.6, rel=0.01)
    assert not total.any()  # the sum it was given is left as it was


@SETTINGS
@given(zs=st.lists(st.sampled_from([0.5, 1.0, 2.5]), max_size=12), clips=st.lists(st.floats(0.01, 10), max_size=12))
def test_a_task_rebuilt_from_its_records_has_the_ledger_and_clip_it_had(zs: list[float], clips: list[float]) -> None:
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, delta=1e-6)
    records = [
        {"noise_multiplier": z, **({NEXT_CLIP_KEY: clips[i]} if i < len(clips) else {})} for i, z in enumerate(zs)
    ]
    task = TaskDP.load(RoundConfig(dp=dp), records)
    assert task is not None
    book = PrivacyLedger(delta=1e-6)
    for z in zs:
        book = book.add_round(z)
    assert task.ledger.rounds == len(zs)
    assert task.ledger.epsilon == book.epsilon
    handed_on = [c for i, c in enumerate(clips) if i < len(zs)]
    assert task.clip == (handed_on[-1] if handed_on else 1.0)


def test_adaptive_clipping_spends_part_of_z_on_the_count() -> None:
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, target_quantile=0.5, clipped_count_stddev=2.0)
    task = TaskDP.load(RoundConfig(dp=dp), [])
    assert task is not None
    central = task.open_round(secure=False)
    assert central is not None
    assert central.updates_noise_multiplier == pytest.approx(cdp.update_noise_multiplier(1.0, 2.0))
    assert central.updates_noise_multiplier > 1.0
    assert task.open_round(secure=True) is None  # under Secure Aggregation the devices add the noise


def test_a_distributed_round_is_accounted_like_a_central_one() -> None:
    """The ledger and the metrics key on the task's dp, not on who added the noise: a committed
    distributed (Secure Aggregation) round gets the same keys, at the task's fixed clip."""
    dp = DPConfig(mode="distributed", noise_multiplier=0.8, clip=2.0, delta=1e-6)
    task = TaskDP.load(RoundConfig(dp=dp), [{"noise_multiplier": 0.8}])
    assert task is not None and task.open_round(secure=True) is None
    metrics, after = task.round_metrics(None)
    assert set(metrics) == set(ROUND_KEYS)
    assert (metrics["dp_mode"], metrics["dp_clip"], metrics["dp_rounds"]) == ("distributed", 2.0, 2)
    assert metrics["epsilon"] == after.epsilon == PrivacyLedger(delta=1e-6).add_round(0.8, 2).epsilon
    assert task.after_commit(after, None).ledger.rounds == 2


def _secure_record(status: str, completed: int, dropped: int) -> tuple[str, dict]:
    """A secure round's record as ``commit`` writes it: its status and its groups' statistics."""
    stats = {"groups": completed + dropped + 1, "completed": completed, "aborted": 1}
    stats["dropped"] = [{"group": g, "reason": "norm"} for g in range(dropped)]
    return status, {"noise_multiplier": 0.8, "secagg": stats}


@SETTINGS
@given(
    history=st.lists(
        st.tuples(st.sampled_from(["committed", "abandoned"]), st.integers(0, 3), st.integers(0, 2)), max_size=12
    )
)
def test_a_distributed_task_counts_every_round_whose_group_sums_the_server_unmasked(
    history: list[tuple[str, int, int]],
) -> None:
    """Under distributed DP the server is not trusted: a group's noisy sum it unmasked is released to
    it whether the round then commits or not (the round fell short of its commit threshold, or the
    sum was dropped as out of bounds after it was decoded). The ledger rebuilt from the records
    counts the committed rounds and the abandoned ones that released a sum, and only those."""
    dp = DPConfig(mode="distributed", noise_multiplier=0.8, clip=2.0, delta=1e-6)
    records = [_secure_record(status, completed, dropped) for status, completed, dropped in history]
    spent = [metrics for status, metrics in records if spends_privacy(status, metrics)]
    task = TaskDP.load(RoundConfig(dp=dp), spent)
    assert task is not None
    released = sum(1 for status, c, d in history if status == "committed" or c + d > 0)
    assert task.ledger.rounds == released
    assert task.ledger.epsilon == PrivacyLedger(delta=1e-6).add_round(0.8, released).epsilon
    for (_, c, d), (_, metrics) in zip(history, records, strict=True):
        assert released_sums(metrics) == c + d


def test_a_round_that_released_nothing_spends_nothing() -> None:
    """A central round that did not commit drew no noise and published nothing; a secure round
    whose every group aborted unmasked no sum: neither spends privacy."""
    assert not spends_privacy("abandoned", {"selected": 10, "reported": 3})
    assert not spends_privacy("abandoned", _secure_record("abandoned", 0, 0)[1])
    assert spends_privacy("abandoned", _secure_record("abandoned", 1, 0)[1])
    assert spends_privacy("abandoned", _secure_record("abandoned", 0, 1)[1])
    assert spends_privacy("committed", {})


def test_an_adaptive_rounds_commit_noises_the_sum_at_z_delta_c_and_the_count_at_its_stddev() -> None:
    """Through rounds as the service runs them (``take`` each report, ``close`` at commit), with a
    fixed seed: the summed weight tensors carry noise of std z_delta C whatever the number of
    reports (the sum's sensitivity is C; the plan's report divides by ``num_examples``, set to the
    reports), z_delta = 1.81 for z = 1 once the count takes its share, and the count of unclipped
    reports noise of std sigma_b, read back from the clip each commit hands on
    (C exp(-eta (b - target)), b the noised fraction)."""
    z, clip, sigma_b, eta, target, n = 1.0, 0.5, 0.6, 0.2, 0.5, 7
    dp = DPConfig(
        mode="central",
        noise_multiplier=z,
        clip=clip,
        target_quantile=target,
        clip_learning_rate=eta,
        clipped_count_stddev=sigma_b,
    )
    task = TaskDP.load(RoundConfig(goal_count=n, dp=dp), [])
    assert task is not None
    rng = np.random.default_rng(11)

    def commit(shape: tuple[int, ...]) -> tuple[np.ndarray, float]:
        central = task.open_round(secure=False)
        assert central is not None
        total = {"w": np.zeros(shape, np.float32), "b": np.zeros(3, np.float32), NUM_EXAMPLES: np.float32(0)}
        for i in range(n):  # three reports within the clip, four beyond it
            update = {"w": np.full(shape, 0.001 if i < 3 else 1.0, np.float32), "b": np.zeros(3, np.float32)}
            part = central.take({**update, NUM_EXAMPLES: np.float32(2.0)}, WEIGHTS, max_examples=10)
            total = {key: total[key] + part[key] for key in total}
        out, next_clip = central.close(total, WEIGHTS, rng)
        assert float(out[NUM_EXAMPLES]) == n and next_clip is not None
        size = math.prod(shape)  # the clipped sum: 3 reports at 0.001 / 2, 4 at the clip along the ones
        signal = 3 * 0.0005 + 4 * clip / math.sqrt(size)
        count_noise = (target - math.log(next_clip / clip) / eta) * n - 3
        return np.asarray(out["w"], np.float64).reshape(-1) - signal, count_noise

    noise, _ = commit((200, 250))
    z_delta = cdp.update_noise_multiplier(z, sigma_b)
    assert z_delta == pytest.approx(1.809, abs=1e-3)
    assert noise.mean() == pytest.approx(0.0, abs=5 * z_delta * clip / math.sqrt(noise.size))
    assert noise.std() == pytest.approx(z_delta * clip, rel=5 * math.sqrt(2 / noise.size))
    counts = [commit((2,))[1] for _ in range(200)]  # the count's noise, round by round ...
    assert np.std(counts) == pytest.approx(sigma_b, rel=4 * math.sqrt(2 / len(counts)))
    assert np.mean(counts) == pytest.approx(0.0, abs=5 * sigma_b / math.sqrt(len(counts)))
    many = [cdp.noised_fraction(3, n, sigma_b, rng) * n - 3 for _ in range(20_000)]  # ... and the step alone
    assert np.std(many) == pytest.approx(sigma_b, rel=5 * math.sqrt(2 / len(many)))


@pytest.mark.parametrize("weighting", ["unweighted", "capped"])
def test_a_task_withholding_its_counts_divides_by_goal_count_and_so_does_the_adaptive_clips_fraction(
    weighting: str,
) -> None:
    """With the counts withheld, a round's mean and its adaptive clip's fraction are divided by the
    fixed ``goal_count``: divided by the reports, the model's scale and the next clip would tell
    how many devices took part."""
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, weighting=weighting, counts="withheld")  # type: ignore[arg-type]
    central = TaskDP.load(RoundConfig(goal_count=5, dp=dp), []).open_round(secure=False)  # type: ignore[union-attr]
    assert central is not None
    central.reports = 3
    out, _ = central.close({"w": np.ones(2), NUM_EXAMPLES: np.array(3.0)}, ("w",), np.random.default_rng(0))
    assert float(out[NUM_EXAMPLES]) == 5.0
    assert cdp.noised_fraction(3, 3, 0.0, np.random.default_rng(0), expected=5) == 0.6
    assert cdp.noised_fraction(3, 3, 0.0, np.random.default_rng(0)) == 1.0


def test_withheld_counts_are_central_dps_and_refused_for_distributed_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dp.counts 'withheld' is central DP's"):
        DPConfig(mode="distributed", noise_multiplier=1.0, clip=1.0, counts="withheld")
