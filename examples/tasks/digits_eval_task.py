"""A training task and an evaluation task that measures its model as the rounds go: devices train
on ``app:/digits`` and, in alternate rounds, evaluate the model just committed on their held-out
``app:/digits_heldout`` examples. Both are built, release-tested on every claimed release and
deployed together (the server requires the evaluation to claim the training task's releases).

    fedfleet plan test examples/tasks/digits_eval_task.py -o build/digits_eval --signing-key tester.key
    fedfleet deploy build/digits_eval --server http://127.0.0.1:8000 --population digits_eval --admin-key-file admin.key

The pair goes to a population of its own: one where ``digits_task.py`` was deployed alone already
has ``digits_mlp``, and refuses a deploy that holds it again beside a new task (TASK_EXISTS).

The evaluation's predicate reads what each release computed, through the evaluation plan, for the
models of the training task's simulated rounds.
"""

import runpy
from pathlib import Path

from emulator.toolchain.tasks import accuracy_after_rounds, evaluation_of
from example_store import ExampleSelector

task = runpy.run_path(str(Path(__file__).with_name("digits_task.py")))["task"]

evaluation = evaluation_of(
    task,
    selector=ExampleSelector("app:/digits_heldout"),
    batch_size=32,
    predicates=(accuracy_after_rounds(rounds=4, at_least=0.8),),
)

tasks = [task, evaluation]
