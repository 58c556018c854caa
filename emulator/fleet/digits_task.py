"""The fleet's built-in task: a task file like any other, which ``fedfleet simulate`` runs when the
fleet config names none (``[task] file``) and ``fedfleet simulate --task`` can name as well.

An MLP with ReLU hidden layers and a softmax output over the examples' ``x`` and ``y``, read from
``app:/examples``. The fleet sets its hyperparameters from its ``[task]`` (``hidden``,
``learning_rate`` as ``lr``, ``batch_size``, ``epochs``, ``secure``) and its data (``features``: the
size of one example's ``x``, ``classes``: the largest label plus one, at least 2 and at most
``workload.MAX_BUILT_IN_CLASSES``), and its seed from ``[fleet] seed``; the defaults below are the
paper-calibrated fleet's on the 8x8 digits.

    fedfleet plan build emulator/fleet/digits_task.py -o build/fleet_mlp
"""

from device_runtime import build_mlp_plan
from emulator.datasets import load_digits_dataset
from emulator.toolchain.tasks import ProxyData, Task, loss_is_finite
from example_store import ExampleSelector

SELECTOR = ExampleSelector("app:/examples")


def mlp(hp):
    return build_mlp_plan(
        int(hp["features"]),
        tuple(int(h) for h in hp["hidden"]),
        int(hp["classes"]),
        learning_rate=float(hp["lr"]),
        batch_size=int(hp["batch_size"]),
        epochs=int(hp["epochs"]),
        selector=SELECTOR,
        inputs={"x": str(hp.get("x", "x")), "y": str(hp.get("y", "y"))},
        shuffle_seed=int(hp["shuffle_seed"]),
        secure_aggregation=bool(hp["secure"]),
    )


def proxy():
    digits = load_digits_dataset(test_fraction=0.2, seed=0)
    return ProxyData.split({"x": digits.x_test, "y": digits.y_test}, devices=2, seed=0)


task = Task(
    name="fleet_mlp",
    model=mlp,
    proxy=proxy,
    hyperparameters={
        "features": 64,
        "classes": 10,
        "hidden": (32,),
        "lr": 0.3,
        "batch_size": 8,
        "epochs": 2,
        "shuffle_seed": 0,
        "secure": False,
    },
    selector=SELECTOR,
    batch_size=8,
    epochs=2,
    predicates=(loss_is_finite(epochs=1),),
)
