"""``fedfleet model``: a task's trained model out of a server or a simulated run, to evaluate and ship.

fedfleet model --server URL --population P --task T [--round N] -o FILE.ckpt
fedfleet model --run RUN [--population P] [--task T] [--round N] -o FILE.ckpt
                                            the model of the task's last committed round (or of round
                                            N) as a checkpoint file: what a task file's
                                            initial_weights, ``plan test`` and ``PlanExecutor`` take
... --onnx BUNDLE -o FILE.onnx              the bundle's ONNX inference model (plan from-onnx|from-torch)
                                            with those weights in place of its initializers

A server is asked over its operator endpoints; a run folder (``fedfleet simulate --out RUN``) keeps
its server's database, with every committed round's model, in ``RUN/server/server.db``, read here
as it is. Both answer the same questions (:class:`Models`): which tasks there are, a task's last
committed round and a given round's model; the command around them is one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from device_runtime.checkpoint import decode_checkpoint
from device_runtime.plan import PlanError
from device_runtime.protocol import ClientTLS, redacted_url
from server_stub.admin_client import AdminClient
from server_stub.errors import did_you_mean
from server_stub.persistence import DamagedStore, ServerStore, StoreLayoutError
from server_stub.schemas import MAX_ROUND_ID, MAX_ROUNDS_PAGE, NAME_RULE, is_name

from ..toolchain.model_bundle import MODEL_FILE
from ..toolchain.tasks import TaskError
from ..toolchain.trained_model import DATA_SUFFIX, write_trained_onnx

__all__ = ["RUN_DATABASE", "add_model_parser", "model_command"]

#: Where a run folder keeps its server's database (``simulate(out_dir=...)``'s ``workdir``).
RUN_DATABASE = Path("server") / "server.db"


class ModelError(TaskError):
    """A model that cannot be given as asked: one line saying why and what to ask instead."""


@dataclass(frozen=True)
class Committed:
    """One committed round's model."""

    task: str
    round: int
    data: bytes


class Models(Protocol):
    """Where committed models are read from: a server or a run's database."""

    where: str

    def last(self, task: str) -> Committed: ...

    def of_round(self, task: str, number: int) -> Committed: ...


#: A round record's key the server gives an evaluation's committed rounds, which commit no model.
EVALUATED = "evaluated_checkpoint_id"


def _round_said(task: str, number: int, found: list[tuple[int, str, bool, bool]], where: str) -> None:
    """``found``: the task's records of round ``number`` (attempt, status, whether its model is
    kept, whether it evaluated another task's). Raises the one line for a round with no model to
    give; returns when it committed one."""
    committed = [f for f in found if f[1] == "committed"]
    if committed and committed[-1][2]:
        return
    if committed and committed[-1][3]:
        raise ModelError(
            f"task {task} is an evaluation: its rounds measure the model of the task it evaluates and commit none of "
            "their own; give that task's --task"
        )
    if committed:
        raise ModelError(
            f"round {number} of task {task} committed, but its model was dropped by fedfleet prune (the last "
            "committed round's is always kept: leave out --round)"
        )
    if found:
        raise ModelError(f"round {number} of task {task} was {found[-1][1]}: it committed no model")
    raise ModelError(f"task {task} has no round {number} on record at {where}")


class ServerModels:
    """A running server's models, over its operator endpoints."""

    def __init__(self, admin: AdminClient, population: str) -> None:
        self.admin, self.population = admin, population
        self.where = redacted_url(admin.url)

    def last(self, task: str) -> Committed:
        _, number, name = self.admin.model_bytes(self.population, task)
        if number == 0:
            raise ModelError(
                f"task {task} of population {self.population} has no committed round yet: its model is still the "
                "initial one (its bundle's initial.ckpt)"
            )
        return self.of_round(name, number)  # by its record: an evaluation's is its training task's model

    def of_round(self, task: str, number: int) -> Committed:
        before: int | None = None
        found: list[tuple[int, str, bool, bool]] = []
        checkpoint = None
        while True:  # newest page first: a late round is found without reading a long history
            page, before = self.admin.round_page(self.population, task, MAX_ROUNDS_PAGE, before)
            for r in page:
                if r["round"] == number and r["task"] == task:
                    found.append((r["attempt"], r["status"], bool(r["checkpoint_id"]), EVALUATED in r["metrics"]))
                    if r["status"] == "committed" and r["checkpoint_id"]:
                        checkpoint = r["checkpoint_id"]
            if found or before is None or any(r["round"] < number for r in page):
                break
        _round_said(task, number, sorted(found), self.where)
        assert checkpoint is not None
        data = self.admin.checkpoint_bytes(checkpoint)
        if hashlib.sha256(data).hexdigest() != checkpoint:  # a model's id is its bytes' SHA-256, as devices check
            raise ModelError(
                f"the model {self.where} sent for round {number} of task {task} is not the one its round committed "
                f"(its bytes do not hash to {checkpoint[:12]}); is --server a fedfleet server of this version?"
            )
        return Committed(task, number, data)


class RunModels:
    """A simulated run's models, from the database its server kept in the run folder."""

    def __init__(self, run: Path, population: str | None) -> None:
        database = run / RUN_DATABASE
        if not database.is_file():
            raise ModelError(
                f"{run} is no run folder (no {RUN_DATABASE}): give the folder `fedfleet simulate --out RUN` wrote"
            )
        if database.stat().st_size == 0:  # else opening it would write a new server's tables into the run
            raise ModelError(
                f"{database} is empty: no server ran on it; give the folder `fedfleet simulate --out RUN` wrote"
            )
        try:
            self.store = ServerStore(database)
        except (SQLAlchemyError, StoreLayoutError, ValueError) as exc:  # not SQLite, or of a newer layout
            raise ModelError(
                f"{database} does not read as a run's server database ({str(exc).splitlines()[0][:200]}); give the "
                "folder `fedfleet simulate --out RUN` wrote"
            ) from None
        names = self.store.population_names()
        if not names:
            self.store.close()
            raise ModelError(f"the run {run} has no population: its server recorded no deploy")
        if population is None and len(names) == 1:
            population = names[0]
        if population not in names:
            raise ModelError(
                f"the run {run} has no population {population!r}{did_you_mean(population or '', names)}; "
                f"it has {', '.join(names) or 'none'}"
                if population is not None
                else f"the run {run} has the populations {', '.join(names)}; give --population"
            )
        self.population, self.where = population, str(run)
        self.records = {t.name: t for t in self.store.tasks(population)}

    def close(self) -> None:
        self.store.close()

    def _task(self, task: str):
        record = self.records.get(task)
        if record is None:
            names = sorted(self.records)
            raise ModelError(
                f"the run {self.where} has no task {task!r}{did_you_mean(task, names)}; it has {', '.join(names)}"
            )
        return record

    def default_task(self) -> str:
        training = [name for name, t in self.records.items() if not t.config.get("group", {}).get("evaluates")]
        if len(training) != 1:
            raise ModelError(f"the run {self.where} has the tasks {', '.join(sorted(self.records))}; give --task")
        return training[0]

    def last(self, task: str) -> Committed:
        last = self.store.last_committed_round(self._task(task).id)
        if last is None:
            raise ModelError(f"task {task} committed no round in the run {self.where}: no model was trained")
        return self.of_round(task, last.number)

    def of_round(self, task: str, number: int) -> Committed:
        records = [r for r in self.store.rounds(self._task(task).id) if r.number == number]
        found = sorted((r.attempt, r.status, r.checkpoint_id is not None, EVALUATED in r.metrics) for r in records)
        _round_said(task, number, found, self.where)
        kept = next(r for r in reversed(records) if r.status == "committed" and r.checkpoint_id)
        assert kept.checkpoint_id is not None
        return Committed(task, number, self.store.resource(kept.checkpoint_id))


def _round_number(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_ROUND_ID:
        raise argparse.ArgumentTypeError(f"give a round number from 1, not {text!r}")
    return int(text)


def add_client_tls_options(cmd: argparse.ArgumentParser) -> None:
    """The operator's certificate, for a server that admits only clients with one (mutual TLS)."""
    cmd.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="the operator's client certificate (PEM; its key too unless --tls-key), for a server started with "
        "--tls-client-ca (the server's own authority is read from $SSL_CERT_FILE)",
    )
    cmd.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM, unencrypted)")


def client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """``--tls-cert`` and ``--tls-key`` as the operators' client takes them; None without them."""
    if args.tls_key and not args.tls_cert:
        raise ModelError("--tls-key is the key of --tls-cert: give the operator's certificate with --tls-cert FILE too")
    return ClientTLS(args.tls_cert, args.tls_key) if args.tls_cert else None


def add_model_parser(sub: argparse._SubParsersAction, admin_key_help: str) -> None:
    """Register ``model`` on the ``fedfleet`` command's subparsers."""
    cmd = sub.add_parser(
        "model",
        help="a task's trained model, from a server or a simulated run, as a checkpoint file or (--onnx) the "
        "bundle's ONNX model with the trained weights",
    )
    source = cmd.add_mutually_exclusive_group(required=True)
    source.add_argument("--server", help="the server's URL, e.g. http://127.0.0.1:8000")
    source.add_argument("--run", type=Path, help="a run folder fedfleet simulate --out wrote")
    cmd.add_argument("--population", help="the task's population (with --run: the run's only one by default)")
    cmd.add_argument("--task", help="the task (with --run: the run's only training task by default)")
    cmd.add_argument(
        "--round",
        type=_round_number,
        metavar="N",
        help="the model round N committed (default: the last committed round's; fedfleet rounds lists them)",
    )
    cmd.add_argument("--admin-key-file", help=admin_key_help)
    add_client_tls_options(cmd)
    cmd.add_argument(
        "--onnx",
        type=Path,
        metavar="BUNDLE",
        help="write the ONNX inference model of this bundle (plan from-onnx or from-torch wrote it) with the "
        "trained weights, for onnxruntime.InferenceSession",
    )
    cmd.add_argument(
        "-o", "--out", type=Path, required=True, help="the file to write: a checkpoint, or with --onnx an ONNX model"
    )
    cmd.add_argument("--force", action="store_true", help="replace an existing file")


def model_command(
    args: argparse.Namespace,
    say: Callable[[str], None],
    admin_key: Callable[[], str],
    naming_populations: Callable[[AdminClient, str], AbstractContextManager[None]],
) -> int:
    """Run a parsed ``fedfleet model``; errors are raised as the toolchain commands' are."""
    out: Path = args.out
    if out.is_dir():
        raise ModelError(f"-o {out} is a folder; name the file to write")
    if out.exists() and not args.force:
        raise ModelError(f"-o {out} exists; name a new file, or pass --force to replace it")
    data = out.with_name(f"{out.name}.{DATA_SUFFIX}")  # where a large model's tensors go
    if args.onnx is not None and data.exists() and not args.force:
        raise ModelError(
            f"{data} exists, where a large model's tensors are written beside -o {out}; name a new file, or pass "
            "--force to replace both"
        )
    if args.onnx is None and out.suffix.lower() == ".onnx":
        raise ModelError(
            f"-o {out} names an ONNX model, and without --onnx BUNDLE a checkpoint is written: give --onnx with the "
            "bundle the task was deployed from, or -o FILE.ckpt"
        )
    if not out.parent.is_dir():  # else said of the file written aside first, at the end
        raise ModelError(f"-o {out}: no folder {out.parent}; make it, or name a file in a folder that exists")
    if args.onnx is not None and not args.onnx.is_dir():
        raise ModelError(f"--onnx {args.onnx}: no such folder; give the bundle folder plan from-onnx wrote")
    if args.onnx is not None and out.resolve().parent == args.onnx.resolve() and out.name.startswith(MODEL_FILE):
        raise ModelError(
            f"-o {out} is the bundle's own {MODEL_FILE} (or its data), which the trained model is made from, and "
            "--onnx would read a trained one next time; name a file outside the bundle"
        )
    for option, value in (("--population", args.population), ("--task", args.task)):
        if value is not None and not is_name(value):
            raise ModelError(f"--{option.lstrip('-')} {value!r} refused: {NAME_RULE}")
    if args.server is not None:
        if args.population is None or args.task is None:
            raise ModelError("with --server, give --population and --task (fedfleet status lists a population's tasks)")
        with (
            AdminClient(args.server, admin_key=admin_key(), tls=client_tls(args)) as admin,
            naming_populations(admin, args.population),
        ):
            committed = _read(ServerModels(admin, args.population), args.task, args.round)
    else:
        run = RunModels(args.run, args.population)
        try:
            committed = _read(run, args.task or run.default_task(), args.round)
        except DamagedStore as exc:  # a model whose bytes no longer match its id
            raise ModelError(str(exc)) from None
        finally:
            run.close()
    try:
        weights = decode_checkpoint(committed.data)
    except (ValueError, PlanError) as exc:
        raise ModelError(
            f"the model of round {committed.round} of task {committed.task} does not read: {exc}"
        ) from None
    of = f"task {committed.task}'s model of round {committed.round}"
    if args.onnx is not None:
        made = write_trained_onnx(args.onnx, weights, out, task=committed.task)
        copies = [f"{copy} (the exporter's merged copy of {of_})" for copy, of_ in made.split.items()]
        split = f", among them {', '.join(copies[:3])}{' and more' if len(copies) > 3 else ''}" if copies else ""
        say(
            f"wrote {out}: {args.onnx / 'model.onnx'} with {of}: {len(made.trained)} initializers trained{split}; "
            f"{made.unchanged} kept as they were"
        )
        return 0
    aside = out.with_name(f".{out.name}.part")
    try:
        aside.write_bytes(committed.data)
        os.replace(aside, out)
    finally:
        aside.unlink(missing_ok=True)
    say(f"wrote {out}: {of}, {len(weights)} tensors")
    return 0


def _read(models: ServerModels | RunModels, task: str, number: int | None) -> Committed:
    return models.last(task) if number is None else models.of_round(task, number)
