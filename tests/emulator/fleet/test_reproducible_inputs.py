"""A run depends on what its task file and dataset hold, not on when they were read: the fleet keeps
the tasks it built and the data it read for the next run of the same config in the process (a
sharded run's driver and shards build them once), and a file changed in place since is read again,
whatever modification time it was given."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from device_runtime.checkpoint import decode_checkpoint
from emulator.fleet import FleetConfig, simulate
from emulator.fleet.workload import load_workload

ROOT = Path(__file__).resolve().parents[3]
TASK = (ROOT / "examples" / "tasks" / "digits_task.py").read_text()


def _rewrite_keeping_its_times(path: Path, text: str) -> None:
    """``text`` over ``path`` with the file's old access and modification times (``cp -p``, ``rsync -t``)."""
    before = path.stat()
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _shapes(workload) -> list[tuple[int, ...]]:
    return [np.shape(w) for w in decode_checkpoint(workload.training[0].build.checkpoint).values()]


def test_a_task_file_changed_in_place_is_built_again_by_the_next_run_of_its_config(tmp_path):
    task = tmp_path / "task.py"
    task.write_text(TASK)
    config = FleetConfig.from_dict({"fleet": {"devices": 20, "hours": 1.0}, "task": {"file": str(task)}})
    first = load_workload(config)
    assert load_workload(config) is first  # unchanged: built once
    _rewrite_keeping_its_times(task, TASK.replace("(32,)", "(33,)"))  # the model one unit wider
    wider = load_workload(config)
    assert (64, 33) in _shapes(wider) and (64, 32) in _shapes(first)


def _leaf(folder: Path, labels: list[int]) -> None:
    users = {f"w{i}": {"x": [[float(i)] * 64] * 4, "y": [label] * 4} for i, label in enumerate(labels)}
    body = {"users": list(users), "num_samples": [4] * len(users), "user_data": users}
    (folder / "writers.json").write_text(json.dumps(body))


def test_a_dataset_changed_in_place_is_read_again_by_the_next_run_of_its_config(tmp_path):
    data = tmp_path / "leaf"
    data.mkdir()
    _leaf(data, [0, 1, 2, 3, 4, 5])
    config = FleetConfig.from_dict(
        {"fleet": {"devices": 12, "hours": 1.0}, "data": {"format": "leaf", "path": str(data)}}
    )
    first = load_workload(config)
    assert load_workload(config) is first
    before = (data / "writers.json").stat()
    _leaf(data, [0, 1, 2, 3, 4, 9])  # one writer's labels corrected
    os.utime(data / "writers.json", ns=(before.st_atime_ns, before.st_mtime_ns))
    again = load_workload(config)
    assert again is not first
    assert 9 in again.data.labels() and 9 not in first.data.labels()


def test_a_run_in_which_no_round_finished_has_the_digest_of_nothing_whatever_it_ran():
    """The digest covers the finished rounds and the committed models, not the run's inputs (the
    fleet user's guide says so): a run too short for a round has SHA-256 of no bytes, whatever
    its seed, task or model; its summary's other keys say what ran."""
    short = {"fleet": {"devices": 20, "hours": 0.05}}
    one = simulate(FleetConfig.from_dict({**short, "fleet": {**short["fleet"], "seed": 1}}), progress=False)
    wider = simulate(FleetConfig.from_dict({**short, "task": {"hidden": [48]}}), progress=False)
    assert {r.outcome for r in [*one.rounds, *wider.rounds]} <= {"unfinished"}
    assert one.digest == wider.digest == hashlib.sha256().hexdigest()
