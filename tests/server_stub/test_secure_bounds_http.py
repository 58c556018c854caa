"""One device's influence on a Secure Aggregation round, over real HTTP (uvicorn on loopback).

The server never sees one device's update, so it checks what it does see: each group's decoded
sum, against what devices that bound their own updates could have sent (finite; total count
within [0, members x max_examples_per_report]; weight norm within clip_update_norm x the count).
A device that follows the protocol but not the bounds (here: ``num_examples = -1024`` and every
weight at +1024, inside the codec's clip range) gets its whole group dropped, with the reason in
the round's metrics, and the model moves no more than one honest device could move it."""

from __future__ import annotations

import numpy as np
import pytest

from device_runtime.protocol import ProtocolClient
from device_runtime.secure_client import SecureOutcome
from device_runtime.secure_sum import SecureSumCodec
from server_stub import AdminError
from tests.support import attested_checkins, deploy, deploy_secure, digits_plan, run_secure_aggregations

CLIP = 10.0  # clip_update_norm (the default)
MAX_EXAMPLES = 1000  # max_examples_per_report (the default)


def _honest(codec: SecureSumCodec, weights: tuple[str, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """An update as an honest device's bounds leave it: n in [10, 60), a mean delta of norm at most ``CLIP``."""
    n = float(rng.integers(10, 60))
    delta = {w: rng.normal(0.0, 1.0, codec.shapes[w]) for w in weights}
    scale = rng.uniform(0.1, 1.0) * CLIP / np.sqrt(sum(float(np.sum(d**2)) for d in delta.values()))
    update = {w: (d * scale * n).astype(np.float32) for w, d in delta.items()}
    update.update(
        {
            "loss_sum": np.float32(0.5 * n),
            "correct": np.float32(n / 2),
            "count": np.float32(n),
            "num_examples": np.float32(n),
        }
    )
    return update


def _attack(codec: SecureSumCodec, num_examples: float) -> dict[str, np.ndarray]:
    """The tester's device: every weight at +1024 (the codec's clip range) and a chosen count."""
    update = {name: np.full(codec.shapes[name], codec.quantizer.clip, np.float32) for name in codec.names}
    update.update(
        {
            "loss_sum": np.float32(0.0),
            "correct": np.float32(0.0),
            "count": np.float32(0.0),
            "num_examples": np.float32(num_examples),
        }
    )
    return update


def _run_round(
    server, authority, population: str, count: int, pick_vector
) -> tuple[dict[int, tuple[SecureOutcome, str]], dict[int, list[int]]]:
    """``count`` attested devices check in and run their groups; ``pick_vector(i, group_members)``
    gives device i's encoded update once the groups are known. Returns each device's outcome
    (with its detail) and the groups."""
    devices = attested_checkins([ProtocolClient(server.url) for _ in range(count)], authority, population)
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        groups.setdefault(d.client.secagg_poll(d.session)["group"], []).append(i)
    vectors = {i: pick_vector(i, next(g for g in groups.values() if i in g)) for i in range(count)}
    results = run_secure_aggregations(devices, vectors, authority)
    return {i: (r.outcome, r.detail) for i, r in results.items()}, groups


def _l2(model: dict, w0: dict, names) -> float:
    return float(np.sqrt(sum(np.sum((np.asarray(model[n], np.float64) - w0[n]) ** 2) for n in names)))


@pytest.mark.parametrize(
    ("num_examples", "words"),
    [(-1024.0, "num_examples"), (float(MAX_EXAMPLES), "norm")],
    ids=["negative-count", "count-within-bounds"],
)
def test_a_protocol_following_device_outside_the_bounds_gets_its_group_of_five_dropped(
    attested_server, attested_admin, authority, population, num_examples, words
):
    """The issue's round: one attested device of a group of 5 sends every weight at +1024 with
    ``num_examples`` -1024 (or the largest count it may declare). Before the check such a round
    committed (with a negative ``num_examples``) and moved the model by about 26,000; now the
    group is dropped and the round, with no other group, is abandoned: the model does not move."""
    server, admin = attested_server, attested_admin
    plan, w0 = deploy_secure(admin, population, goal_count=5)
    codec = SecureSumCodec(plan)
    rng = np.random.default_rng(7)
    outcomes, groups = _run_round(
        server,
        authority,
        population,
        5,
        lambda i, _: codec.encode(
            _attack(codec, num_examples) if i == 0 else _honest(codec, plan.weight_names, rng), rng
        ),
    )
    assert list(groups.values()) == [[0, 1, 2, 3, 4]]
    model, round_number = admin.model(population)
    assert _l2(model, w0, plan.weight_names) == 0.0 and round_number == 0
    (record,) = admin.rounds(population)
    assert record["status"] == "abandoned" and record["metrics"]["reported"] == 0
    stats = record["metrics"]["secagg"]
    assert stats["completed"] == 0 and stats["summed_devices"] == 0
    (dropped,) = stats["dropped"]
    assert dropped["group"] == 0 and words in dropped["reason"]
    assert {o for o, _ in outcomes.values()} == {SecureOutcome.ABORTED}  # every member is told its sum was left out
    assert all("left the group's sum out" in detail for _, detail in outcomes.values())


def test_a_round_commits_from_its_honest_group_and_moves_no_more_than_one_honest_device_could(
    attested_server, attested_admin, authority, population
):
    """Twelve devices, two groups of six; the attacker's group is dropped and the round commits
    from the other: exactly that group's mean, and within ``clip_update_norm`` of the old model."""
    server, admin = attested_server, attested_admin
    plan, w0 = deploy_secure(admin, population, goal_count=12, min_fraction=0.5)
    codec = SecureSumCodec(plan)
    rng = np.random.default_rng(8)
    vectors: dict[int, np.ndarray] = {}

    def pick(i: int, members: list[int]) -> np.ndarray:
        vectors[i] = codec.encode(_attack(codec, -1024.0) if i == 0 else _honest(codec, plan.weight_names, rng), rng)
        return vectors[i]

    outcomes, groups = _run_round(server, authority, population, 12, pick)
    (bad,) = [g for g, members in groups.items() if 0 in members]
    (good,) = [g for g in groups if g != bad]
    assert sorted(len(m) for m in groups.values()) == [6, 6]
    model, round_number = admin.model(population)
    assert round_number == 1
    assert _l2(model, w0, plan.weight_names) <= CLIP
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in groups[good]], axis=0), 6)
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6)
    (record,) = admin.rounds(population)
    assert record["status"] == "committed" and record["metrics"]["reported"] == 6
    assert record["metrics"]["secagg"]["summed_devices"] == 6
    assert [d["group"] for d in record["metrics"]["secagg"]["dropped"]] == [bad]
    assert {outcomes[i][0] for i in groups[bad]} == {SecureOutcome.ABORTED}
    assert {outcomes[i][0] for i in groups[good]} == {SecureOutcome.INCLUDED}


def test_a_device_whose_metric_sums_no_honest_device_computes_gets_its_group_dropped_and_nothing_published(
    attested_server, attested_admin, authority, population
):
    """The tester's round: four honest devices at accuracy 0.5 and loss 0.5, and one that follows
    every bound on its weights but sends ``correct`` 1,024 over a ``count`` of 0 and ``loss_sum``
    -1,024. Before the check the round committed and published a ``train_accuracy`` of 26 and a
    ``train_loss`` of -24.6; now the group is dropped with the reason and nothing is published."""
    server, admin = attested_server, attested_admin
    plan, w0 = deploy_secure(admin, population, goal_count=5)
    codec = SecureSumCodec(plan)
    rng = np.random.default_rng(9)
    clip_range = codec.quantizer.clip

    def pick(i: int, _: list[int]) -> np.ndarray:
        update = _honest(codec, plan.weight_names, rng)
        if i == 0:
            update.update(
                {"correct": np.float32(clip_range), "count": np.float32(0.0), "loss_sum": np.float32(-clip_range)}
            )
        return codec.encode(update, rng)

    outcomes, _ = _run_round(server, authority, population, 5, pick)
    (record,) = admin.rounds(population)
    assert record["status"] == "abandoned" and "train_accuracy" not in record["metrics"]
    (dropped,) = record["metrics"]["secagg"]["dropped"]
    assert "loss_sum" in dropped["reason"] and "sums non-negative values" in dropped["reason"]
    assert {o for o, _ in outcomes.values()} == {SecureOutcome.ABORTED}
    assert admin.model(population)[1] == 0


@pytest.mark.parametrize("max_loss", [None, 2.0], ids=["no-bound", "max_loss-2"])
def test_one_member_lifts_its_groups_published_loss_to_max_loss_and_no_further(
    attested_server, attested_admin, authority, population, max_loss
):
    """Four honest devices at loss 0.5 and one that sends ``loss_sum`` at the codec's clip range
    (1,024) over its honest count: the server sees only the group's sum, which passes every check.
    Without ``max_loss`` the round published a ``train_loss`` of 9.49; with ``max_loss`` 2 the
    group's loss is held to 2 times its count, so the round's is 2.0: one member lifts its group's
    mean loss to the bound and no further (the server sees no member's own), and the model commits
    as before."""
    server, admin = attested_server, attested_admin
    plan, _ = deploy_secure(admin, population, goal_count=5, max_loss=max_loss)
    codec = SecureSumCodec(plan)
    rng = np.random.default_rng(11)

    def pick(i: int, _: list[int]) -> np.ndarray:
        update = _honest(codec, plan.weight_names, rng)
        if i == 0:
            update["loss_sum"] = np.float32(codec.quantizer.clip)
        return codec.encode(update, rng)

    _run_round(server, authority, population, 5, pick)
    (record,) = admin.rounds(population)
    assert record["status"] == "committed", record
    loss = record["metrics"]["train_loss"]
    if max_loss is None:
        assert loss > 4.0
    else:
        assert 0.5 - 1e-3 <= loss <= max_loss + 1e-3


def test_a_secure_training_task_without_a_clip_norm_is_refused_at_deploy(server, admin):
    """Without ``clip_update_norm`` no sum could be checked for one device's influence: the deploy
    says what to set, and leaves nothing behind."""
    with pytest.raises(AdminError) as refused:
        deploy(admin, plan=digits_plan("softmax", secure_aggregation=True), report_timeout_s=60, clip_update_norm=None)
    assert refused.value.code == "BAD_CONFIG" and refused.value.status == 400
    assert "set clip_update_norm" in str(refused.value)
    assert admin.status("digits")["tasks"] == []
    # a plain task may still go unclipped: the server sees, caps and sums each report
    deploy(admin, plan=digits_plan("softmax"), population="plain", report_timeout_s=60, clip_update_norm=None)
