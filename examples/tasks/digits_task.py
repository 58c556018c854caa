"""A task file: an MLP on the 8x8 digits, claimed for the oldest, a middle and the newest
onnxruntime release, with predicates checked on proxy data before anything is deployed.

    fedfleet plan build examples/tasks/digits_task.py -o build/digits
    fedfleet plan keygen --key tester.key          # once; the server's --release-trust file holds tester.key.pub
    fedfleet plan test build/digits --signing-key tester.key
    fedfleet deploy build/digits --server http://127.0.0.1:8000 --population digits --admin-key-file admin.key

The plan is written at opset 21, so the 1.15 and 1.17 plans are derived at opsets 18 and 20
(1.15 loads opset 19 but lacks opset-19 kernels of ops this plan uses).
Set ``FEDFLEET_TASK_RUNTIMES`` (comma-separated releases) to claim others, e.g. all 1.15-1.32.
"""

import os

from device_runtime import build_mlp_plan
from emulator.datasets import load_digits_dataset
from emulator.toolchain.tasks import Budget, ProxyData, Task, Tolerance, accuracy_after_rounds, loss_decreases
from example_store import ExampleSelector
from server_stub import RoundConfig

SELECTOR = ExampleSelector("app:/digits")
BATCH_SIZE = 16
EPOCHS = 2


def mlp(hp):
    return build_mlp_plan(
        64, (32,), 10, learning_rate=hp["lr"], batch_size=BATCH_SIZE, epochs=EPOCHS, selector=SELECTOR, opset=21
    )


def proxy():
    digits = load_digits_dataset(seed=0)
    return ProxyData.split({"x": digits.x_train[:600], "y": digits.y_train[:600]}, devices=4, seed=0)


runtimes = os.environ.get("FEDFLEET_TASK_RUNTIMES")

task = Task(
    name="digits_mlp",
    model=mlp,
    proxy=proxy,
    hyperparameters={"lr": 0.2},
    selector=SELECTOR,
    batch_size=BATCH_SIZE,
    epochs=EPOCHS,
    predicates=(loss_decreases(epochs=3), accuracy_after_rounds(rounds=4, at_least=0.8)),
    rounds=RoundConfig(goal_count=10, max_rounds=20),
    budget=Budget(memory_mb=256, step_ms=20, session_s=10),
    tolerance=Tolerance(rtol=1e-4, atol=1e-5),
    **({"runtimes": tuple(r.strip() for r in runtimes.split(",") if r.strip())} if runtimes else {}),
)
