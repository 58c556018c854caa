"""Central differential privacy in a real server's rounds, over real HTTP: each report's mean
update is clipped to ``dp.clip`` and weighted as it is summed, the sum gets Gaussian noise of std
z * C at commit, the round publishes epsilon and withholds what would leak one device's data.

Devices here are the protocol's own requests (check in, report a checkpoint), so the test knows
every update it sent and can say what the committed model must be."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import dp_accounting
import httpx
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from device_runtime import PlanExecutor, build_eval_plan, encode_checkpoint, initial_weights
from device_runtime.protocol import STATS_HEADER
from server_stub import AdminClient, AdminError, DPConfig, RoundConfig, ServerThread
from server_stub import accounting as acc
from server_stub.admin_client import task_body
from tests.support import deploy, digits_plan

CLIP = 0.5


def _updates(plan, n: int, seed: int, examples: list[float]) -> list[dict[str, np.ndarray]]:
    """``n`` reports of random mean deltas of norms from well below to well above ``CLIP``, sent as
    delta * num_examples like a device sends them, with honest metric sums."""
    rng = np.random.default_rng(seed)
    spec = PlanExecutor(plan).client_update_spec()
    out = []
    for i in range(n):
        scale = CLIP * (0.2 + 3.0 * i / max(n - 1, 1))  # the first ones within the clip, the last ones clipped
        deltas = {w: rng.normal(size=spec[w][0]) for w in plan.weight_names}
        norm = math.sqrt(sum(float(np.square(d).sum()) for d in deltas.values()))
        ex = examples[i]
        update = {w: (d * scale / norm * ex).astype(np.float32) for w, d in deltas.items()}
        update.update(
            num_examples=np.array(ex, np.float32),
            count=np.array(ex, np.float32),
            loss_sum=np.array(ex * 0.7, np.float32),
            correct=np.array(ex / 2, np.float32),
        )
        out.append(update)
    return out


def _clipped_mean(plan, updates: list[dict[str, np.ndarray]], weights: list[float], denominator: float) -> dict:
    """What DP-FedAvg averages, computed here from the updates sent: sum_i w_i clip(u_i / n_i) / den."""
    total = {w: np.zeros(updates[0][w].shape) for w in plan.weight_names}
    for u, wi in zip(updates, weights, strict=True):
        n = float(u["num_examples"])
        mean = {w: np.asarray(u[w], np.float64) / n for w in plan.weight_names}
        norm = math.sqrt(sum(float(np.square(m).sum()) for m in mean.values()))
        factor = min(1.0, CLIP / norm)
        for w in plan.weight_names:
            total[w] += wi * mean[w] * factor
    return {w: t / denominator for w, t in total.items()}


def _run_round(server, updates: list[dict[str, np.ndarray]], stats: str | None = None) -> None:
    """Each update reported by a session of its own; ``stats``: the session statistics header each sends."""
    headers = {} if stats is None else {STATS_HEADER: stats}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        sessions = [
            http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json() for _ in updates
        ]
        for session, update in zip(sessions, updates, strict=True):
            assert session["status"] == "accepted", session
            r = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=encode_checkpoint(update),
                headers={**headers, "Authorization": f"Bearer {session['token']}"},
            )
            assert r.status_code == 200, r.text


def _config(n: int, dp: DPConfig, **extra) -> dict:
    return dict(
        goal_count=n,
        over_selection=1.0,
        min_fraction=1.0,
        report_timeout_s=120,
        selection_timeout_s=120,
        clip_update_norm=100.0,  # dp.clip rules: the server clips to CLIP, not to this
        dp=dp,
        **extra,
    )


def test_without_noise_the_committed_model_moves_by_the_clipped_unweighted_mean(server, admin) -> None:
    n = 6
    plan, w0 = deploy(admin, **_config(n, DPConfig(mode="central", noise_multiplier=0.0, clip=CLIP)))
    updates = _updates(plan, n, seed=1, examples=[3.0, 50.0, 7.0, 1.0, 20.0, 9.0])
    _run_round(server, updates)
    (record,) = admin.rounds("digits")
    assert record["status"] == "committed", record
    model, _ = admin.model("digits")
    expected = _clipped_mean(plan, updates, [1.0] * n, float(n))  # unweighted: each device weighs 1
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], w0[w] + expected[w].astype(np.float32), rtol=1e-5, atol=1e-6)
    m = record["metrics"]
    assert (m["dp_mode"], m["dp_clip"], m["noise_multiplier"], m["dp_rounds"]) == ("central", CLIP, 0.0, 1)
    assert m["epsilon"] is None  # no noise, no privacy: infinite epsilon, stored as null


def test_capped_weighting_divides_the_weighted_sum_by_goal_count(server, admin) -> None:
    n, cap = 5, 10
    dp = DPConfig(mode="central", noise_multiplier=0.0, clip=CLIP, weighting="capped")
    plan, w0 = deploy(admin, **_config(n, dp, max_examples_per_report=cap))
    examples = [2.0, 10.0, 40.0, 5.0, 1.0]
    updates = _updates(plan, n, seed=2, examples=examples)
    _run_round(server, updates)
    model, _ = admin.model("digits")
    expected = _clipped_mean(plan, updates, [min(e, cap) / cap for e in examples], float(n))
    for w in plan.weight_names:
        np.testing.assert_allclose(model[w], w0[w] + expected[w].astype(np.float32), rtol=1e-5, atol=1e-6)


def test_noise_on_the_committed_mean_has_std_z_c_over_n(server, admin) -> None:
    n, z = 8, 1.3
    plan = digits_plan("mlp")  # about 1,200 parameters: the deviation's std is checked within a few percent
    _, w0 = deploy(admin, plan=plan, **_config(n, DPConfig(mode="central", noise_multiplier=z, clip=CLIP)))
    updates = _updates(plan, n, seed=3, examples=[4.0] * n)
    _run_round(server, updates)
    (record,) = admin.rounds("digits")
    model, _ = admin.model("digits")
    expected = _clipped_mean(plan, updates, [1.0] * n, float(n))
    deviation = np.concatenate([(model[w] - w0[w] - expected[w]).reshape(-1) for w in plan.weight_names])
    sigma = z * CLIP / n
    d = deviation.size
    # sample std of d Gaussians: relative standard error 1/sqrt(2d), about 2%; 6 standard errors either side
    assert abs(float(deviation.std()) / sigma - 1) < 6 / math.sqrt(2 * d), (deviation.std(), sigma)
    assert abs(float(deviation.mean())) < 6 * sigma / math.sqrt(d)
    m = record["metrics"]
    assert m["epsilon"] == pytest.approx(dp_accounting.get_epsilon_gaussian(z, 1e-5), rel=1e-9)


def test_adaptive_clipping_moves_the_clip_and_the_round_records_it(server, admin) -> None:
    n = 8
    dp = DPConfig(mode="central", noise_multiplier=0.5, clip=CLIP, target_quantile=0.5, clipped_count_stddev=1.0)
    plan, _ = deploy(admin, **_config(n, dp))
    _run_round(server, _updates(plan, n, seed=4, examples=[4.0] * n))
    _run_round(server, _updates(plan, n, seed=5, examples=[4.0] * n))
    first, second = admin.rounds("digits")
    assert first["metrics"]["dp_clip"] == CLIP
    assert second["metrics"]["dp_clip"] == pytest.approx(first["metrics"]["dp_next_clip"])
    assert second["metrics"]["dp_clip"] != CLIP  # the geometric step moved it
    # the pair of releases composes to one Gaussian at z each round (Andrew et al., Theorem 1)
    assert second["metrics"]["epsilon"] == pytest.approx(dp_accounting.get_epsilon_gaussian(0.5 / math.sqrt(2), 1e-5))


#: The session statistics each device sends with its report: a training time is one device's value (it grows
#: with the device's examples), which a summary's min and max publish as it is.
TRAINED = '{"shape": "-v[]+", "training_s": 0.0}'


def test_a_dp_rounds_metrics_hold_no_per_device_update_norm_training_time_or_training_loss(server, admin) -> None:
    n = 4
    plan, _ = deploy(admin, **_config(n, DPConfig(mode="central", noise_multiplier=1.0, clip=CLIP)))
    _run_round(server, _updates(plan, n, seed=6, examples=[5.0] * n), stats=TRAINED)
    (record,) = admin.rounds("digits")
    m = record["metrics"]
    assert m["device_metrics"] == {}  # no update norm, loss, accuracy, example count or training time
    assert not {"train_loss", "train_accuracy", "num_examples", "bounded_reports"} & set(m)
    assert m["reported"] == n and m["shapes"] == {"-v[]+^": n}  # counts are public


def test_without_dp_the_same_round_publishes_update_norms(server, admin) -> None:
    """The contrast that keeps the test above honest: the same round without dp shows them."""
    n = 4
    plan, _ = deploy(admin, **{**_config(n, None), "dp": None})
    _run_round(server, _updates(plan, n, seed=6, examples=[5.0] * n), stats=TRAINED)
    (record,) = admin.rounds("digits")
    assert "update_norm" in record["metrics"]["device_metrics"]
    assert record["metrics"]["device_metrics"]["training_s"]["count"] == n
    assert record["metrics"]["shapes"] == {"-v[]+^": n}  # a session's shape counts in either round
    assert "train_loss" in record["metrics"]


def test_epsilon_after_each_round_is_dp_accountings_and_rounds_frame_has_the_columns(server, admin) -> None:
    n, z, delta, rounds = 3, 2.0, 1e-6, 3
    dp = DPConfig(mode="central", noise_multiplier=z, clip=CLIP, delta=delta, accountant="rdp")
    plan, _ = deploy(admin, **_config(n, dp))
    for r in range(rounds):
        _run_round(server, _updates(plan, n, seed=10 + r, examples=[4.0] * n))
    records = admin.rounds("digits")
    assert [r["metrics"]["dp_rounds"] for r in records] == [1, 2, 3]
    for k, record in enumerate(records, start=1):
        accountant = rdp_lib.RdpAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(z), k)  # k rounds, each one Gaussian mechanism at z
        assert record["metrics"]["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)
        assert record["metrics"]["delta"] == delta
    frame = admin.rounds_frame("digits")
    assert {"epsilon", "delta", "dp_rounds", "noise_multiplier", "dp_mode", "dp_clip"} <= set(frame.columns)
    assert list(frame["dp_rounds"]) == [1, 2, 3]
    assert frame["epsilon"].is_monotonic_increasing


def test_a_sampled_tasks_epsilon_is_dp_accountings_poisson_sampled_gaussian_round_by_round(server, admin) -> None:
    n, z, q, delta, rounds = 3, 1.0, 0.3, 1e-5, 3
    dp = DPConfig(mode="central", noise_multiplier=z, clip=CLIP, delta=delta, sampling_probability=q)
    plan, _ = deploy(admin, **_config(n, dp))
    for r in range(rounds):
        _run_round(server, _updates(plan, n, seed=20 + r, examples=[4.0] * n))
    reference = pld_privacy_accountant.PLDAccountant()
    for record in admin.rounds("digits"):
        reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
        assert record["metrics"]["epsilon"] == pytest.approx(reference.get_epsilon(delta), rel=1e-9)
    assert [r["metrics"]["dp_rounds"] for r in admin.rounds("digits")] == [1, 2, 3]
    assert admin.rounds("digits")[-1]["metrics"]["epsilon"] < dp_accounting.get_epsilon_gaussian(z / rounds**0.5, delta)


def test_dp_ftrl_releases_the_trees_prefix_noise_and_accounts_each_tree_as_dp_accounting_does(server, admin) -> None:
    """DP-FTRL with trees of two rounds, over three rounds: the committed model's distance from
    the sum of the clipped means is the open tree's prefix noise. After round 2 that is the one
    node over rounds 1-2, independent of round 1's noise (fresh noise each round would carry round
    1's on); round 3 starts a tree, whose noise adds to the last tree's. Each round's epsilon is
    dp-accounting's RDP of one tree-aggregation event per tree."""
    n, z, delta = 8, 1.3, 1e-5
    plan = digits_plan("mlp")
    dp = DPConfig(mode="central", noise_multiplier=z, clip=CLIP, delta=delta, tree_rounds=2)
    _, w0 = deploy(admin, plan=plan, **_config(n, dp))
    total = {w: np.zeros(w0[w].shape) for w in plan.weight_names}
    deviations = []
    for r in range(3):
        updates = _updates(plan, n, seed=40 + r, examples=[4.0] * n)
        _run_round(server, updates)
        mean = _clipped_mean(plan, updates, [1.0] * n, float(n))
        total = {w: total[w] + mean[w] for w in plan.weight_names}
        model, number = admin.model("digits")
        assert number == r + 1
        deviations.append(np.concatenate([(model[w] - w0[w] - total[w]).reshape(-1) for w in plan.weight_names]))
    sigma, d = z * CLIP / n, deviations[0].size
    for dev in deviations[:2]:  # one node's noise each: std z C / n
        assert abs(float(dev.std()) / sigma - 1) < 6 / math.sqrt(2 * d), (dev.std(), sigma)
    assert abs(float(deviations[2].std()) / (sigma * math.sqrt(2)) - 1) < 6 / math.sqrt(2 * d)
    corr = np.corrcoef(deviations)
    assert abs(corr[0, 1]) < 6 / math.sqrt(d)  # round 2's node replaced round 1's
    assert abs(corr[1, 2] - 1 / math.sqrt(2)) < 6 / math.sqrt(d)  # the new tree adds to the last one's
    records = admin.rounds("digits")
    assert [(r["metrics"]["dp_tree"], r["metrics"]["dp_tree_round"]) for r in records] == [(1, 1), (1, 2), (2, 1)]
    for steps, record in zip([[1], [2], [2, 1]], records, strict=True):
        accountant = rdp_lib.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
        for k in steps:
            accountant.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z, k))
        assert record["metrics"]["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def test_a_dp_ftrl_task_restarted_starts_a_new_tree_and_accounts_it(tmp_path) -> None:
    """The tree's noise is in memory only: a restarted server cannot go on with it, so its next
    round opens a tree of its own, and the ledger rebuilt from the records counts both trees."""
    n, z, delta = 3, 2.0, 1e-5
    dp = DPConfig(mode="central", noise_multiplier=z, clip=CLIP, delta=delta, tree_rounds=4)
    with ServerThread(tmp_path / "server.db") as server, server.admin() as admin:
        plan, _ = deploy(admin, **_config(n, dp))
        _run_round(server, _updates(plan, n, seed=1, examples=[4.0] * n))
    with ServerThread(tmp_path / "server.db") as server, server.admin() as admin:
        _run_round(server, _updates(plan, n, seed=2, examples=[4.0] * n))
        _run_round(server, _updates(plan, n, seed=3, examples=[4.0] * n))
        records = admin.rounds("digits")
    assert [(r["metrics"]["dp_tree"], r["metrics"]["dp_tree_round"]) for r in records] == [(1, 1), (2, 1), (2, 2)]
    assert records[-1]["metrics"]["epsilon"] == pytest.approx(acc.tree_epsilon(((z, 1), (z, 2)), delta), rel=1e-12)
    assert records[-1]["metrics"]["dp_rounds"] == 3


def test_dp_ftrl_outside_central_dp_at_a_fixed_clip_is_refused_naming_the_field() -> None:
    for extra in ({"target_quantile": 0.5}, {"sampling_probability": 0.1}):
        with pytest.raises(ValueError, match=r"dp\.tree_rounds"):
            DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, tree_rounds=8, **extra)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dp\.tree_rounds"):
        DPConfig(mode="distributed", noise_multiplier=1.0, clip=1.0, tree_rounds=8)


def test_a_noised_aggregate_that_is_not_finite_is_abandoned_not_committed(server, admin) -> None:
    class InfiniteNoise(np.random.Generator):
        """A noise source gone wrong: every draw is infinite (the server's source is a parameter)."""

        def normal(self, loc=0.0, scale=1.0, size=None):  # type: ignore[override]
            return np.full(size if size is not None else (), np.inf)

    server.service.dp_random = lambda: InfiniteNoise(np.random.PCG64(0))
    n = 3
    plan, w0 = deploy(admin, **_config(n, DPConfig(mode="central", noise_multiplier=1.0, clip=CLIP)))
    _run_round(server, _updates(plan, n, seed=7, examples=[4.0] * n))
    (record,) = admin.rounds("digits")
    assert record["status"] == "abandoned"
    assert "non-finite" in record["metrics"]["error"]
    assert "epsilon" not in record["metrics"]  # an abandoned round spends nothing
    model, number = admin.model("digits")
    assert number == 0
    for w in plan.weight_names:
        np.testing.assert_array_equal(model[w], w0[w])


# ----------------------------------------------------------------------------- deploy refusals
@pytest.fixture(scope="module")
def refusing(tmp_path_factory) -> Iterator[AdminClient]:
    """One server for the module's refused deploys, which store nothing: each test's own server would
    cost it a start and a stop (a quarter of a second) for one request; a deploy that was taken shows
    in its own test's refusal check and in the next one's empty task list."""
    with ServerThread(tmp_path_factory.mktemp("refusing") / "server.db") as server, server.admin() as admin:
        yield admin


def _refused(admin: AdminClient, body: dict | list) -> AdminError:
    admin.create_population("digits")
    with pytest.raises(AdminError) as info:
        if isinstance(body, list):
            admin.deploy_tasks("digits", body)
        else:
            admin.deploy_body("digits", body)
    assert 400 <= info.value.status < 500
    return info.value


def _body(plan, config: RoundConfig, name: str = "train") -> dict:
    return task_body(name, plan, encode_checkpoint(initial_weights(plan, seed=0)), config)


def test_central_dp_on_a_secure_aggregation_task_is_refused_naming_distributed(refusing) -> None:
    plan = digits_plan("softmax", secure_aggregation=True)
    config = RoundConfig(report_timeout_s=60, dp=DPConfig(mode="central", noise_multiplier=1.0, clip=1.0))
    err = _refused(refusing, _body(plan, config))
    assert err.code == "BAD_CONFIG"
    assert "dp.mode" in str(err) and '"distributed"' in str(err)


def test_dp_on_an_evaluation_task_is_refused(refusing) -> None:
    plan = digits_plan()
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0)
    evaluation = task_body("eval", build_eval_plan(plan), None, RoundConfig(dp=dp), evaluates="train")
    err = _refused(refusing, [_body(plan, RoundConfig()), evaluation])
    assert err.code == "BAD_CONFIG"
    assert "dp" in str(err) and "training tasks" in str(err)


def test_a_count_noise_that_spends_the_whole_budget_is_refused_naming_the_field(refusing) -> None:
    dp = DPConfig(mode="central", noise_multiplier=2.0, clip=1.0, target_quantile=0.5)  # default sigma_b 10/20 < z/2
    err = _refused(refusing, _body(digits_plan(), RoundConfig(dp=dp)))
    assert err.code == "BAD_CONFIG" and "dp.clipped_count_stddev" in str(err)


def test_a_budget_not_even_one_round_fits_is_refused_naming_the_field(refusing) -> None:
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=1.0, max_epsilon=1.0)  # one round costs 4.4
    err = _refused(refusing, _body(digits_plan(), RoundConfig(dp=dp)))
    assert err.code == "BAD_CONFIG" and "dp.max_epsilon" in str(err)


def test_dp_clip_beside_clip_update_norm_is_taken(admin) -> None:
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=0.1)
    admin.create_population("digits")
    deployed = admin.deploy_body("digits", _body(digits_plan(), RoundConfig(clip_update_norm=10.0, dp=dp)))
    assert deployed["task"] == "train" and deployed["status"] == "active"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("noise_multiplier", -1.0, "greater than or equal to 0"),
        ("noise_multiplier", "NaN", "valid number"),
        ("noise_multiplier", 1e-300, "below 0.01"),
        ("noise_multiplier", 1e300, "less than or equal to"),
        ("clip", 0, "greater than 0"),
        ("clip", "1.0", "valid number"),
        ("delta", 0.5, "less than or equal to 0.1"),
        ("delta", 1e400, "finite number"),
        ("max_epsilon", -3.0, "greater than 0"),
        ("bitwidth", 32.5, "valid integer"),
        ("weighting", "by_examples", "'unweighted' or 'capped'"),
        ("sampling_probability", 0.0, "greater than 0"),
    ],
)
def test_a_dp_field_out_of_range_in_the_deploy_body_is_a_400_naming_it(refusing, field, value, words) -> None:
    """The JSON a client other than ``AdminClient`` may send (Python's json writes NaN and inf as
    bare words, which the server's parser takes): refused before anything is stored, with the
    stable code and the field's path, never a 500."""
    refusing.create_population("digits")
    body = _body(digits_plan(), RoundConfig(dp=DPConfig(mode="central", noise_multiplier=1.0, clip=1.0)))
    body["config"]["dp"][field] = value
    r = refusing.http.post(
        "/v1/populations/digits/tasks", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "BAD_CONFIG" and "dp" in error["message"] and words in error["message"], error
    assert f"dp.{field}" in error["message"], error
    assert refusing.status("digits")["tasks"] == []


def test_a_task_withholding_its_counts_publishes_none_of_them_in_its_rounds_or_its_status(server, admin) -> None:
    """``dp.counts="withheld"``: the rounds listing (what ``fedfleet rounds`` and ``rounds_frame``
    read) and the population's status carry no count that tells a round with a device from one
    without; the epsilon, the model and the round's outcome are published as before."""
    n = 3
    dp = DPConfig(mode="central", noise_multiplier=1.0, clip=CLIP, counts="withheld")
    plan, _ = deploy(admin, **_config(n, dp))
    updates = _updates(plan, n, seed=4, examples=[3.0, 5.0, 8.0])
    _run_round(server, updates[:2])
    status = admin.status("digits")  # two of three reported so far
    assert status["round"] == 1 and "current_round" not in status
    _run_round(server, updates[2:])
    (record,) = admin.rounds("digits")
    m = record["metrics"]
    assert record["status"] == "committed" and m["counts"] == "withheld" and m["epsilon"] > 0
    assert not set(m) & {"selected", "reported", "rejected_late", "aborted", "dropped", "shapes", "duration_s"}, m
    assert "reported" not in admin.rounds_frame("digits").columns
