"""Distributed differential privacy end to end, over real HTTP (uvicorn on loopback).

Real ``FLRuntime`` devices with attested keys and the authority's trust anchor train on their own
digits, clip their mean deltas, rotate, round and add their noise shares (``device_runtime.ddp``)
under Secure Aggregation; the real server decodes each group's sum and commits the unweighted
mean. The committed model must be the devices' clipped mean plus noise of the calibrated std;
a server that lowers the noise must be refused by every device, and a group that falls below the
fewest devices it may release must release nothing."""

from __future__ import annotations

import base64

import dp_accounting
import numpy as np
import pytest

from device_runtime import DPPolicy, FLRuntime, Outcome, build_eval_plan
from device_runtime.ddp import DDPParams, calibrate, clip_l2
from device_runtime.dp_policy import (
    DP_NOISE_BELOW_FLOOR,
    DP_PARAMS_INVALID,
    check_round,
    encode_update,
    mean_delta,
    round_answer,
    update_dim,
)
from device_runtime.protocol import ProtocolClient
from device_runtime.secure_client import SecureOutcome
from device_runtime.secure_sum import config_from_json
from server_stub import AdminError, DPConfig
from server_stub.secure_rounds import SecureRound
from tests.support import (
    AttestedRuntimes,
    attested_checkins,
    deploy,
    deploy_secure,
    digits_plan,
    on_secure_rounds,
    run_secure_aggregations,
)

DELTA = 1e-6
CLIP = 0.05  # below the digits devices' mean deltas: every update is clipped


class RecordingRuntime(FLRuntime):
    """The real runtime; it keeps the update it encodes so that the test knows what was summed."""

    update: dict[str, np.ndarray] | None = None

    def _ddp_report(self, rec, secure, plan, result):  # noqa: ANN001, ANN202 - the runtime's own
        self.update = {k: np.array(v) for k, v in result.update.items()}
        return super()._ddp_report(rec, secure, plan, result)


@pytest.fixture
def devices(attested_server, attested_runtimes, population):
    """``make(count, **options)``: recording runtimes of this test's population on the module's server."""

    def make(count: int, **options) -> AttestedRuntimes:
        return attested_runtimes(attested_server.url, population, count, runtime=RecordingRuntime, **options)

    return make


def _deploy(admin, population: str, *, z: float, devices: int, bitwidth: int = 32, **dp):
    return deploy_secure(
        admin,
        population,
        goal_count=devices,
        dp=DPConfig(mode="distributed", noise_multiplier=z, clip=CLIP, bitwidth=bitwidth, **dp),
    )


def _flat(model: dict, names) -> np.ndarray:
    return np.concatenate([np.asarray(model[n], np.float64).reshape(-1) for n in names])


def _committed(admin, population, plan, w0, runtimes) -> tuple[np.ndarray, DDPParams, dict]:
    """The committed model's move away from the clipped unweighted mean, the round's parameters and its record."""
    (record,) = admin.rounds(population)
    assert record["status"] == "committed", record["metrics"]
    model, round_number = admin.model(population)
    assert round_number == 1
    wire = dict(record["metrics"]["secagg"]["ddp"])
    wire.pop("rotation_seed")
    params = DDPParams(**wire)
    clipped = [clip_l2(mean_delta(r.update, plan.weight_names), CLIP) for r in runtimes]
    mean = np.mean(clipped, axis=0)
    return _flat(model, plan.weight_names) - _flat(w0, plan.weight_names) - mean, params, record


def test_without_noise_the_committed_model_is_the_clipped_unweighted_mean(attested_admin, population, devices):
    plan, w0 = _deploy(attested_admin, population, z=0.0, devices=5)
    fleet = devices(5)
    results = fleet.run()
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 5
    deviation, params, record = _committed(attested_admin, population, plan, w0, fleet.runtimes)
    assert record["metrics"]["secagg"]["summed_devices"] == 5
    assert params.local_variance == 0.0 and params.min_devices == 5 and params.max_devices == 5
    # every update was clipped: unclipped, the mean would be far off
    assert all(np.linalg.norm(mean_delta(r.update, plan.weight_names)) > CLIP for r in fleet.runtimes)
    # each device's rounding moves each rotated coordinate by less than 1/gamma; float32 the rest
    bound = np.sqrt(params.padded_dim) / params.gamma + 1e-6
    assert np.linalg.norm(deviation) <= bound


def test_with_noise_the_committed_model_deviates_from_the_clipped_mean_by_the_calibrated_std(
    attested_admin, population, devices
):
    one_round = dp_accounting.get_epsilon_gaussian(1.0, DELTA)  # one Gaussian mechanism at z = 1
    plan, w0 = _deploy(attested_admin, population, z=1.0, devices=5, delta=DELTA, max_epsilon=one_round * 1.01)
    fleet = devices(5)
    results = fleet.run()
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 5
    deviation, params, record = _committed(attested_admin, population, plan, w0, fleet.runtimes)
    # the round is accounted as dp-accounting accounts one Gaussian mechanism at z, and the task,
    # whose budget a second round would pass, completes instead of opening one
    m = record["metrics"]
    assert (m["dp_rounds"], m["noise_multiplier"], m["delta"], m["dp_mode"]) == (1, 1.0, DELTA, "distributed")
    assert m["epsilon"] == pytest.approx(one_round, rel=1e-12)
    assert attested_admin.status(population)["tasks"][0]["status"] == "completed"
    assert params.noise_multiplier == 1.0 and params.effective_noise_multiplier(5) >= 1.0 - 1e-9
    expected = params.central_std(5) / 5  # the mean's noise per coordinate
    assert expected >= CLIP / 5  # at least z * clip on the sum
    d = deviation.size
    # the sample std of d roughly independent normal coordinates: within 6 of its sqrt(1 / 2d) relative sds
    assert abs(deviation.std() / expected - 1.0) < 6.0 / np.sqrt(2 * d)
    assert abs(deviation.mean()) < 6.0 * expected / np.sqrt(d)


class LowerNoise(SecureRound):
    """A malicious server's round: each device is told a tenth of its noise share."""

    def ddp_answer(self) -> dict | None:
        answer = super().ddp_answer()
        if answer is not None:
            answer = {**answer, "local_variance": answer["local_variance"] / 10}
        return answer


def _told(server, monkeypatch) -> list[str]:
    """The abort reasons the real service hears (its ``abort`` wrapped, not replaced, until the test ends)."""
    told: list[str] = []
    real_abort = server.service.abort

    def abort(session_id, token, reason, stats=None):  # noqa: ANN001, ANN202 - the service's own
        told.append(reason)
        return real_abort(session_id, token, reason, stats)

    monkeypatch.setattr(server.service, "abort", abort)
    return told


def _lower_noise(secure: SecureRound) -> None:
    secure.__class__ = LowerNoise


@pytest.mark.parametrize("lowered", [True, False], ids=["a-server-lowering-the-noise", "an-app-floor-above-the-task's"])
def test_a_round_below_the_device_noise_floor_is_refused_by_every_device(
    attested_server, attested_admin, population, devices, monkeypatch, lowered
):
    """A malicious server sends a tenth of the calibrated noise shares (the device holds no floor
    of its own: the task's noise is its floor); or an honest server runs a task at z = 1 for
    devices whose app asks for z >= 2. Every device refuses before it advertises a key or trains,
    says why in its session result, its opstats and to the server, and nothing is committed."""
    server, admin = attested_server, attested_admin
    if lowered:
        on_secure_rounds(monkeypatch, server, population, _lower_noise)
    told = _told(server, monkeypatch)
    _deploy(admin, population, z=1.0, devices=5)
    fleet = devices(5, dp_policy=DPPolicy() if lowered else DPPolicy(min_noise_multiplier=2.0))
    results = fleet.run()
    for i, res in enumerate(results):
        assert res.outcome is Outcome.REPORT_REJECTED and res.rejection_code == DP_NOISE_BELOW_FLOOR
        assert "training_started" not in [e.kind for e in res.events]
        stored = [
            e.detail["reason"]
            for s in fleet.opstats[i].sessions(population)
            for e in s.events
            if e.detail.get("code") == DP_NOISE_BELOW_FLOOR
        ]
        assert len(stored) == 1 and "noise multiplier" in stored[0]
    assert len(told) == 5 and all("distributed DP" in r and "noise multiplier" in r for r in told)
    assert all(r["status"] != "committed" for r in admin.rounds(population))


def _recalibrated(params: DDPParams, seed: int, **change) -> dict:
    """The round's answer recomputed by the server's own calibration with ``change``: parameters
    that are self-consistent, only not the round's."""
    kept = {
        k: getattr(params, k) for k in ("noise_multiplier", "clip", "dim", "bitwidth", "min_devices", "max_devices")
    }
    return round_answer(calibrate(**{**kept, **change}, mechanism=params.mechanism), seed)


#: A malicious server's edits of the round's DP parameters, each to a device with the given floor.
TAMPERED = {
    "lowers-the-noise-multiplier": (
        lambda p, seed, answer: _recalibrated(p, seed, noise_multiplier=0.25),
        DPPolicy(min_noise_multiplier=1.0),
        DP_NOISE_BELOW_FLOOR,
    ),
    "raises-the-clip": (
        lambda p, seed, answer: {**answer, "clip": answer["clip"] * 4},
        DPPolicy(),
        DP_NOISE_BELOW_FLOOR,
    ),
    "claims-more-devices-per-sum": (
        lambda p, seed, answer: _recalibrated(p, seed, min_devices=p.min_devices * 3, max_devices=p.max_devices * 3),
        DPPolicy(),
        DP_NOISE_BELOW_FLOOR,
    ),
    "changes-the-bitwidth": (
        lambda p, seed, answer: _recalibrated(p, seed, bitwidth=40),
        DPPolicy(),
        DP_PARAMS_INVALID,
    ),
    "changes-the-rotation-seed": (
        lambda p, seed, answer: {**answer, "rotation_seed": (seed + 1) % (1 << 64)},
        DPPolicy(),
        DP_PARAMS_INVALID,
    ),
}


@pytest.mark.parametrize("tamper", list(TAMPERED))
def test_a_server_that_tampers_with_the_rounds_dp_parameters_is_refused_by_every_device(
    attested_server, attested_admin, population, devices, monkeypatch, tamper
):
    """Beside a smaller variance (above): a noise multiplier lowered with shares recalibrated to
    it (refused by devices whose app holds a floor: without one, the task's multiplier is what
    the server says), a clip raised under the same shares, shares sized for sums of more devices
    than the group releases, another modulus, another rotation seed. Every device refuses before
    it trains, with the typed reason in its result and its opstats; nothing is committed."""
    server, admin = attested_server, attested_admin
    edit, policy, code = TAMPERED[tamper]

    class Tampered(SecureRound):
        def ddp_answer(self) -> dict | None:
            answer = super().ddp_answer()
            assert answer is not None and self.ddp_params is not None
            return edit(self.ddp_params, self.rotation_seed, answer)

    def tampered(secure: SecureRound) -> None:
        secure.__class__ = Tampered

    on_secure_rounds(monkeypatch, server, population, tampered)
    _deploy(admin, population, z=1.0, devices=5)
    fleet = devices(5, dp_policy=policy)
    results = fleet.run()
    for i, res in enumerate(results):
        assert res.outcome is Outcome.REPORT_REJECTED and res.rejection_code == code, (res.rejection_code, res.events)
        assert "training_started" not in [e.kind for e in res.events]
        stored = [e for s in fleet.opstats[i].sessions(population) for e in s.events if e.detail.get("code") == code]
        assert len(stored) == 1 and stored[0].kind == "upload_rejected"
    assert all(r["status"] != "committed" for r in admin.rounds(population))


def test_a_group_that_falls_below_its_releasable_minimum_releases_nothing(attested_admin, population, devices):
    """Six devices, one group (k = 5, one spare); two stop after training, before their masked
    inputs: four are fewer than the five any released sum must hold, so the group aborts and the
    round commits nothing: no sum of four devices' noise shares is ever decoded."""
    admin = attested_admin
    plan, w0 = _deploy(admin, population, z=1.0, devices=6)
    fleet = devices(6)
    results = fleet.run(drop=frozenset({0, 1}))
    assert [r.outcome for r in results[:2]] == [Outcome.INTERRUPTED] * 2
    assert all(r.outcome is Outcome.REPORT_REJECTED for r in results[2:])
    (record,) = admin.rounds(population)
    assert record["status"] == "abandoned"
    stats = record["metrics"]["secagg"]
    assert stats["groups"] == 1 and stats["completed"] == 0 and stats["summed_devices"] == 0
    assert "epsilon" not in record["metrics"] and "dp_rounds" not in record["metrics"]  # nothing released
    model, round_number = admin.model(population)
    assert round_number == 0
    assert all(np.array_equal(model[n], w0[n]) for n in plan.weight_names)


@pytest.mark.parametrize(
    ("plan", "bitwidth", "words"),
    [
        (lambda: digits_plan("softmax"), 32, "add secure aggregation to the plan, or use dp.mode 'central'"),
        (lambda: digits_plan("softmax", secure_aggregation=True), 8, "dp.bitwidth 8 is too small"),
        (lambda: digits_plan("softmax", secure_aggregation=True), 60, "use dp.bitwidth 53 or less"),
        (lambda: build_eval_plan(digits_plan("softmax", secure_aggregation=True)), 32, "only training tasks take dp"),
    ],
    ids=["without-secure-aggregation", "bitwidth-too-small", "bitwidth-too-wide", "not-a-training-task"],
)
def test_a_distributed_dp_task_that_cannot_run_is_refused_at_deploy_naming_the_field(
    server, admin, plan, bitwidth, words
):
    with pytest.raises(AdminError) as refused:
        deploy(
            admin,
            plan=plan(),
            report_timeout_s=60.0,
            dp=DPConfig(mode="distributed", noise_multiplier=1.0, clip=1.0, bitwidth=bitwidth),
        )
    assert refused.value.status == 400 and refused.value.code == "BAD_CONFIG"
    assert words in str(refused.value)
    if bitwidth == 8:  # the message names the bitwidth that fits
        assert "raise bitwidth to at least" in str(refused.value)
    assert admin.status("digits")["tasks"] == []


def test_a_clip_no_encoding_can_scale_to_is_refused_at_deploy_naming_it(server, admin):
    """A clip so small that the scale factor overflows: a 400 naming dp.clip, not the encoding's gamma alone."""
    with pytest.raises(AdminError) as refused:
        deploy(
            admin,
            plan=digits_plan("softmax", secure_aggregation=True),
            report_timeout_s=60.0,
            dp=DPConfig(mode="distributed", noise_multiplier=1.0, clip=1e-300),
        )
    assert refused.value.status == 400 and refused.value.code == "BAD_CONFIG"
    assert "dp.clip 1e-300" in str(refused.value)
    assert admin.status("digits")["tasks"] == []


def test_a_group_sum_out_of_bounds_is_dropped_not_committed(attested_server, attested_admin, authority, population):
    """Five attested devices at the protocol level; one adds a quarter of the modulus to every
    entry of its encoding (a protocol-following device outside the mechanism). The decoded sum's
    norm is far above what five clipped, noised updates reach: the group is dropped with the
    reason in the round's metrics, its devices are told, and the model does not move. The server
    has unmasked the group's noisy sum all the same (a server colluding with the odd device
    subtracts its shift and holds the honest four's noisy sum), so the abandoned round spends one
    round of the task's budget, and the task, whose budget a second round would pass, completes."""
    server, admin = attested_server, attested_admin
    one_round = dp_accounting.get_epsilon_gaussian(1.0, DELTA)
    plan, w0 = _deploy(admin, population, z=1.0, devices=5, delta=DELTA, max_epsilon=one_round * 1.01)
    devices = attested_checkins([ProtocolClient(server.url) for _ in range(5)], authority, population)
    rng = np.random.default_rng(3)
    vectors = []
    for i, d in enumerate(devices):
        state = d.client.secagg_poll(d.session)
        accepted = check_round(
            state["ddp"],
            config=config_from_json(state["config"]),
            group_size=5,
            dim=update_dim({w: w0[w].shape for w in plan.weight_names}, plan.weight_names),
            commitment=base64.b64decode(d.session.secagg_commitment),
        )
        assert accepted is not None
        update = {w: rng.normal(0.0, 0.1, w0[w].shape).astype(np.float32) for w in plan.weight_names}
        update["num_examples"] = np.float32(10.0)
        vector = encode_update(update, plan.weight_names, accepted, rng)
        if i == 0:
            vector = (vector + np.uint64(accepted.params.modulus // 4)) % np.uint64(accepted.params.modulus)
        vectors.append(vector)
    outcomes = {i: (r.outcome, r.detail) for i, r in run_secure_aggregations(devices, vectors, authority).items()}
    (record,) = admin.rounds(population)
    assert record["status"] == "abandoned" and record["metrics"]["reported"] == 0
    (dropped,) = record["metrics"]["secagg"]["dropped"]
    assert "norm of the decoded sum" in dropped["reason"]
    assert {o for o, _ in outcomes.values()} == {SecureOutcome.ABORTED}
    assert all("left the group's sum out" in detail for _, detail in outcomes.values())
    model, round_number = admin.model(population)
    assert round_number == 0 and all(np.array_equal(model[n], w0[n]) for n in plan.weight_names)
    metrics = record["metrics"]
    assert (metrics["dp_rounds"], metrics["dp_mode"], metrics["noise_multiplier"]) == (1, "distributed", 1.0)
    assert metrics["epsilon"] == pytest.approx(one_round, rel=1e-12)
    assert admin.status(population)["tasks"][0]["status"] == "completed"
