"""Differential privacy in the fleet: ``fedfleet simulate --dp central|distributed`` and its knobs
(and a fleet config's ``[dp]``) become every training task's ``RoundConfig.dp``; bad values are
refused in one line (exit 2); the audit's canary devices join the fleet and report their direction at
the clip; the summary and the report carry epsilon. The rounds' epsilon itself is the server's
(its accountant's), checked where a real server runs them (``tests/server_stub/test_central_dp_http.py``
and ``test_ddp_secure_http.py``) and against a fleet's own rounds (``test_fleet_audit.py``)."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import sqlite3

import dp_accounting
import numpy as np
import pytest

from device_runtime.checkpoint import decode_checkpoint
from emulator.cli.commands import main
from emulator.fleet import FleetConfig, simulate
from emulator.fleet.audit import canary_direction
from emulator.fleet.config import FleetConfigError
from emulator.fleet.population import generate_population
from emulator.fleet.report import _privacy_sentences, build_report
from emulator.fleet.simulator import FleetSimulator
from emulator.fleet.summary import privacy
from emulator.fleet.tables import FleetRun, RoundRow
from emulator.fleet.workload import load_workload
from server_stub import FLService, ServerStore
from server_stub.dp_config import DPConfig


def _dp(**keys: object) -> FleetConfig:
    return FleetConfig.default().replace(devices=40, hours=0.5, dp=keys)


def test_dp_flags_become_the_training_tasks_round_config():
    config = _dp(mode="central", noise_multiplier=0.7, clip=2.0, delta=1e-6, max_epsilon=8.0)
    rounds = load_workload(config).training[0].rounds
    assert rounds.dp == DPConfig(mode="central", noise_multiplier=0.7, clip=2.0, delta=1e-6, max_epsilon=8.0)


def test_dp_tree_rounds_makes_the_training_tasks_dp_ftrl(tmp_path, capsys):
    config = _dp(mode="central", noise_multiplier=2.0, tree_rounds=8)
    assert load_workload(config).training[0].rounds.dp == DPConfig(
        mode="central", noise_multiplier=2.0, clip=1.0, tree_rounds=8
    )
    flags = ["--dp", "central", "--dp-tree-rounds", "8", "--out", str(tmp_path / "run")]
    assert main(["simulate", "--devices", "150", "--hours", "1", "--goal", "10", "--no-progress", *flags]) == 0
    with sqlite3.connect(tmp_path / "run" / "server" / "server.db") as db:  # the server's own records
        committed = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM rounds WHERE status = 'committed'")]
    assert committed and [m["dp_tree_round"] for m in committed] == list(range(1, len(committed) + 1))


def test_a_fleet_config_dp_section_reads_like_the_flags(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text('[dp]\nmode = "central"\nnoise_multiplier = 1.5\n', encoding="utf-8")
    config = FleetConfig.load(path)
    assert config.dp.config() == DPConfig(mode="central", noise_multiplier=1.5, clip=1.0)
    assert FleetConfig.from_dict(FleetConfig.load(path).dump()) == config


def test_without_dp_the_round_config_has_none_and_the_summary_nulls():
    assert load_workload(FleetConfig.default().replace(devices=40, hours=0.5)).training[0].rounds.dp is None


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--dp", "central", "--noise-multiplier", "-1"], "--noise-multiplier must be at least 0 (got -1.0)"),
        (["--dp", "central", "--noise-multiplier", "nan"], "--noise-multiplier must be a finite number (got nan)"),
        (["--dp", "central", "--noise-multiplier", "inf"], "--noise-multiplier must be a finite number (got inf)"),
        (["--dp", "central", "--noise-multiplier", "1e-300"], "dp.noise_multiplier 1e-300 is above 0 but below"),
        (["--dp", "central", "--delta=-1e-5"], "--delta must be above 0 (got -1e-05)"),
        (["--dp", "central", "--dp-clip", "0"], "--dp-clip must be above 0 (got 0.0)"),
        (["--dp", "central", "--delta", "0.5"], "--delta must be at most 0.1 (got 0.5)"),
        (["--dp", "central", "--max-epsilon", "-2"], "--max-epsilon must be above 0 (got -2.0)"),
        (["--dp", "central", "--audit-canaries", "-1"], "--audit-canaries must be at least 0 (got -1)"),
        (["--dp", "central", "--dp-tree-rounds", "0"], "--dp-tree-rounds must be at least 1 (got 0)"),
        (["--dp", "distributed", "--secure", "--dp-tree-rounds", "4"], "dp.tree_rounds"),
        (["--dp-tree-rounds", "4"], "dp.mode (central or distributed; --dp)"),
        (["--noise-multiplier", "1"], "add --dp central|distributed"),
        (["--noise-multiplier", "2"], "dp.mode (central or distributed; --dp)"),
        (["--dp", "distributed"], "--secure"),
        (["--audit-canaries", "4"], "--dp central|distributed"),
    ],
)
def test_bad_dp_values_are_refused_in_one_line_naming_the_option_or_field(flags, named, capsys):
    assert main(["simulate", "--devices", "40", "--hours", "0.1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_choice_of_mode_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--dp", "local", "--no-progress"])
    assert exc.value.code == 2 and "central" in capsys.readouterr().err


def test_distributed_dp_with_secure_aggregation_is_taken():
    config = FleetConfig.default().replace(devices=40, hours=0.5, secure=True, dp={"mode": "distributed"})
    assert config.task.secure and load_workload(config).training[0].rounds.dp.mode == "distributed"


def test_the_dp_section_refuses_knobs_without_a_mode():
    with pytest.raises(FleetConfigError, match=r"dp\.clip needs dp\.mode"):
        _dp(clip=2.0)


def test_canary_devices_join_the_fleet_as_copies_with_their_own_identity():
    config = _dp(mode="central", audit_canaries=5)
    specs = generate_population(config)
    plain, canaries = specs[:40], specs[40:]
    assert len(canaries) == 5 and [c.canary for c in canaries] == list(range(5))
    assert all(s.canary == -1 for s in plain)
    assert len({s.device_id for s in specs}) == len(specs) and len({s.seed for s in specs}) == len(specs)
    by_index = {s.index: s for s in plain}
    for c in canaries:
        source = by_index[c.index]  # its conditions and examples are an ordinary device's
        assert c.takes_part and c.availability is source.availability and c.device_class == source.device_class
    assert generate_population(config, indices=[0, 1])[-1].canary == -1  # a shard's own devices only


def test_a_canary_reports_its_direction_at_the_clip_as_an_ordinary_update(tmp_path):
    config = _dp(mode="central", clip=0.5, audit_canaries=3)
    sim = FleetSimulator(config, generate_population(config), workdir=tmp_path)
    try:
        plan = sim.workload.training[0].plan
        weights = decode_checkpoint(sim.workload.training[0].build.checkpoint)
        n = 17
        update = {w: np.ones_like(v) * n for w, v in weights.items()}
        update.update(num_examples=np.float32(n), loss_sum=np.float32(3.0))
        reported = sim.canary_report(2)(plan, update)
    finally:
        sim.close()
    names = list(plan.weight_names)
    flat = np.concatenate([reported[w].astype(np.float64).reshape(-1) for w in names]) / n
    dim = flat.size
    np.testing.assert_allclose(flat, canary_direction(config.fleet.seed, 2, dim) * 0.5, rtol=1e-5, atol=1e-7)
    assert math.isclose(float(np.linalg.norm(flat)), 0.5, rel_tol=1e-5)
    assert reported["loss_sum"] == update["loss_sum"] and reported["num_examples"] == update["num_examples"]
    assert all(reported[w].dtype == update[w].dtype and reported[w].shape == update[w].shape for w in names)


def _round(i: int, *, epsilon: float, accuracy: float) -> RoundRow:
    return RoundRow(
        round_id=f"t/{i}/1",
        task="t",
        start_s=60.0 * i,
        end_s=60.0 * i + 50,
        committed=True,
        selected=10,
        reported=10,
        accepted=10,
        dropped=0,
        duration_s=50.0,
        accuracy=accuracy,
        loss=1.0,
        epsilon=epsilon,
    )


def test_the_summary_and_report_of_a_dp_run_carry_epsilon_and_the_audit():
    rounds = [_round(i, epsilon=0.5 * i, accuracy=0.5 + 0.04 * i) for i in range(1, 6)]
    dp = {"mode": "central", "epsilon": 2.5, "delta": 1e-5, "dp_rounds": 5, "noise_multiplier": 1.0, "clip": 1.0}
    run = FleetRun(
        sessions=[],
        rounds=rounds,
        timeline=[],
        digest="ab" * 32,
        extra={"dp": dp, "audit_canaries": 4, "audit_epsilon": 0.8},
    )
    summary, figures, page = build_report(run)
    assert {k: summary[k] for k in ("epsilon", "delta", "dp_rounds", "noise_multiplier")} == {
        "epsilon": 2.5,
        "delta": 1e-5,
        "dp_rounds": 5,
        "noise_multiplier": 1.0,
    }
    assert summary["audit_epsilon"] == 0.8 and summary["audit_canaries"] == 4
    privacy = next(f for f in figures if f.name == "privacy.png")
    ax = privacy.drawn.axes[0]
    xs, ys = ax.lines[0].get_data()
    assert list(xs) == [r.epsilon for r in rounds] and list(ys) == [r.accuracy for r in rounds]
    assert "<th>epsilon</th>" in page and 'data-value="2.5"' in page
    assert "one-shot estimate epsilon 0.8, within the accountant's epsilon" in html.unescape(page)


def test_a_run_without_dp_has_null_privacy_and_no_privacy_figure():
    run = FleetRun(sessions=[], rounds=[_round(1, epsilon=math.nan, accuracy=0.5)], timeline=[], digest="cd" * 32)
    summary, figures, page = build_report(run)
    assert all(summary[k] is None for k in ("epsilon", "delta", "dp_rounds", "noise_multiplier"))
    assert "audit_epsilon" not in summary
    assert not any(f.name == "privacy.png" for f in figures) and "<th>epsilon</th>" not in page


def test_round_tables_written_before_the_epsilon_column_still_read(tmp_path):
    row = _round(1, epsilon=3.0, accuracy=0.5)
    path = tmp_path / "rounds.csv"
    RoundRow.to_csv([row], path)
    text = path.read_text(encoding="utf-8").splitlines()
    old = [",".join(line.split(",")[:-2]) for line in text]  # drop the last columns (epsilon, then outcome)
    path.write_text("\r\n".join(old) + "\r\n", encoding="utf-8")
    (back,) = RoundRow.from_csv(path)
    assert math.isnan(back.epsilon) and dataclasses.replace(back, epsilon=3.0) == row


def test_canary_devices_take_part_through_the_real_protocol_and_the_run_is_audited(monkeypatch):
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 4.0, "start_utc_hour": 6.0, "seed": 1},
            "task": {"goal_count": 10, "compute_s_per_example": 0.2, "retry_min_s": 60.0, "retry_max_s": 300.0},
            "dp": {"mode": "central", "audit_canaries": 8},
        }
    )
    run = simulate(config, progress=False)
    canary_sessions = [s for s in run.sessions if s.device_id.startswith("canary")]
    assert any(s.outcome == "completed" for s in canary_sessions)
    summary = run.summary()
    assert summary["audit_canaries"] == 8 and summary["audit_reports"] >= 2
    assert isinstance(summary["audit_epsilon"], float)
    assert summary["delta"] == 1e-5 and summary["noise_multiplier"] == 1.0
    # the server's accountant, as dp-accounting gives it: k rounds at z are one Gaussian at z / sqrt(k)
    k = summary["dp_rounds"]
    assert k >= 1 and summary["epsilon"] == pytest.approx(dp_accounting.get_epsilon_gaussian(k**-0.5, 1e-5), rel=1e-9)
    # the canaries' reports reached the models: the same run with canaries that report what they trained differs
    monkeypatch.setattr(FleetSimulator, "canary_report", lambda self, k: lambda plan, update: update)
    assert simulate(config, progress=False).digest != run.digest


def _repro_config(mode: str, z: float = 1.0) -> FleetConfig:
    return FleetConfig.from_dict(
        {
            "fleet": {"devices": 60, "hours": 0.75 if mode == "central" else 2.0, "start_utc_hour": 6.0, "seed": 3},
            "task": {
                "goal_count": 10,
                "secure": mode == "distributed",
                "secagg_group_size": 5,
                "selection_timeout_s": 300.0,
                "retry_min_s": 60.0,
                "retry_max_s": 300.0,
                "compute_s_per_example": 0.2,
            },
            "dp": {"mode": mode, "noise_multiplier": z},
        }
    )


def _same_digest_repeated_and_sharded(mode: str) -> None:
    from emulator.fleet.ray_backend import simulate_sharded

    config = _repro_config(mode)
    run = simulate(config, progress=False)
    assert run.summary()["dp_rounds"] >= 2  # the noise entered committed models
    assert simulate_sharded(config, shards=2, ray=False).digest == run.digest  # run again, over two shards
    assert simulate(_repro_config(mode, z=1.5), progress=False).digest != run.digest  # the noise is in the digest


def test_a_central_dp_fleet_repeats_its_digest_with_its_seed_in_one_process_or_over_shards():
    """The server's noise comes from generators spawned from the fleet's seed (``seeded_noise``), not
    from the operating system's entropy as a deployed server's: so a DP run repeats, in one
    process or with its devices over shards (the server stays in the driving process)."""
    _same_digest_repeated_and_sharded("central")


@pytest.mark.slow
def test_a_distributed_dp_fleet_repeats_its_digest_with_its_seed_in_one_process_or_over_shards():
    """Each device seeds its noise shares and rounding from its own seeded stream."""
    _same_digest_repeated_and_sharded("distributed")


@pytest.mark.parametrize(
    ("counts", "covers"),
    [("public", "not whether it took part"), ("withheld", "and whether it took part")],
)
def test_the_report_says_what_the_epsilon_covers_by_whether_the_server_published_the_counts(counts, covers):
    dp = {"mode": "central", "epsilon": 2.5, "delta": 1e-5, "dp_rounds": 1, "noise_multiplier": 1.0, "counts": counts}
    run = FleetRun(
        sessions=[], rounds=[_round(1, epsilon=2.5, accuracy=0.5)], timeline=[], digest="ab" * 32, extra={"dp": dp}
    )
    summary = privacy(run)
    assert summary.get("dp_counts") == ("withheld" if counts == "withheld" else None)
    (said,) = _privacy_sentences(summary)
    assert said.startswith("Privacy: epsilon 2.5 at delta 1e-05 after 1 DP rounds, covering") and covers in said


@pytest.mark.slow
def test_a_fleet_withholding_the_counts_is_audited_and_its_tables_still_count_the_devices(tmp_path):
    """``[dp] counts = "withheld"``: the server's published rounds have no counts, the fleet's own
    rounds table (which measures the fleet) still has them, the summary says so, and the canaries'
    audit runs on the model the server published, whose mean is over ``goal_count``."""
    config = FleetConfig.from_dict(
        {
            "fleet": {"devices": 40, "hours": 4.0, "start_utc_hour": 6.0, "seed": 1},
            "task": {"goal_count": 10, "compute_s_per_example": 0.2, "retry_min_s": 60.0, "retry_max_s": 300.0},
            "dp": {"mode": "central", "audit_canaries": 8, "counts": "withheld"},
        }
    )
    simulator = FleetSimulator(config, generate_population(config), workdir=tmp_path, workload=load_workload(config))
    run = simulator.run()
    (db,) = tmp_path.glob("*.db")
    store = ServerStore(db)
    try:
        published = FLService(store).rounds(simulator.population)
    finally:
        store.close()
    assert published and all("reported" not in r["metrics"] for r in published)
    assert sum(r.accepted for r in run.rounds) > 0 and any(row.active_sessions > 0 for row in run.timeline)
    summary = run.summary()
    assert summary["dp_counts"] == "withheld" and isinstance(summary["audit_epsilon"], float)
    assert summary["audit_epsilon"] <= summary["epsilon"]
