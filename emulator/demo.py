"""The main job: a fleet of emulated devices trains a digit classifier with the FL server
over real HTTP, some devices dropping out or reporting late, and the held-out accuracy is shown
after every round."""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from device_runtime import PlanExecutor, build_eval_plan, build_mlp_plan, encode_checkpoint, initial_weights
from example_store import ExampleSelector
from server_stub import AttestationVerifier, NonceRegistry, RateLimiter, RoundConfig, ServerThread

from .datasets import load_digits_dataset, partition_by_shards
from .devices.attestation_authority import AttestationAuthority
from .devices.device import DeviceProfile, EmulatedDevice, RealTimeFleet

POPULATION = "digits"
COLLECTION = "app:/digits"


class DemoConfigError(ValueError):
    """A demo setting out of its range; the message names it and what to use instead. ``field``:
    the DemoConfig field it refuses (None for a refusal of several), and ``says`` what the message
    says of it, so that a command line can name the field by its own option (``--devices``)."""

    def __init__(self, message: str, *, field: str | None = None, says: str = "") -> None:
        super().__init__(message)
        self.field, self.says = field, says


@dataclass(frozen=True)
class DemoConfig:
    devices: int = 100
    rounds: int = 60
    goal_count: int = 20
    over_selection: float = 1.3
    min_fraction: float = 0.8
    hidden: tuple[int, ...] = (64,)
    learning_rate: float = 0.3
    batch_size: int = 8
    epochs: int = 3
    dropout_prob: float = 0.1
    late_prob: float = 0.1
    report_timeout_s: float = 2.0
    selection_timeout_s: float = 10.0
    seed: int = 0
    time_limit_s: float = 600.0
    workdir: str | None = None
    secure: bool = False  # report through Secure Aggregation: the server sees only group sums
    secagg_group_size: int = 5
    secagg_round_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, says: str) -> None:
            if not ok:
                raise DemoConfigError(f"{field} {says}", field=field, says=says)

        need(self.devices >= 1, "devices", f"must be at least 1 (got {self.devices})")
        need(self.rounds >= 1, "rounds", f"must be at least 1 (got {self.rounds})")
        need(
            1 <= self.goal_count <= self.devices,
            "goal_count",
            f"must be between 1 and the number of devices ({self.devices}): a round needs that many reports "
            f"(got {self.goal_count})",
        )
        for name in ("dropout_prob", "late_prob"):
            value = getattr(self, name)
            need(0.0 <= value <= 1.0, name, f"is a chance between 0 and 1 (got {value})")
        need(self.epochs >= 1, "epochs", f"must be at least 1 (got {self.epochs})")
        need(self.time_limit_s > 0, "time_limit_s", f"must be positive seconds (got {self.time_limit_s})")
        need(
            self.secagg_group_size >= 2,
            "secagg_group_size",
            f"must be at least 2: a Secure Aggregation group needs at least 2 devices (got {self.secagg_group_size})",
        )


def _evaluate(executor: PlanExecutor, weights: dict, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    batches = [{"x": x[i : i + 256], "y": y[i : i + 256]} for i in range(0, len(y), 256)]
    return executor.evaluate(weights, batches)


def _row(cells: list[object], widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def run_demo(config: DemoConfig = DemoConfig(), out: TextIO | None = None) -> dict:
    """Run the whole demo; returns (and prints as the last line) a JSON-able summary."""
    out = out or sys.stdout
    started = time.monotonic()
    rng = random.Random(config.seed)
    data = load_digits_dataset(seed=config.seed)
    most = len(data.y_train) // 2  # two shards of the sorted digits each
    if config.devices > most:
        raise DemoConfigError(
            f"the digits give at most {most} devices two classes' worth of examples each, not {config.devices}; "
            f"for a larger fleet simulate one in virtual time: fedfleet simulate --devices {config.devices}"
        )
    parts = partition_by_shards(data.y_train, config.devices, seed=config.seed)
    selector = ExampleSelector(COLLECTION)
    plan = build_mlp_plan(
        data.num_features,
        config.hidden,
        data.num_classes,
        learning_rate=config.learning_rate,
        batch_size=config.batch_size,
        epochs=config.epochs,
        selector=selector,
        inputs={"x": "x", "y": "y"},
        shuffle_seed=config.seed,
        name="digits_mlp",
        secure_aggregation=config.secure,
    )
    evaluator = PlanExecutor(build_eval_plan(plan))
    weights0 = initial_weights(plan, seed=config.seed)
    round_config = RoundConfig(
        goal_count=config.goal_count,
        over_selection=config.over_selection,
        min_fraction=config.min_fraction,
        selection_timeout_s=config.selection_timeout_s,
        report_timeout_s=config.report_timeout_s,
        retry_window_s=(0.2, 1.0),
        max_rounds=config.rounds,
        secagg_min_group_size=config.secagg_group_size,
        secagg_round_timeout_s=config.secagg_round_timeout_s,
    )
    with tempfile.TemporaryDirectory(prefix="fl-demo-", dir=config.workdir) as tmp:
        root = Path(tmp)
        authority = AttestationAuthority.generate()
        anchor = authority.trust_anchor()
        # Demo devices come back every second or so; the limit still stops a device that floods.
        verifier = AttestationVerifier(anchor, NonceRegistry(ttl_s=60), RateLimiter(burst=20, rate_per_s=5))
        server = ServerThread(root / "server.db", verifier=verifier).start()
        admin = server.admin()
        fleet: RealTimeFleet | None = None
        try:
            print(
                f"FL server on {server.url} (SQLite at {root / 'server.db'}); only attested devices are admitted",
                file=out,
            )
            if config.secure:
                print(
                    f"Secure Aggregation: attested groups of at least {config.secagg_group_size} devices; "
                    "the server sees only each group's sum",
                    file=out,
                )
            admin.create_population(POPULATION)
            admin.deploy_task(POPULATION, "digits-train", plan, encode_checkpoint(weights0), round_config)
            profile = DeviceProfile(
                dropout_prob=config.dropout_prob,
                late_prob=config.late_prob,
                late_delay_s=config.report_timeout_s + 0.5,
                cooldown_s=(0.2, 1.5),
            )
            devices = []
            for i in range(config.devices):
                device = EmulatedDevice(
                    f"device-{i:04d}",
                    root / "devices" / f"{i:04d}",
                    server.url,
                    POPULATION,
                    profile=profile,
                    collection_uri=COLLECTION,
                    seed=rng.randrange(2**31),
                    attestor=authority.new_device_attestor("emulated-phone", time.time()),
                    trust_anchor=anchor,  # Secure Aggregation peers must be this authority's devices
                )
                device.add_examples(data.x_train[parts[i]], data.y_train[parts[i]])
                devices.append(device)
            print(
                f"{config.devices} devices with {len(data.y_train)} training examples (non-IID, about 2 classes each); "
                f"{len(data.y_test)} held-out test examples; goal {config.goal_count} devices per round, "
                f"{config.rounds} rounds",
                file=out,
            )
            initial = _evaluate(evaluator, weights0, data.x_test, data.y_test)
            print(f"initial test accuracy {initial['eval_accuracy']:.3f}", file=out)
            widths = [5, 8, 8, 9, 7, 10, 8, 10]
            print(
                _row(["round", "status", "selected", "reported", "late", "dropped", "loss", "test_acc"], widths),
                file=out,
            )
            out.flush()
            fleet = RealTimeFleet(devices)
            fleet.start()
            shown = 0
            committed = 0
            accuracy = initial["eval_accuracy"]
            history: list[dict] = []
            # A row is printed once late reports for its round can no longer arrive.
            settle_s = config.report_timeout_s + 1.0
            while time.monotonic() - started < config.time_limit_s:
                time.sleep(0.2)
                rounds = admin.rounds(POPULATION)
                server_done = fleet_done(rounds, config.rounds)
                for record in rounds[shown:]:
                    if time.time() < record["ended_at"] + settle_s:
                        break
                    shown += 1
                    m = record["metrics"]
                    acc = ""
                    if record["status"] == "committed":
                        committed += 1
                        weights = admin.checkpoint(record["checkpoint_id"])
                        accuracy = _evaluate(evaluator, weights, data.x_test, data.y_test)["eval_accuracy"]
                        acc = f"{accuracy:.3f}"
                    loss = f"{m['train_loss']:.4f}" if "train_loss" in m else ""
                    cells = [
                        record["round"],
                        record["status"],
                        m["selected"],
                        m["reported"],
                        m["rejected_late"],
                        m["dropped"],
                        loss,
                        acc,
                    ]
                    print(_row(cells, widths), file=out)
                    out.flush()
                    history.append(
                        {**m, "round": record["round"], "status": record["status"], "test_accuracy": acc or None}
                    )
                if server_done and shown == len(rounds):
                    break
        finally:
            if fleet is not None:
                fleet.stop()
            admin.close()
            server.stop()
            if fleet is not None:  # its devices are closed: their folders go now, many at once
                fleet.remove_folders()
        summary = {
            "rounds_committed": committed,
            "rounds_abandoned": sum(1 for r in history if r["status"] == "abandoned"),
            "final_test_accuracy": round(float(accuracy), 4),
            "initial_test_accuracy": round(float(initial["eval_accuracy"]), 4),
            "devices": config.devices,
            "reports_rejected_late": sum(int(r["rejected_late"]) for r in history),
            "session_outcomes": dict(sorted(fleet.outcomes().items())) if fleet else {},
            "session_shapes": dict(fleet.shapes().most_common()) if fleet else {},
            "elapsed_s": round(time.monotonic() - started, 1),
            "config": asdict(config),
        }
        print(json.dumps(summary), file=out)
        return summary


def fleet_done(rounds: list[dict], target: int) -> bool:
    return sum(1 for r in rounds if r["status"] == "committed") >= target
