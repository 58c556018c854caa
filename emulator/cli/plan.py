"""``fedfleet plan build|test|keygen|from-onnx|from-torch`` and ``fedfleet deploy``: the model engineer's commands.

fedfleet plan build TASK.py -o DIR          unversioned plan + one versioned plan per claimed runtime
fedfleet plan keygen --key KEY              a signing key for release reports (KEY, mode 0600) and the
                                            line a server's --release-trust file takes (KEY.pub)
fedfleet plan test TASK.py|DIR [-o DIR] --signing-key KEY
                                            release tests on each claimed real onnxruntime; prints a
                                            table per task (release, passed, max abs diff, ms/step,
                                            peak MB), writes DIR/<task>/release_report.json signed
                                            with KEY; exit 1 unless all passed
fedfleet plan from-onnx MODEL.onnx --label y [--loss L --optimizer O --lr LR --batch-size B --epochs E
            --opset N --collection C --trainable PATTERN ... --frozen PATTERN ... --runtimes R ... --name N] -o DIR
                                            a bundle plan test and deploy take as it is: DIR/model.onnx,
                                            a task file stub DIR/task.py (random proxy examples of the
                                            model's shapes) and what `plan build DIR/task.py -o DIR`
                                            writes; prints the inputs, the collection, the trained
                                            tensors and the next two commands; warns of an eval-mode
                                            export; -o PLAN.fedplan writes the training plan alone
fedfleet plan from-torch MODULE:FACTORY --input NAME:SHAPE[:DTYPE] ... --label y [same options] -o DIR
                                            exports FACTORY()'s nn.Module so that it trains right
                                            (dynamo, optimize=False, train mode, dynamic batch), then
                                            as from-onnx; needs the torch extra
fedfleet deploy DIR --server URL --population P   the plans and the release report, to the server; says
                                            whether each task runs now or is queued behind another
fedfleet status --server URL --population P   the population's tasks (active, queued, completed, stopped)
fedfleet rounds --server URL --population P [--task T]   its rounds, oldest first
fedfleet stop --server URL --population P --task T   stop a task on the running server for good: its open
                                            round closed without committing, its deploy's other tasks
                                            or the next deploy run on
fedfleet model --server URL --population P --task T [--round N] [--onnx BUNDLE] -o FILE
                                            its trained model (``emulator.cli.model``; --run RUN: of a
                                            simulated run)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import os
import shlex
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_runtime.plan import PlanError, serialize_plan
from device_runtime.protocol import redacted_url
from example_store import ExampleSelector
from server_stub.admin_auth import ADMIN_KEYS_ENV, AdminKeyError, AdminKeys
from server_stub.admin_client import AdminClient, AdminError, ServerUnreachable
from server_stub.errors import did_you_mean, did_you_mean_path, key_file_mistake
from server_stub.schemas import MAX_ROUND_ID, MAX_ROUNDS_PAGE, NAME_RULE, ROUNDS_PAGE, is_name

from ..releases.envs import RuntimeEnvError
from ..releases.workers import WorkerError, WorkerPool
from ..toolchain.bundle import (
    SOURCE,
    TASK_FILE,
    build_bundle,
    bundle_holding,
    check_bundle_path,
    deploy_bundle,
    release_test_bundle,
)
from ..toolchain.model_bundle import ModelBundle, bundle_from_onnx
from ..toolchain.onnx_import import trainable_table
from ..toolchain.release import release_table
from ..toolchain.release_signing import SigningKeyError, generate_signing_key, load_signing_key, public_key_path
from ..toolchain.tasks import Task, TaskError, onnx_import, onnx_output
from ..toolchain.torch_export import from_torch, parse_input
from .model import add_client_tls_options, add_model_parser, client_tls, model_command

__all__ = ["SIGNING_KEY_ENV", "add_toolchain_commands", "run_toolchain_command"]

#: Where ``plan test`` finds the signing key when ``--signing-key`` is not given.
SIGNING_KEY_ENV = "FEDFLEET_SIGNING_KEY"


def add_toolchain_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``plan``, ``deploy``, ``status``, ``rounds``, ``stop`` and ``model`` on the ``fedfleet`` command's subparsers."""
    plan = sub.add_parser("plan", help="build, test and make FL plans (the model engineer's workflow)")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    build = plan_sub.add_parser("build", help="build a task file's plans: unversioned and one per claimed runtime")
    build.add_argument(
        "task_file", type=Path, help="a Python file defining the task(s), e.g. examples/tasks/digits_task.py"
    )
    build.add_argument("-o", "--out", type=Path, required=True, help="directory to write the plans to")
    build.add_argument("--runtimes", nargs="+", help="claim these onnxruntime releases instead of the task's own")
    test = plan_sub.add_parser("test", help="release tests on every claimed real onnxruntime; writes a release report")
    test.add_argument("target", type=Path, help="a task file or a directory plan build wrote")
    test.add_argument("-o", "--out", type=Path, help="where to build a task file first (default: build/<file stem>)")
    test.add_argument("--runtimes", nargs="+", help="claim these onnxruntime releases instead of the task's own")
    test.add_argument(
        "--signing-key",
        type=Path,
        help=f"sign the reports with this key (plan keygen makes one; "
        f"else ${SIGNING_KEY_ENV}); a server accepts only reports signed by a key it trusts",
    )
    keygen = plan_sub.add_parser(
        "keygen", help="make a key to sign release reports with, and its line for a server's --release-trust file"
    )
    keygen.add_argument(
        "--key",
        type=Path,
        required=True,
        help="where to write the private key (mode 0600); its trust line goes to KEY.pub",
    )
    keygen.add_argument("--label", default="", help="a name for the key in the trust line (who holds it)")
    keygen.add_argument("--force", action="store_true", help="replace an existing key file")
    onnx_cmd = plan_sub.add_parser(
        "from-onnx", help="a deployable bundle (plans, initial checkpoint, task file) from an ONNX inference model"
    )
    onnx_cmd.add_argument("model", type=Path, help="the ONNX inference model")
    _model_options(onnx_cmd, plan_alone=True)
    torch_cmd = plan_sub.add_parser(
        "from-torch", help="export a PyTorch module so that it trains right, then as from-onnx (needs the torch extra)"
    )
    torch_cmd.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a module path or .py file and a function in it that "
        "returns the nn.Module (its weights are the initial model)",
    )
    torch_cmd.add_argument(
        "--input",
        nargs="+",
        action="extend",
        required=True,
        metavar="NAME:SHAPE[:DTYPE]",
        dest="inputs",
        help="each input of forward(), in order: one example's shape without the batch axis, dims "
        "joined by x (1x28x28; empty for a scalar), dtype float32 (default), int64, bool, ...",
    )
    _model_options(torch_cmd, plan_alone=False)
    deploy = sub.add_parser("deploy", help="send a tested task's plans and release report to a server")
    deploy.add_argument("directory", type=Path, help="a bundle directory that plan build and plan test wrote")
    _server_options(deploy, "the population to deploy into (created if missing)")
    status = sub.add_parser(
        "status",
        help="a population's tasks on a server (active, queued behind which task, completed) and its open round",
    )
    _server_options(status, "the population to show")
    rounds = sub.add_parser("rounds", help="a population's rounds on a server, oldest first, one line each")
    _server_options(rounds, "the population whose rounds to list")
    rounds.add_argument("--task", help="only this task's rounds (default: every task's)")
    rounds.add_argument(
        "--last",
        type=_round_count,
        help=f"the newest so many rounds, 1 to {MAX_ROUNDS_PAGE} (default: the server's {ROUNDS_PAGE})",
    )
    rounds.add_argument(
        "--before",
        type=_round_cursor,
        metavar="ID",
        help="only rounds older than those shown with this --before (the command names it when older ones are on record)",
    )
    stop = sub.add_parser(
        "stop",
        help="stop a task on a running server for good (one without max_rounds, diverging or deployed by mistake): "
        "its open round is closed without committing, its models and rounds stay, the next deploy starts",
    )
    _server_options(stop, "the population of the task")
    stop.add_argument("--task", required=True, help="the task to stop (its evaluation tasks stop with it)")
    add_model_parser(sub, ADMIN_KEY_HELP)


def _server_options(cmd: argparse.ArgumentParser, population: str) -> None:
    """The options of every command that talks to a server (deploy, status, rounds, stop)."""
    cmd.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    cmd.add_argument("--population", required=True, help=population)
    cmd.add_argument("--admin-key-file", help=ADMIN_KEY_HELP)
    add_client_tls_options(cmd)


#: ``--admin-key-file``'s help, of every command that talks to a server.
ADMIN_KEY_HELP = f"operator keys, one per line (else ${ADMIN_KEYS_ENV})"


def _model_options(cmd: argparse.ArgumentParser, *, plan_alone: bool) -> None:
    """The options from-onnx and from-torch share: how the plan trains and where it goes (from-onnx
    also writes a plan alone: ``plan_alone``)."""
    cmd.add_argument("--label", required=True, help="name of the label input (it becomes a plan input)")
    cmd.add_argument("--loss", default="cross_entropy", help="cross_entropy, binary_cross_entropy or mse")
    cmd.add_argument(
        "--output",
        help=(
            "the graph output the loss reads, where the model has several, or a tensor inside the graph (the logits "
            "of a classifier exported with its ArgMax; default: the only float output with a batch axis; refused "
            "where there are more)"
            if plan_alone
            else "the value of forward's the loss reads, where forward returns several (a tuple's index, a dict's "
            "key or an output object's attribute, such as logits; default: the only float one with a batch axis)"
        ),
    )
    cmd.add_argument("--optimizer", default="sgd", choices=["sgd", "momentum", "adam"], help="the device's optimizer")
    cmd.add_argument("--lr", type=float, default=0.1, help="the device optimizer's learning rate")
    cmd.add_argument("--batch-size", type=int, default=32, help="examples per training step")
    cmd.add_argument("--epochs", type=int, default=1, help="passes over a device's examples per round")
    cmd.add_argument("--opset", type=int, default=21, help="the ONNX opset of the plans")
    cmd.add_argument("--collection", default="app:/examples", help="the example store collection devices read")
    cmd.add_argument(
        "--trainable",
        nargs="+",
        metavar="PATTERN",
        help="train only the initializers these names "
        "or glob patterns match (default: float32 tensors of rank >= 1 on a float path to the output, "
        "less one-element scales)",
    )
    cmd.add_argument(
        "--frozen",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="keep the initializers these names or glob patterns match constant",
    )
    cmd.add_argument(
        "--frozen-rows",
        nargs="+",
        default=[],
        type=_frozen_rows,
        metavar="NAME:ROW[,ROW]",
        help="rows of a trained weight no gradient reaches, as torch's nn.Embedding(padding_idx=ROW) keeps its "
        "padding row (exporters drop padding_idx; from-torch reads it from the module)",
    )
    cmd.add_argument(
        "--runtimes",
        nargs="+",
        help="the onnxruntime releases the task claims (default: the oldest, a middle and the newest known)",
    )
    cmd.add_argument("--name", help="the task's name (default: the model file's or the factory's name)")
    cmd.add_argument(
        "-o",
        "--out",
        type=Path,
        required=True,
        help="the bundle directory to write"
        + (" (a path ending in .fedplan writes the training plan alone)" if plan_alone else ""),
    )


def run_toolchain_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``plan ...``, ``deploy``, ``status``, ``rounds`` or ``stop`` command; returns the exit status.
    A server that does not answer, or a URL without http://, is one line on stderr (exit 2)."""
    say = lambda message: print(message, file=out or sys.stdout, flush=True)  # noqa: E731
    if args.command in ("deploy", "status", "rounds", "stop") and not is_name(
        args.population
    ):  # else a bare 404 Not Found
        print(f"{_command(args)}: --population {args.population!r} refused: {NAME_RULE}", file=sys.stderr)
        return 2
    if args.command == "stop" and not is_name(args.task):
        print(f"{_command(args)}: --task {args.task!r} refused: {NAME_RULE}", file=sys.stderr)
        return 2
    try:
        if args.command == "deploy":
            return _deploy(args, say)
        if args.command == "status":
            return _status(args, say)
        if args.command == "rounds":
            return _rounds(args, say)
        if args.command == "stop":
            return _stop(args, say)
        if args.command == "model":
            return model_command(args, say, lambda: _admin_key(args), _naming_populations)
        if args.plan_command == "build":
            check_task_file(args.task_file)
            build_bundle(args.task_file, args.out, runtimes=args.runtimes, say=say)
            return 0
        if args.plan_command == "test":
            return _test(args, say)
        if args.plan_command == "keygen":
            return _keygen(args, say)
        if args.plan_command == "from-onnx":
            return _from_onnx(args, say)
        if args.plan_command == "from-torch":
            return _from_torch(args, say)
    except (TaskError, PlanError, AdminKeyError, SigningKeyError) as exc:
        print(f"{_command(args)}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the system's words alone ("[Errno 30] Read-only file system: 'out'") say not what to do
        if exc.filename is None:
            print(f"{_command(args)}: {exc}", file=sys.stderr)
        else:
            print(
                f"{_command(args)}: cannot use {exc.filename} ({exc.strerror or exc}); give files that can be read "
                "and an output folder that can be written",
                file=sys.stderr,
            )
        return 2
    except (WorkerError, RuntimeEnvError) as exc:
        print(f"{_command(args)}: a runtime environment failed: {exc}", file=sys.stderr)
        return 2
    except AdminError as exc:
        if exc.code == "MALFORMED_ANSWER":  # not a refusal: another server, or another version of it
            print(
                f"{_command(args)}: {exc}; is --server a fedfleet server of this version (GET /openapi.json)?",
                file=sys.stderr,
            )
            return 2
        if exc.code is None:  # an answer with no fedfleet error in it: another service, a proxy's page
            print(
                f"{_command(args)}: {redacted_url(args.server)} answered {exc.status} with no fedfleet error in it; is --server a "
                "fedfleet server of this version (GET /openapi.json)?",
                file=sys.stderr,
            )
            return 2
        print(f"{_command(args)}: the server refused: {exc}", file=sys.stderr)
        return 1
    except ServerUnreachable as exc:
        print(f"{_command(args)}: {exc}", file=sys.stderr)
        return 2
    return 2


#: What a file of each kind is, by its suffix, and the command that takes it ({path}: the file given):
#: said when one is given where another kind goes.
FILE_KINDS = {
    ".onnx": (
        "an ONNX model",
        "`fedfleet plan from-onnx {path} --label LABEL -o DIR` makes a bundle of it (DIR/task.py its task file)",
    ),
    ".pt": (
        "a PyTorch checkpoint (torch.save)",
        "`fedfleet plan from-torch MODULE:FACTORY --input NAME:SHAPE --label LABEL -o DIR` exports the module that "
        "makes it",
    ),
    ".toml": ("a fleet config", "`fedfleet simulate {path}` runs it"),
    ".py": (
        "a task file",
        "`fedfleet plan build {path} -o DIR` builds it, `fedfleet simulate --task {path}` simulates it",
    ),
}
FILE_KINDS[".pth"] = FILE_KINDS[".pt"]
#: Files a newcomer gives as a task file, which ran as Python and failed on their content ('name
#: 'null' is not defined', 'invalid syntax'); refused by ``check_task_file`` before they run.
FILE_KINDS.update(
    {
        ".key": (
            "a key file",
            "`fedfleet plan test DIR --signing-key {path}` takes a signing key (`fedfleet plan keygen` makes one), "
            "`--admin-key-file {path}` a file of operator keys",
        ),
        ".pub": (
            "a release trust line (`fedfleet plan keygen`'s KEY.pub)",
            "`fedfleet server --release-trust {path}` takes it",
        ),
        ".json": (
            "a JSON file",
            "a release report goes with its bundle folder (`fedfleet deploy DIR`), an attestation trust anchor to "
            "`fedfleet server --attestation-trust {path}`",
        ),
        ".data": (
            "an ONNX model's external weights",
            "`fedfleet plan from-onnx MODEL.onnx --label LABEL -o DIR` reads them beside the model",
        ),
        ".npz": ("a NumPy archive", "`fedfleet simulate --data npz:{path}` takes one as a fleet's data"),
        ".csv": ("a table", "`fedfleet simulate --data table:{path},client=COLUMN` takes one as a fleet's data"),
        ".parquet": ("a table", "`fedfleet simulate --data table:{path},client=COLUMN` takes one as a fleet's data"),
    }
)
#: What ``check_task_file`` says a task file is, where a file of another kind is given.
TASK_FILE_KIND = "a task file (Python, .py)"


def refuse_file_kind(path: str | Path, wanted: str, *suffixes: str) -> None:
    """Refuse a file of one of ``FILE_KINDS``'s ``suffixes`` given where ``wanted`` goes, in one
    line naming the command that takes it (where reading it as ``wanted`` said 'source code string
    cannot contain null bytes', or 'not valid TOML; fix the syntax' of a task file)."""
    suffix = Path(path).suffix.lower()
    if suffix in suffixes and Path(path).is_file():
        kind, how = FILE_KINDS[suffix]
        raise TaskError(f"{path} is {kind}, not {wanted}; {how.format(path=path)}")


def check_task_file(path: str | Path) -> None:
    """Refuse a model, fleet config, plan or a bundle's file given as a task file in one line naming
    what takes it (a bundle's manifest or checkpoint ran as Python: 'null' is not defined; a key,
    trust line, JSON file or data set: a SyntaxError or NameError of its content)."""
    refuse_file_kind(path, TASK_FILE_KIND, ".onnx", ".pt", ".pth", ".toml")
    plan = Path(path).suffix.lower() == ".fedplan"
    bundle = bundle_holding(path) if Path(path).is_file() else None
    if bundle is not None and Path(path).resolve() != (bundle / TASK_FILE).resolve():
        raise TaskError(
            f"{path} is {'a plan built into' if plan else 'a file of'} the bundle {bundle}; give {bundle} (plan "
            f"build: its task file, {bundle / TASK_FILE})"
        )
    if plan and Path(path).is_file():
        check_bundle_path(path)  # a plan alone (plan from-onnx -o PLAN.fedplan): how to make a bundle
    refuse_file_kind(path, TASK_FILE_KIND, ".key", ".pub", ".json", ".data", ".npz", ".csv", ".parquet")
    if Path(path).suffix.lower() != ".py" and Path(path).is_file():  # a text or binary file of any other name
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        try:
            if len(head) < 1 << 20 or b"\x00" in head:
                compile(head, str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
            why = f"{type(exc).__name__}: {exc.msg}" if isinstance(exc, SyntaxError) else "it holds null bytes"
            raise TaskError(f"{path} is not a task file (Python, .py): it does not parse as Python ({why})") from None


def _command(args: argparse.Namespace) -> str:
    """The command as typed, which starts its one-line errors: ``fedfleet deploy``, ``fedfleet plan build``."""
    plan = getattr(args, "plan_command", None) if args.command == "plan" else None
    return f"fedfleet {args.command} {plan}" if plan else f"fedfleet {args.command}"


def _keygen(args: argparse.Namespace, say) -> int:
    if Path(args.key).is_dir():  # not "already exists ... --force", which then fails on the folder
        raise SigningKeyError(f"{args.key} is a folder; name a file for the key (KEY.pub is written beside it)")
    generate_signing_key(args.key, label=args.label, force=args.force)
    line = public_key_path(args.key).read_text(encoding="utf-8").strip()
    say(f"signing key: {args.key} (keep it secret; sign with `fedfleet plan test --signing-key {args.key}`)")
    say(
        f"trust line:  {public_key_path(args.key)}; a server accepts reports signed with this key once its "
        f"--release-trust file holds the line\n  {line}"
    )
    return 0


def _signing_key(args: argparse.Namespace) -> Ed25519PrivateKey | None:
    """The key of --signing-key or $FEDFLEET_SIGNING_KEY, loaded before any test runs; None when
    neither is given (``_test`` says so once the task file has loaded)."""
    path = args.signing_key or os.environ.get(SIGNING_KEY_ENV)
    return load_signing_key(path) if path else None


def _test(args: argparse.Namespace, say) -> int:
    check_task_file(args.target)
    signing_key = _signing_key(args)  # a missing key file is said before a missing target
    if not args.target.exists():
        raise TaskError(
            f"{args.target}: no such file or folder{did_you_mean_path(args.target)}; give a task file or a bundle folder"
        )
    directory = args.target
    if args.target.is_file():
        directory = args.out or _default_build_dir(args.target)
        build_bundle(args.target, directory, runtimes=args.runtimes, say=say)
    elif args.runtimes:
        raise TaskError("--runtimes applies when building; build the directory again with `plan build --runtimes ...`")
    if signing_key is None:  # after the build: a file that is no task file is its one line
        say(
            f"note: the release reports will not be signed; a server that requires release reports refuses unsigned "
            f"ones. Sign with --signing-key KEY (`fedfleet plan keygen --key KEY` makes a key) or ${SIGNING_KEY_ENV}"
        )
    results: dict[str, bool] = {}
    with WorkerPool() as pool:
        for built in release_test_bundle(directory, pool, say=say, signing_key=signing_key):
            report = built.report()
            assert report is not None
            say(textwrap.indent(release_table(report), "  "))
            signed = " (signed)" if signing_key is not None else " (unsigned)"
            say(f"{built.task.name}: {'passed' if report['passed'] else 'FAILED'}; report {built.report_path}{signed}")
            results[built.task.name] = bool(report["passed"])
    passed = all(results.values())
    if len(results) > 1:  # a group: its verdict last, not the last variant's own
        failed = [name for name, ok in results.items() if not ok]
        say(
            f"{len(failed)} of {len(results)} tasks failed: {', '.join(failed)}"
            if failed
            else f"all {len(results)} tasks passed"
        )
    if passed:
        say(
            f"next: fedfleet deploy {directory} --server URL --population P"
            if signing_key is not None
            else f"next: sign the reports (fedfleet plan test {directory} --signing-key KEY), then fedfleet deploy "
            f"{directory} --server URL --population P"
        )
    return 0 if passed else 1


def _default_build_dir(task_file: Path) -> Path:
    """Where ``plan test TASK.py`` builds without ``-o``: the bundle a task file is the stub of
    (``DIR/task.py`` beside the ``source.json`` a build wrote: every stub is named task.py, and its
    bundle is where deploy reads the report), else ``build/<file stem>``."""
    if task_file.name == TASK_FILE and (task_file.parent / SOURCE).is_file():
        return task_file.parent
    return Path("build") / task_file.stem


def _from_onnx(args: argparse.Namespace, say) -> int:
    refuse_file_kind(args.model, "an ONNX model", ".py", ".toml", ".pt", ".pth")
    if not args.model.is_file():  # not the library's "pass a path to a .onnx file, its bytes, or a ModelProto"
        raise TaskError(
            f"{args.model}: {'a folder' if args.model.is_dir() else 'no such file' + did_you_mean_path(args.model)}; "
            "give the path of the ONNX model "
            "file (.onnx) to make a bundle of"
        )
    if args.out.suffix == ".fedplan":
        return _plan_only(args, say)
    made = bundle_from_onnx(args.model, args.out, **_bundle_options(args), say=say)
    _say_bundle(made, say, _command(args))
    return 0


def _from_torch(args: argparse.Namespace, say) -> int:
    if args.out.suffix == ".fedplan":
        raise TaskError("from-torch writes a bundle directory; give -o DIR")
    made = from_torch(
        args.factory, [parse_input(spec) for spec in args.inputs], args.out, **_bundle_options(args), say=say
    )
    _say_bundle(made, say, _command(args))
    return 0


def _frozen_rows(spec: str) -> tuple[str, tuple[int, ...]]:
    """``--frozen-rows NAME:ROW[,ROW]``: a weight's name (which may hold colons) and its rows."""
    name, _, rows = spec.rpartition(":")
    try:
        parsed = tuple(int(r) for r in rows.split(","))
    except ValueError:
        parsed = ()
    if not name or not parsed:
        raise argparse.ArgumentTypeError(f"give NAME:ROW[,ROW] (emb.weight:0), not {spec!r}")
    return name, parsed


def _rows_of(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """``--frozen-rows`` as the task field: each weight's rows, however many times it is named."""
    rows: dict[str, tuple[int, ...]] = {}
    for name, more in args.frozen_rows:
        rows[name] = (*rows.get(name, ()), *more)
    return rows


def _bundle_options(args: argparse.Namespace) -> dict:
    return dict(
        frozen_rows=_rows_of(args),
        label=args.label,
        loss=args.loss,
        optimizer=args.optimizer,
        lr=args.lr,
        batch_size=args.batch_size,
        epochs=args.epochs,
        opset=args.opset,
        collection=args.collection,
        trainable=args.trainable,
        frozen=args.frozen,
        runtimes=args.runtimes,
        name=args.name,
        output=args.output,
    )


def _say_trained(made, say, frozen_rows: Mapping[str, tuple[int, ...]], command: str) -> None:
    """What a made plan trains, and its warnings on stderr, each starting with ``command`` as typed."""
    say("trains:")
    for line in trainable_table(made.trainable):
        say(line)
    if made.split:
        say(
            f"split {len(made.split)} parameters the exporter had merged into equal-valued initializers back into "
            f"weights of their own: {', '.join(made.split)}"
        )
    for weight, readers in made.shared.items():
        say(
            f"shared: {weight} is one weight read in {readers} places (the model ties it; the plan's metadata lists it)"
        )
    for weight, rows in frozen_rows.items():
        say(
            f"no gradient reaches row {', '.join(map(str, rows))} of {weight} (an embedding's padding_idx, as in torch)"
        )
    for warning in made.warnings:
        print(f"{command}: warning: {warning}", file=sys.stderr, flush=True)


def _say_bundle(made: ModelBundle, say, command: str) -> None:
    say(
        f"wrote {made.directory}: {made.directory / 'task.py'} (a stub to edit), the model, task {made.task}'s plans and "
        "initial checkpoint"
    )
    say(
        "inputs: "
        + ", ".join(f"{n} {list(shape)} {dtype}" for n, (dtype, shape) in made.inputs.items())
        + f"; label: {made.label}"
    )
    say(f"reads collection: {made.collection}")
    _say_trained(made, say, made.frozen_rows, command)
    features = ", ".join(dict.fromkeys([*made.inputs, made.label]))
    say("next:")
    say(f"  fedfleet plan test {made.directory} --signing-key KEY   (fedfleet plan keygen --key KEY makes one)")
    say(f"  fedfleet deploy {made.directory} --server URL --population P")
    say(
        f"or first an hour of 1,000 simulated devices, in seconds, with data whose features are {features} "
        "(--data's rename=OLD:NEW names them; a CSV of rows with a client-id column is table:FILE.csv,client=COLUMN):"
    )
    say(f"  fedfleet simulate --task {made.directory} --data FORMAT:PATH --devices 1000 --hours 1 --out run/")


def _plan_only(args: argparse.Namespace, say) -> int:
    """``-o PLAN.fedplan``: the training plan alone, as before bundles (no checkpoint, not deployable)."""
    task = Task(
        name=args.name or args.model.stem,
        model=args.model,
        proxy=lambda: None,  # type: ignore[arg-type, return-value]
        loss=args.loss,
        optimizer=args.optimizer,
        hyperparameters={"lr": args.lr},
        label=args.label,
        selector=ExampleSelector(args.collection),
        batch_size=args.batch_size,
        epochs=args.epochs,
        opset=args.opset,
        trainable=None if args.trainable is None else tuple(args.trainable),
        frozen=tuple(args.frozen),
        frozen_rows=_rows_of(args),
    )
    source = task._model_source()
    output, chosen = onnx_output(source, args.output, loss=args.loss)
    if chosen:
        say(chosen)
    task = dataclasses.replace(task, output=output)
    made = onnx_import(source, task)
    plan = dataclasses.replace(made.plan, name=task.name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(serialize_plan(plan))
    say(f"wrote {args.out}: opset {plan.metadata.opset}, weights {', '.join(plan.weight_names)}")
    _say_trained(made, say, task.frozen_rows, _command(args))
    say(
        "note: a plan file alone cannot be tested or deployed; -o DIR (a directory) writes a bundle with the initial "
        "checkpoint and a task file that `plan test DIR` and `deploy DIR` take"
    )
    return 0


def _admin_key(args: argparse.Namespace) -> str:
    """The first operator key of --admin-key-file or $FEDFLEET_ADMIN_KEYS (checked like the server does)."""
    if args.admin_key_file:
        if (mistake := key_file_mistake("--admin-key-file", args.admin_key_file)) is not None:
            raise AdminKeyError(mistake)
        with _naming_the_key_source(f"--admin-key-file {args.admin_key_file}", args.admin_key_file):
            AdminKeys.from_file(args.admin_key_file)
        text = Path(args.admin_key_file).read_text(encoding="utf-8")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    else:
        raw = os.environ.get(ADMIN_KEYS_ENV)
        if raw is None:
            raise AdminKeyError(f"give an operator key with --admin-key-file or ${ADMIN_KEYS_ENV}")
        with _naming_the_key_source(f"${ADMIN_KEYS_ENV}", ADMIN_KEYS_ENV):
            AdminKeys.from_env()
        lines = raw.replace(",", " ").split()
    return lines[0]


@contextlib.contextmanager
def _naming_the_key_source(source: str, name: str) -> Iterator[None]:
    """An ``AdminKeyError`` that does not say where the keys came from starts with ``source``."""
    try:
        yield
    except AdminKeyError as exc:
        if name in str(exc):
            raise
        raise AdminKeyError(f"{source}: {exc}") from None


def _deploy(args: argparse.Namespace, say) -> int:
    # the path before the operator key: the first thing a newcomer gets wrong
    if bundle_holding(args.directory) is not None:
        check_bundle_path(args.directory)  # a file of a bundle (its task.py too): names the bundle
    refuse_file_kind(args.directory, "a bundle folder", ".onnx", ".pt", ".pth", ".toml", ".py")
    check_bundle_path(args.directory)
    with AdminClient(args.server, admin_key=_admin_key(args), tls=client_tls(args)) as admin:
        result = deploy_bundle(args.directory, admin, args.population)
    tasks = result.get("tasks", [result])
    over = [t for t in tasks if t.get("already_deployed") and t.get("status") in _NOT_RUN_AGAIN]
    if over:  # the same deploy sent again after its task ended: nothing runs, though the server took it as sent
        said = ", ".join(f"{t['task']} is {t['status']}" for t in over)
        print(
            f"{_command(args)}: population {args.population} has this bundle's tasks already, as they are, and "
            f"{said}: a task does not run again. To go on from its last committed model, deploy it under a new "
            "name with that model as its initial checkpoint (docs/tutorials/model-engineer.md, After the deploy)",
            file=sys.stderr,
        )
        return 1
    for task in tasks:
        say(f"deployed to {redacted_url(args.server)} population {args.population}: {deployed_line(task)}")
    # a command to paste into a shell, with the key file deploy was given (status needs it too)
    q = shlex.quote
    key = f" --admin-key-file {q(args.admin_key_file)}" if args.admin_key_file else ""
    say(
        f"next: fedfleet status --server {q(redacted_url(args.server))} --population {q(args.population)}{key} "
        "(its tasks and open round)"
    )
    return 0


#: A task in one of these states has run for good (or never will): deploying it again runs nothing.
_NOT_RUN_AGAIN = ("stopped", "completed", "retired", "refused")


@contextlib.contextmanager
def _naming_populations(admin: AdminClient, population: str) -> Iterator[None]:
    """A population the server does not have, refused with the one of its populations closest to
    it (``digit``: ``digits``) and the ones it has."""
    try:
        yield
    except AdminError as exc:
        if exc.code != "UNKNOWN_POPULATION":
            raise
        names = admin.populations()
        has = f"it has {', '.join(names)}" if names else "it has no population yet (fedfleet deploy makes one)"
        raise AdminError(f"{exc}{did_you_mean(population, names)}; {has}", exc.status, exc.code) from None


def _status(args: argparse.Namespace, say) -> int:
    with (
        AdminClient(args.server, admin_key=_admin_key(args), tls=client_tls(args)) as admin,
        _naming_populations(admin, args.population),
    ):
        status = admin.status(args.population)
    say(f"population {status['population']}" + (f" (strategy {status['strategy']})" if status.get("strategy") else ""))
    if not status["tasks"]:
        say(
            f"  no task yet: fedfleet deploy BUNDLE --server {redacted_url(args.server)} --population {args.population} deploys one"
        )
    for task in status["tasks"]:
        behind = f" behind {', '.join(task['queued_behind'])}" if task.get("queued_behind") else ""
        why = f": {task['reason']}" if task.get("reason") else ""
        say(f"  {task['name']}: {task['status']}{behind}{why}")
    if status.get("waiting"):
        say(f"no round open: {status['waiting']}")
    if status.get("active_task"):
        say(
            f"open round: {status['active_task']} round {status['round']} ({status['phase']}), "
            f"{status['committed_rounds']} committed"
        )
    return 0


def _stop(args: argparse.Namespace, say) -> int:
    with (
        AdminClient(args.server, admin_key=_admin_key(args), tls=client_tls(args)) as admin,
        _naming_populations(admin, args.population),
    ):
        stopped = admin.stop_task(args.population, args.task)
    also = [name for name in stopped["stopped"] if name != stopped["task"]]
    said = f"stopped task {stopped['task']} of population {stopped['population']}"
    if also:
        said += f" and {', '.join(also)}, which evaluate{'s' if len(also) == 1 else ''} it"
    round_said = (
        f"its round {stopped['abandoned_round']} abandoned"
        if stopped.get("abandoned_round") is not None
        else "no round of it was open"
    )
    say(f"{said}: {round_said}; {stopped['committed_rounds']} committed round(s) on record")
    if stopped["running"]:
        say(f"running now: {', '.join(stopped['running'])}")
    else:
        say("no task of the population runs now")
    # commands to paste into a shell: a name or path with a space or a quote is quoted as the shell reads it
    task, q = stopped["task"], shlex.quote
    where = f"--server {q(redacted_url(args.server))} --population {q(stopped['population'])}"
    key = f" --admin-key-file {q(args.admin_key_file)}" if args.admin_key_file else ""
    say(f"its final model: fedfleet model {where} --task {q(task)}{key} -o {q(task + '.ckpt')}")
    say(f"its rounds: fedfleet rounds {where} --task {q(task)}{key}")
    return 0


def _round_count(text: str) -> int:
    """``--last``: a number of rounds the server takes in one answer (1 to ``MAX_ROUNDS_PAGE``)."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_ROUNDS_PAGE:
        raise argparse.ArgumentTypeError(f"give a number of rounds from 1 to {MAX_ROUNDS_PAGE}, not {text!r}")
    return count


def _round_cursor(text: str) -> int:
    """``--before``: the cursor a page of rounds names for the page of older ones (a round's record id)."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_ROUND_ID:
        raise argparse.ArgumentTypeError(f"give the --before a rounds listing named, not {text!r}")
    return int(text)


def _rounds(args: argparse.Namespace, say) -> int:
    with (
        AdminClient(args.server, admin_key=_admin_key(args), tls=client_tls(args)) as admin,
        _naming_populations(admin, args.population),
    ):
        rounds, older = admin.round_page(args.population, args.task, args.last, args.before)
    if not rounds:  # not a bare header
        which = f"task {args.task} of {args.population}" if args.task else args.population
        said = (
            "before that round"
            if args.before is not None
            else "yet: a round is on record once it commits or is abandoned"
        )
        say(f"no rounds of {which} on record {said}")
        return 0
    say("task                 round  attempt  status      selected  reported  started (UTC)        model")
    for r in rounds:
        m = r.get("metrics", {})
        started = _utc(r["started_at"])
        say(
            f"{r['task'][:20]:<20} {r['round']:>5}  {r['attempt']:>7}  {r['status']:<10} {m.get('selected', '-'):>9} "
            f"{m.get('reported', '-'):>9}  {started}  {_model_said(r)}"
        )
    if older is not None:
        say(f"older rounds are on record: add --before {older} to see them (--last up to {MAX_ROUNDS_PAGE} a page)")
    return 0


def _model_said(r: dict) -> str:
    """A round's model as ``rounds`` shows it: the first 12 characters of a committed round's
    checkpoint id (``admin.checkpoint(id)`` reads it, ``fedfleet model --round N`` writes it),
    ``pruned`` where ``fedfleet prune`` dropped it, ``-`` for a round that committed none."""
    if r["status"] != "committed" or "evaluated_checkpoint_id" in r.get("metrics", {}):
        return "-"
    return str(r["checkpoint_id"])[:12] if r.get("checkpoint_id") else "pruned"


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def deployed_line(task: dict) -> str:
    """One deployed task as the operator needs it: whether it runs now, or waits behind which task
    (a population runs one deploy at a time; a task without max_rounds never ends on its own)."""
    line = f"task {task['task']} (plan {str(task.get('plan_id', ''))[:12]})"
    if task.get("already_deployed"):
        line += " already deployed as it is, nothing changed;"
    if task.get("status") == "queued":
        behind = ", ".join(task.get("queued_behind", []))
        return (
            f"{line} queued behind {behind}; it starts once {behind} completes (reaches its max_rounds: one "
            "without never does) or is stopped (fedfleet stop --task)"
        )
    return f"{line} {task.get('status', 'deployed')}"
