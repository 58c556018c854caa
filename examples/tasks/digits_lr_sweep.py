"""A task group: the digits task over a grid of learning rates, one variant per value. The
variants are built, tested and deployed together (they share the population's rounds).

    fedfleet plan test examples/tasks/digits_lr_sweep.py -o build/sweep
"""

import runpy
from pathlib import Path

from emulator.toolchain.tasks import TaskGroup

digits_task = runpy.run_path(str(Path(__file__).with_name("digits_task.py")))["task"]

tasks = TaskGroup(digits_task, {"lr": [0.1, 0.2, 0.3]})
