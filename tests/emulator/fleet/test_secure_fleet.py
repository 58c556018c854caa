"""A secure task in the fleet simulation: attested devices (the SDK's default privacy floor) run
Secure Aggregation in groups of five on the virtual clock, and the server commits only group sums.

The committed models are checked against the oracle of plain aggregation: the server's own plan
graphs applied to the float updates of the devices the groups summed (recorded where the device
hands its update to Secure Aggregation), equal up to the quantization of the secure sum."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest

from device_runtime import PlanExecutor, initial_weights
from device_runtime.checkpoint import decode_checkpoint
from device_runtime.protocol import ProtocolClient
from device_runtime.runtime import FLRuntime, Outcome
from device_runtime.secure_client import SecureAggregation, SecureOutcome
from emulator.fleet import FleetConfig, FleetRun, device_examples, fleet_dataset, generate_population, simulate
from emulator.fleet.report import completion_note
from emulator.fleet.simulator import FleetSimulator
from emulator.fleet.tables import RoundRow
from secagg import Quantizer
from server_stub.secure_rounds import ROUND_ABANDONED, SecureRound

#: The module's fleets are built once per run: its tests go to one pytest-xdist worker, and its fixtures
#: are session-scoped, so that no test run between two of them makes the worker build them again.
pytestmark = pytest.mark.xdist_group("test_secure_fleet")

GROUP = 5
GOAL = 10


def secure_config(seed: int = 3) -> FleetConfig:
    data = FleetConfig.default().model_dump()
    data["fleet"].update({"devices": 60, "hours": 2.0, "start_utc_hour": 6.0, "seed": seed})
    data["task"].update(
        {
            "goal_count": GOAL,
            "retry_min_s": 60.0,
            "retry_max_s": 300.0,
            "selection_timeout_s": 300.0,
            "compute_s_per_example": 0.2,
            "secure": True,
            "secagg_group_size": GROUP,
        }
    )
    return FleetConfig.from_dict(data)


class _RecordingSimulator(FleetSimulator):
    """Keeps the server's round records (with their Secure Aggregation statistics) and committed
    models, read before the run closes its store."""

    records: list[dict]
    models: dict[str, dict]

    def _rounds(self):  # type: ignore[override]
        self.records = self.service.rounds(self.population)
        self.models = {
            r["checkpoint_id"]: decode_checkpoint(self.store.get_resource(r["checkpoint_id"]))
            for r in self.records
            if r["status"] == "committed"
        }
        return super()._rounds()


def _run(
    config: FleetConfig,
    updates: dict[str, dict] | None = None,
    summed: dict[str, list[str]] | None = None,
    polls: list[tuple[float, float]] | None = None,
) -> tuple[FleetRun, _RecordingSimulator]:
    """``updates``: each secure session's float update, as the device hands it to Secure
    Aggregation; ``summed``: the sessions each round's completed groups summed, by round label;
    ``polls``: (virtual time, asked wait) of every Secure Aggregation poll."""
    specs = generate_population(config)
    dataset = fleet_dataset(config)
    with tempfile.TemporaryDirectory(prefix="fedfleet-secure-") as tmp:
        sim = _RecordingSimulator(
            config, specs, lambda spec: device_examples(config, spec), (dataset.x_test, dataset.y_test), workdir=tmp
        )
        if updates is None or summed is None or polls is None:
            return sim.run(), sim
        report, group_sum, poll = FLRuntime._secure_report, SecureRound.group_sum, ProtocolClient.secagg_poll

        def recording_report(runtime, rec, secure, session, plan, result):
            updates[session.session_id] = {k: np.array(v) for k, v in result.update.items()}
            return report(runtime, rec, secure, session, plan, result)

        def recording_group_sum(secure_round, group):
            total, sessions = group_sum(secure_round, group)
            summed.setdefault(secure_round.label, []).extend(sessions)
            return total, sessions

        def recording_poll(client, session, *, after=None, wait_s=0.0):
            polls.append((sim.loop.now, wait_s))
            return poll(client, session, after=after, wait_s=wait_s)

        with pytest.MonkeyPatch.context() as patch:  # spies: the real methods run
            patch.setattr(ProtocolClient, "secagg_poll", recording_poll)
            patch.setattr(FLRuntime, "_secure_report", recording_report)
            patch.setattr(SecureRound, "group_sum", recording_group_sum)
            return sim.run(), sim


@pytest.fixture(scope="session")
def runs() -> dict:
    updates: dict[str, dict] = {}
    summed: dict[str, list[str]] = {}
    polls: list[tuple[float, float]] = []
    a, sim = _run(secure_config(), updates, summed, polls)
    b, _ = _run(secure_config())
    return {"a": a, "b": b, "sim": sim, "updates": updates, "summed": summed, "polls": polls}


def _label(record: dict) -> str:
    return f"{record['task']}/{record['round']}/{record['attempt']}"


def test_a_secure_fleet_repeats_with_its_seed(runs):
    a, b = runs["a"], runs["b"]
    assert a.digest == b.digest
    assert [(r.round_id, r.committed, r.accepted) for r in a.rounds] == [
        (r.round_id, r.committed, r.accepted) for r in b.rounds
    ]


def test_devices_wait_for_their_groups_on_the_virtual_clock(runs):
    """No poll asks the server to hold it (it would wait in real time, which the simulation does
    not share): the waiting is the device's own sleep, so virtual time passes between polls."""
    polls = runs["polls"]
    assert len(polls) > 100
    assert all(wait == 0.0 for _, wait in polls)
    assert polls[-1][0] - polls[0][0] > 600.0


def test_rounds_commit_from_completed_groups_of_attested_devices(runs):
    """Under the devices' default floor only an attested cohort can commit anything; each
    committed round's accepted reports are exactly the devices its completed groups summed, and
    every device that saw its upload complete is one of them (a device that died after its masked
    input went in is still summed: its peers' shares recover its mask)."""
    sim, run, summed = runs["sim"], runs["a"], runs["summed"]
    committed = [r for r in sim.records if r["status"] == "committed"]
    assert len(committed) >= 2
    for record in committed:
        m = record["metrics"]
        stats = m["secagg"]
        assert stats["completed"] >= 1 and stats["groups"] == stats["completed"] + stats["aborted"]
        assert stats["summed_devices"] == m["reported"] >= math.ceil(GOAL * 0.8)
        assert stats["summed_devices"] >= GROUP * stats["completed"]
        assert len(summed[_label(record)]) == len(set(summed[_label(record)])) == stats["summed_devices"]
        uploaded = {
            s.session_id
            for s in run.sessions
            if s.round_id == f"{record['task']}/{record['round']}" and s.shape.endswith("^")
        }
        assert uploaded and uploaded <= set(summed[_label(record)])
    assert max(r.accuracy for r in run.rounds if r.committed) > 0.5  # ten classes: chance is 0.1


def test_each_committed_model_is_the_plain_aggregate_of_the_summed_devices_updates(runs):
    sim, updates, summed = runs["sim"], runs["updates"], runs["summed"]
    plan = sim.plan
    executor = PlanExecutor(plan)
    quantizer = Quantizer(bitwidth=plan.server.bitwidth, clip=plan.server.clip_range)
    state = initial_weights(plan, seed=sim.config.fleet.seed)
    checked = 0
    for record in sim.records:
        if record["status"] != "committed":
            continue
        sessions = summed[_label(record)]
        acc = executor.zero()
        for sid in sessions:  # plain aggregation: one accumulate per device update
            acc = executor.accumulate(acc, updates[sid])
        expected, _ = executor.update(state, executor.report(acc))
        model = sim.models[record["checkpoint_id"]]
        # stochastic rounding moves each device's entry by less than one quantization step
        step = 1.0 / quantizer.scale
        for name, value in expected.items():
            np.testing.assert_allclose(model[name], value, atol=step * len(sessions), rtol=1e-5)
        moved = max(float(np.abs(model[n] - state[n]).max()) for n in expected)
        assert moved > 10 * step  # the check compares real training, not two copies of the old model
        state = model
        checked += 1
    assert checked >= 2


@pytest.mark.slow
def test_a_secure_fleet_sharded_over_ray_gives_the_digest_of_one_process(runs):
    """Every shard derives the same authority and device keys from the seed, so the groups and
    their sums are those of the single-process run."""
    pytest.importorskip("ray")
    from emulator.fleet.ray_backend import simulate_sharded

    sharded = simulate_sharded(secure_config(), shards=2, progress=False)
    assert sharded.digest == runs["a"].digest


def test_a_crowds_secure_participants_are_told_its_pace_as_plain_ones_are():
    """A population checking in far faster than its rounds need is spread out by pace steering;
    a device its group summed is told the stretched window with its group's completion, as a
    plain report's answer tells it, and its session result carries it to the scheduler: told
    nothing, it would come back at its own cooldown into a full round."""
    data = secure_config().model_dump()
    data["fleet"].update({"devices": 300, "hours": 1.0})  # seed 3: 164 summed, 139 told the window
    config = FleetConfig.from_dict(data)
    told: dict[str, tuple[float, float] | None] = {}
    carried: dict[str, tuple[float, float] | None] = {}
    finish, outcome = SecureAggregation.finish, FLRuntime._secure_outcome

    def recording_finish(secure, vector):
        result = finish(secure, vector)
        if result.outcome is SecureOutcome.INCLUDED:
            told[secure.session.session_id] = result.retry_after_s
        return result

    def recording_outcome(runtime, rec, result, metrics, examples):
        session = outcome(runtime, rec, result, metrics, examples)
        if session.outcome is Outcome.COMPLETED:
            carried[rec.session.session_id] = session.retry_after_s
        return session

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecureAggregation, "finish", recording_finish)
        patch.setattr(FLRuntime, "_secure_outcome", recording_outcome)
        _run(config)
    assert carried == told and len(told) >= 50
    windows = [w for w in told.values() if w is not None]
    # the first rounds come before the server has seen a wait's worth of check-ins; after that,
    # every summed device is told the population's stretched window
    assert len(windows) >= len(told) / 2
    assert all(w[1] > config.task.retry_max_s for w in windows)


def test_a_small_secure_fleet_commits_the_rounds_it_fills_at_the_fleets_own_training_cost():
    """150 devices for an hour and a half, rounds of 13 seats (goal 10), sessions at the fleet's
    default cost (a second an example: about a quarter of the devices train past the window). A
    group releases its sum only with more than two thirds of its masked inputs: groups of k + 1 = 6
    lost theirs to two slow devices, and the round with them, and ConsistencyCheck and Unmasking ran
    out of the report window (before: 2 of the 8 rounds that filled committed). One group of the
    round's devices rides out its stragglers as the round's over-selection does."""
    data = FleetConfig.default().model_dump()
    data["fleet"].update({"devices": 150, "hours": 1.5, "start_utc_hour": 6.0, "seed": 0})
    data["task"].update({"goal_count": 10, "secure": True})
    config = FleetConfig.from_dict(data)
    run = simulate(config, progress=False)
    needed = math.ceil(10 * config.task.min_fraction)
    filled = [r for r in run.rounds if r.selected >= needed]
    assert len(filled) >= 6, [(r.round_id, r.selected) for r in run.rounds]
    assert sum(r.committed for r in filled) >= 2 / 3 * len(filled), run.summary()["round_completion_note"]


def _round(n: int, committed: bool, selected: int) -> RoundRow:
    nan = float("nan")
    accepted = selected if committed else 0
    return RoundRow(
        f"train/{n}/1",
        "train",
        300.0 * n,
        300.0 * n + 480.0,
        committed,
        selected,
        accepted,
        accepted,
        0,
        480.0,
        nan,
        nan,
    )


def test_the_completion_rate_counts_the_masked_inputs_of_the_groups_an_abandoned_round_completed():
    """Seed 1's 300 secure devices for 2 hours in groups of 8 (goal 20): round 2's first attempt lost
    one of its three groups short of masked inputs, and the one that completed summed 7 masked
    inputs, which the server counted as reported (rounds.csv accepted 7); the note said only that
    the round lost a group, as if it had nothing. It says what the completed groups summed (here
    against this module's task, whose rounds commit with 8 reports)."""
    config = secure_config()
    nan = float("nan")
    rounds = [
        RoundRow("train/2/1", "train", 305.0, 567.0, False, 26, 7, 7, 12, 262.0, nan, nan, outcome="abandoned"),
        RoundRow("train/2/2", "train", 567.0, 1047.0, False, 20, 0, 0, 10, 480.0, nan, nan, outcome="abandoned"),
    ]
    lost = {"aborted": 1, "aborted_in": {"MaskedInputCollection": 1}, "completed": 0}
    secure = {  # an abandoned round's completed group is dropped: its sum went unused
        "train/2/1": {"groups": 3, "summed_devices": 7, **lost, "dropped": [{"group": 2, "reason": ROUND_ABANDONED}]},
        "train/2/2": {"groups": 2, "summed_devices": 0, **lost, "dropped": []},
    }
    note = completion_note({"cannot_fill": None, "shapes": {}}, rounds, config.task, secure)
    assert "2 lost 2 of their 5 Secure Aggregation groups (2 short of masked inputs or of answers after them; " in note
    assert "their 1 other group completed, and the 7 masked inputs it summed count as reported (rounds.csv " in note
    assert f"short of the {math.ceil(config.task.goal_count * config.task.min_fraction)} a round needs" in note


def test_the_completion_rate_names_secure_groups_that_aborted_and_what_to_change():
    """A secure round that filled its seats and lost its groups is not 'short of reports': the
    note says a group needs more than two thirds of its masked inputs (a floor no option lowers),
    and what to change; a round whose groups never formed says why."""
    config = FleetConfig.default()
    rounds = [_round(1, True, 130), _round(2, False, 130), _round(3, False, 40), _round(4, False, 120)]
    secure = {
        "train/1/1": {"groups": 1, "completed": 1, "aborted": 0, "aborted_in": {}},
        "train/2/1": {"groups": 1, "completed": 0, "aborted": 1, "aborted_in": {"MaskedInputCollection": 1}},
        "train/3/1": {"groups": 0, "completed": 0, "aborted": 0, "aborted_in": {}},
        "train/4/1": {"groups": 0, "completed": 0, "aborted": 0, "ddp_error": "dp.bitwidth 8 is too small"},
    }
    summary = {"cannot_fill": None, "shapes": {"-v[]+^": 90, "-v[]+#": 60}}
    note = completion_note(summary, rounds, config.task, secure)
    assert note.startswith("3 of 4 rounds were abandoned: 1 closed their selection window")
    assert "1 lost 1 of their 1 Secure Aggregation groups (1 short of masked inputs" in note
    assert "more than two thirds of its devices, and at least task.secagg_group_size = 5," in note
    assert "task.report_timeout_s = 180 s" in note and "no option lowers" in note
    assert "1 formed no Secure Aggregation group: dp.bitwidth 8 is too small" in note
    assert "too few reports in time" not in note  # every abandoned round is explained above
    assert "Secure Aggregation" not in completion_note(summary, rounds, config.task)  # a plain run's note


def test_a_secure_runs_summary_counts_its_groups_by_the_protocol_round_they_aborted_in():
    """The summary (and the report's table) hold a secure run's groups: formed, completed, aborted
    by the protocol round they stopped in (in the protocol's order), refused, cut by their round's
    close (which add up to those formed), and the masked inputs summed;
    they were only in the note of a run whose rounds were abandoned. A plain run's are null, and its
    report has no such row."""
    from emulator.fleet.report import render_html
    from emulator.fleet.summary import summarize

    rounds = [_round(1, True, 130), _round(2, False, 130), _round(3, True, 130)]
    secure = {
        "train/1/1": {"groups": 2, "completed": 2, "aborted": 0, "aborted_in": {}, "summed_devices": 100},
        "train/2/1": {
            "groups": 2,
            "completed": 0,
            "aborted": 2,
            "aborted_in": {"MaskedInputCollection": 1, "ShareKeys": 1},
            "summed_devices": 0,
        },
        "train/3/1": {
            "groups": 3,
            "completed": 1,
            "aborted": 1,
            "aborted_in": {"Unmasking": 1},
            "summed_devices": 48,
            "dropped": [{"group": 2, "reason": "its sum is out of range"}],
        },
        "train/4/1": {
            "groups": 2,
            "completed": 0,
            "aborted": 1,
            "aborted_in": {"MaskedInputCollection": 1},
            "summed_devices": 0,
        },  # its other group was still running when the abort closed the round
    }
    config = FleetConfig.default()
    run = FleetRun([], rounds, [], "", config, simulated_s=3600.0, extra={"secure_rounds": secure})
    summary = summarize(run)
    assert summary["secure_groups"] == {
        "rounds": 4,
        "groups": 9,
        "completed": 3,
        "aborted": 4,
        "aborted_in": {"ShareKeys": 1, "MaskedInputCollection": 2, "Unmasking": 1},
        "refused": 1,
        "cut": 1,
        "summed_devices": 148,
    }
    assert list(summary["secure_groups"]["aborted_in"]) == ["ShareKeys", "MaskedInputCollection", "Unmasking"]
    page = render_html(summary, [], run)
    assert 'data-key="secure_groups"' in page and "aborted_in: ShareKeys: 1, MaskedInputCollection: 2" in page
    plain = FleetRun([], rounds, [], "", config, simulated_s=3600.0, extra={})
    assert summarize(plain)["secure_groups"] is None
    assert 'data-key="secure_groups"' not in render_html(summarize(plain), [], plain)


def test_a_secure_round_that_seated_enough_devices_and_formed_no_group_is_not_said_to_have_seated_too_few():
    """16 selected for a goal of 20 (16 reports commit), one of whom dropped out while the window
    was open: the server abandoned the round as its selection closed, before forming groups. The
    note said "(fewer selected devices than task.secagg_group_size)", 5, of a round of 16."""
    task = FleetConfig.default().replace(goal=20, secure=True).task
    rounds = [_round(1, True, 26), _round(2, False, 16)]
    secure = {"train/1/1": {"groups": 1, "completed": 1, "aborted": 0, "aborted_in": {}}, "train/2/1": {"groups": 0}}
    note = completion_note({"cannot_fill": None, "shapes": {}}, rounds, task, secure)
    assert "fewer selected devices than task.secagg_group_size" not in note
    assert (
        "1 formed no Secure Aggregation group (devices it had selected dropped out while its selection window" in note
    )
    assert "fewer than the 16 a commit needs were still in it when the window closed" in note
    few = completion_note(
        {"cannot_fill": None, "shapes": {}}, rounds, task.model_copy(update={"secagg_group_size": 20}), secure
    )
    assert "1 formed no Secure Aggregation group (fewer selected devices than task.secagg_group_size)" in few
