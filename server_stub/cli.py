"""``fedfleet server`` / ``python -m server_stub``: the FL server as a command."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn, TextIO

from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from . import backup
from .admin_auth import ADMIN_KEYS_ENV, AdminKeyError, AdminKeys
from .app import create_app
from .attestation import AttestationVerifier, NonceRegistry, RateLimiter
from .errors import closest, did_you_mean, key_file_mistake
from .http_guards import GuardedServer, HttpLimits
from .persistence import SCHEMA_VERSION, DamagedStore, DatabaseInUse, ServerStore, StoreLayoutError, store_advice
from .release_trust import ReleaseTrustError, read_release_trust
from .retention import Retention
from .serve import certificate_warning, server_tls_context
from .service import FLService
from .task_runs import NotRetired, retire_refused
from .trust_anchor import TrustAnchorError, read_trust_anchor

log = logging.getLogger(__name__)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (argparse's ArgumentDefaultsHelpFormatter shows it
    only for options that have help text, and shows None and False too)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not shows_default(action) or "%(default)" in text or "(default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """As ``DefaultsHelpFormatter``, for a parser whose description is laid out by hand."""


def shows_default(action: argparse.Action) -> bool:
    """Whether an option's default is worth printing: a value, not None, an empty list or a flag's False."""
    return (
        bool(action.option_strings)
        and action.default is not argparse.SUPPRESS
        and action.default is not None
        and action.default is not False
        and action.default not in ([], ())
        and action.help is not argparse.SUPPRESS
    )


#: The programs whose leftover arguments are refused by the subcommand they were given to.
TOP_LEVEL = ("fedfleet", "python -m server_stub")


class CommandParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line naming the command and its ``--help``, as every
    command's own refusals are (argparse prints the usage first, the whole top-level one for an
    option it does not know). Subcommands' parsers are of the same class (``add_subparsers`` makes
    them so)."""

    def error(self, message: str) -> NoReturn:
        message = _value_taken_for_a_command(self, message) or message + _given_before_the_command(self, message)
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value outside an option's choices, with the choice it is closest to (``--dp centrl``)."""
        if action.choices is not None and value not in action.choices and isinstance(value, str):
            choices = [str(choice) for choice in action.choices]
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(value, choices)}; choose from {', '.join(choices)}"
            )
        super()._check_value(action, value)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """At the top, an argument no parser took is refused by the command it was given to, with
        the option its name is closest to (``--hourz``: ``--hours``)."""
        self._typed = list(sys.argv[1:] if args is None else args)  # what ``error`` reads
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command in action.choices.values():
                    command._outer_typed = self._typed  # (what ``_given_before_the_command`` reads)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self.prog in TOP_LEVEL:
            command = _chosen(self, parsed)
            command.error(f"unrecognized arguments: {' '.join(extras)}{meant_options(command, extras)}")
        return parsed, extras


def _value_taken_for_a_command(parser: argparse.ArgumentParser, message: str) -> str | None:
    """A command that also runs without one of its commands (``fedfleet server``, beside ``server
    backup``) reads the value of an option it does not take as a command: ``fedfleet server
    --population digits`` said "invalid choice: 'digits'". Said instead as the option it does not
    take, with the commands that take it; None for any other mistake."""
    commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction) and not a.required), None)
    typed = getattr(parser, "_typed", None)
    if commands is None or typed is None or "invalid choice" not in message:
        return None
    known = [o for action in parser._actions for o in action.option_strings]
    unknown = [
        token
        for token in typed
        if token.startswith("--") and not any(option.startswith(token.split("=")[0]) for option in known)
    ]
    if unknown:
        return f"unrecognized arguments: {' '.join(unknown)}{meant_options(parser, unknown)}"
    word = message.split("invalid choice: ", 1)[1].split("'")[1] if "invalid choice: '" in message else "?"
    return (
        f"{word} is not a command{did_you_mean(word, list(commands.choices))}: {parser.prog} "
        f"{'|'.join(commands.choices)} ..., or {parser.prog} with options alone to run it"
    )


def _given_before_the_command(parser: argparse.ArgumentParser, message: str) -> str:
    """A message's ending for a required option of a command given before the command's name
    (``fedfleet server --db fl.db backup --out b.db``: ``--db`` is read as the server's own there);
    "" for any other mistake."""
    typed, word = getattr(parser, "_outer_typed", None), parser.prog.split()[-1]
    if typed is None or word not in typed or "the following arguments are required: " not in message:
        return ""
    missing = message.split("the following arguments are required: ", 1)[1].split(", ")
    before = typed[: typed.index(word)]
    given = [m for m in missing if any(t == m or t.startswith(f"{m}=") for t in before)]
    if not given:
        return ""
    return f" ({_listed(given)} came before {word}: put {'it' if len(given) == 1 else 'them'} after {word})"


def meant_options(parser: argparse.ArgumentParser, typed: list[str]) -> str:
    """A message's ending that names the option of ``parser`` closest to each of ``typed`` that is
    one, " (did you mean --a, --b?)" (``--hourz=3``: ``--hours``), or says that a positional
    argument is given without its name as an option (``--fleet F``: ``fedfleet simulate F``); ""
    when none is close."""
    options = [o for action in parser._actions for o in action.option_strings]
    positional = {  # each positional by its name and its name's first word (``--task`` for task_file)
        word: a
        for a in parser._actions
        if not a.option_strings
        for word in (a.dest.replace("_", "-"), a.dest.split("_")[0], str(a.metavar or "").lower())
    }
    close = []
    for name in (x.split("=")[0] for x in typed if x.startswith("-")):
        if (action := positional.get(name.lstrip("-"))) is not None and name.lstrip("-"):
            shown = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            return f" ({action.dest.replace('_', ' ')} is given without {name}: {parser.prog} {shown} ...)"
        meant = closest(name, options)
        if takers := _taken_by(parser, name):  # an option of another command (``status --last``)
            also = f"; or did you mean {meant}?" if meant is not None else ""
            return f" ({name} is an option of {_listed(takers)}, not of {parser.prog}{also})"
        if meant is not None:
            close.append(meant)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _taken_by(parser: argparse.ArgumentParser, option: str) -> list[str]:
    """The other commands of ``parser``'s program that take ``option`` as it is typed."""
    root = getattr(parser, "_root", None)
    if root is None or not option.startswith("--"):
        return []
    return [
        p.prog
        for p in parsers(root)
        if p is not parser
        and not any(isinstance(a, argparse._SubParsersAction) and a.required for a in p._actions)
        and any(option in a.option_strings for a in p._actions)
    ]


class _NoInterrupts(logging.Filter):
    """Drops a record that carries a Ctrl-C: SQLAlchemy's pool logs the KeyboardInterrupt it passes
    on ("Exception during reset or similar") as an ERROR with its traceback, before the command's
    one interrupted line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


NO_INTERRUPTS = _NoInterrupts()


def log_interrupts_once() -> None:
    """Keep Ctrl-C's out of the log: every handler the root logger has now (``basicConfig``'s: call
    this after it) and the one Python writes with when there is none."""
    for handler in [*logging.getLogger().handlers, logging.lastResort]:
        if handler is not None:
            handler.addFilter(NO_INTERRUPTS)


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand's parser ``parsed`` went through (``fedfleet plan build``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
            return _chosen(action.choices[getattr(parsed, action.dest)], parsed)
    return parser


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it, depth first."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases name one parser twice
                found.extend(parsers(sub))
    return found


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make every ``--help`` of the tree under ``parser`` show the defaults (subparsers do not
    inherit their parent's formatter, so each is set here, in one place)."""
    for p in parsers(parser):
        p._root = parser  # type: ignore[attr-defined]  # what ``meant_options`` looks through for another command's option
        raw = isinstance(p.formatter_class, type) and issubclass(
            p.formatter_class, argparse.RawDescriptionHelpFormatter
        )
        p.formatter_class = RawDescriptionDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    return parser


#: What argparse reads as a negative number, not an option: its own ('-1', '-.5') and the ones it
#: took for options, '-1e-5' (an error 'expected one argument' for ``--delta -1e-5``) and '-inf'
#: (which the options' own checks then refuse by name). Python 3.14's argparse reads them itself.
NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|inf|infinity)$", re.IGNORECASE)


def read_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make every parser of the tree under ``parser`` take ``NEGATIVE_NUMBER`` as a value. argparse
    keeps its rule in the parser's ``_negative_number_matcher``; where a later argparse no longer
    reads it, its own rule holds, which takes these already."""
    for p in parsers(parser):
        p._negative_number_matcher = NEGATIVE_NUMBER
    return parser


def listen_url(host: str, port: int, *, tls: bool = False) -> str:
    """The URL a server listening on ``host`` and ``port`` answers at: an IPv6 address in brackets
    (``http://[::1]:8000``), as a URL writes it; ``https://`` with ``tls``."""
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 1-65535 (0 picks a free one)")
    return port


#: The attestation options (dest -> default, help): given without ``--attestation-trust`` they are refused.
ATTESTATION_OPTIONS = {
    "rate_burst": (5.0, "check-ins a device may make at once (with attestation)"),
    "rate_per_hour": (60.0, "check-ins a device regains per hour (with attestation)"),
    "nonce_ttl": (120.0, "seconds an attestation nonce stays valid"),
}


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default="fl_server.db", help="SQLite file (created if missing) or a SQLAlchemy URL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: loopback only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0 picks a free one)")
    p.add_argument(
        "--admin-key-file",
        help=f"operator keys, one per line, read again on SIGHUP (else ${ADMIN_KEYS_ENV}; else a key is generated "
        "and printed)",
    )
    p.add_argument(
        "--attestation-trust",
        metavar="FILE",
        help="trust anchor of the attestation authority (fedfleet authority writes one); admits only attested devices",
    )
    for dest, (default, text) in ATTESTATION_OPTIONS.items():
        p.add_argument(f"--{dest.replace('_', '-')}", type=float, default=default, help=text)
    p.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve HTTPS with this certificate chain (PEM, the server's certificate first; its key too unless "
        "--tls-key); without it the server speaks plain HTTP, for a TLS proxy in front",
    )
    p.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM, unencrypted)")
    p.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="with --tls-cert: admit only clients (devices, operators) with a certificate one of these authorities "
        "(PEM) issued: mutual TLS",
    )
    p.add_argument(
        "--allow-untested-plans",
        action="store_true",
        help="accept tasks without a release report (from fedfleet plan test) covering every runtime they claim",
    )
    p.add_argument(
        "--release-trust",
        metavar="FILE",
        help="public keys of the testers whose signed release reports are accepted, one "
        "'ed25519 <base64 key> [label]' per line (fedfleet plan keygen prints it)",
    )
    limits = HttpLimits()
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=limits.header_timeout_s,
        help="seconds a client has to send a request's head (from connecting, or from the last answer)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=limits.body_timeout_s,
        help="seconds the server waits for a request body in all, plus one per KiB received, and at most for any "
        "one piece of it; and for a client to read some of an answer its socket cannot take",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; one more replaces the longest idle (default: under the file-descriptor limit)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=limits.max_header_bytes,
        help="the largest request head (request line and headers); a larger one is answered 431",
    )
    p.add_argument(
        "--keep-rounds",
        type=int,
        metavar="N",
        help="keep each task's newest N round records (each attempt is one) and remove older ones while serving "
        "(default: every record is kept)",
    )
    p.add_argument(
        "--keep-days",
        type=float,
        metavar="DAYS",
        help="remove round records that ended more than DAYS days ago while serving (default: every record is kept)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="how much the server logs",
    )
    commands = p.add_subparsers(
        dest="server_command",
        metavar="{backup,restore,retire}",
        title="other commands (without one, the server runs)",
    )
    backup = commands.add_parser(
        "backup",
        help="copy the server's SQLite file while it serves: one consistent snapshot, integrity-checked",
        description="Copy a server's SQLite database, online (SQLite's backup API: one consistent snapshot while "
        "the server goes on serving), into one self-contained file, checked with PRAGMA integrity_check and "
        "written whole or not at all.",
    )
    backup.add_argument("--db", required=True, help="the server's SQLite file (a server may run on it)")
    backup.add_argument("--out", required=True, help="the backup file to write (not the database itself)")
    backup.add_argument("--force", action="store_true", help="replace --out if it exists (no server may run on it)")
    restore = commands.add_parser(
        "restore",
        help="put a backup in place of a stopped server's SQLite file",
        description="Put a backup in place of a server's SQLite database: refused while a server holds the "
        "database (which it holds meanwhile, so that none starts on it); the replaced file's -wal and -shm are "
        "removed and the checked copy renamed into place.",
    )
    restore.add_argument("--backup", required=True, help="the backup file (fedfleet server backup --out)")
    restore.add_argument("--db", required=True, help="the server's SQLite file to replace; no server may run on it")
    retire = commands.add_parser(
        "retire",
        help="mark a refused task (stored by an older release) or a stopped one retired",
        description="Mark a task the server refuses to run (stored by an older release with settings or a plan this "
        "one refuses), or a task stopped with fedfleet stop, as retired: no server runs it, and a refusal is no "
        "longer said at each start. Its record, rounds, models and privacy ledger stay, and its name stays taken. "
        "Only with no server running on --db.",
    )
    retire.add_argument("--db", required=True, help="the server's SQLite file; no server may run on it")
    retire.add_argument("--population", required=True, help="the task's population")
    retire.add_argument("--task", required=True, help="the refused or stopped task (as fedfleet status lists it)")


def reload_keys_on_hangup(keys: AdminKeys, path: str) -> None:
    """Make SIGHUP read the admin key file again: keys added there are accepted and keys removed
    refused from then on, without a restart (sessions and open rounds go on). A file that cannot be
    used then (empty, unreadable, a bad key) is logged and the keys in use are kept."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return

    def reload(_signum: int, _frame: object) -> None:
        try:
            fresh = AdminKeys.from_file(path)
        except AdminKeyError as exc:
            log.error("SIGHUP: the admin keys in use are kept: %s", exc)
            return
        keys.replace_with(fresh)
        log.warning("SIGHUP: %d admin key(s) read again from %s; other keys are refused from now on", len(fresh), path)

    signal.signal(signal.SIGHUP, reload)


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _rounds_lines(service: FLService) -> list[str]:
    """Where each population's active tasks go on from (a restart, an upgrade or a restored backup
    shows here which round and model it continues with), one line per population."""
    lines = []
    for name in service.populations():
        status = service.population_status(name)
        tasks = [
            f"{t['name']} round {t['round']} ({t['committed_rounds']} committed, model {str(t['checkpoint_id'])[:12]})"
            for t in status["active_tasks"]
        ]
        lines.append(f"{name}: {', '.join(tasks) if tasks else 'no active task'}")
    return lines or ["no population yet"]


def _refused_lines(service: FLService) -> list[str]:
    """Each task on record the server refuses to run (stored by an older release with a config this
    one refuses), one line each: the task, the field, its stored value and what to do."""
    return [f"{task}: {reason}" for task, reason in service.refused_tasks()]


def _release_trust_line(args: argparse.Namespace, trusted: frozenset[bytes]) -> str:
    """Whose release reports the server accepts, said at start: a gated server that trusts no
    signer refuses every report, which the operator should learn now rather than at a deploy."""
    if trusted:
        return f"release reports signed by one of the {len(trusted)} key(s) of {args.release_trust}"
    if args.allow_untested_plans:
        return "none (a release report is checked for consistency only)"
    return "none: every release report is refused; name the testers' keys with --release-trust FILE"


def run_server(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Start the server from parsed arguments; prints where it listens, its database, whether
    attestation is on and where the admin keys come from. Returns an exit status.

    ``out`` defaults to the ``sys.stdout`` of the call, not of the import: a caller that swaps
    stdout (a test's capture, a redirect) after importing this module gets its own stream."""
    out = out or sys.stdout
    if getattr(args, "server_command", None) is not None:
        return run_server_command(args, out)
    if not args.attestation_trust:
        given = [
            f"--{dest.replace('_', '-')}"
            for dest, (default, _) in ATTESTATION_OPTIONS.items()
            if vars(args)[dest] != default
        ]
        if given:  # they limit attested check-ins only: without attestation they would be ignored
            print(
                f"fedfleet server: {' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to attested "
                f"check-ins only, with --attestation-trust FILE; give it, or leave {'it' if len(given) == 1 else 'them'} out",
                file=sys.stderr,
            )
            return 2
    if "://" in args.host or args.host.count(":") == 1:  # a URL or host:port, where an address goes
        address = args.host.split("://")[-1].split("/")[0].rsplit(":", 1)[0] or "127.0.0.1"
        print(
            f"fedfleet server: --host {args.host} is not an address to listen on; give the address alone "
            f"(--host {address}) and the port with --port",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_interrupts_once()
    for option, path in (
        ("--admin-key-file", args.admin_key_file),
        ("--attestation-trust", args.attestation_trust),
        ("--release-trust", args.release_trust),
    ):
        if path and (mistake := key_file_mistake(option, path)) is not None:
            print(f"fedfleet server: {mistake}", file=sys.stderr)
            return 2
    try:
        if args.admin_key_file:
            keys, source = AdminKeys.from_file(args.admin_key_file), f"from {args.admin_key_file}"
        elif (env := AdminKeys.from_env()) is not None:
            keys, source = env, f"from ${ADMIN_KEYS_ENV}"
        else:
            keys, generated = AdminKeys.generate()
            source = f"generated for this run: {generated}"
        verifier = None
        if args.attestation_trust:
            limits_given = (args.rate_burst, args.rate_per_hour, args.nonce_ttl)
            if not all(map(math.isfinite, limits_given)) or args.rate_burst < 1 or min(limits_given[1:]) <= 0:
                raise ValueError("--rate-burst must be a number >= 1, --rate-per-hour and --nonce-ttl positive numbers")
            anchor = read_trust_anchor(args.attestation_trust)
            verifier = AttestationVerifier(
                anchor, NonceRegistry(args.nonce_ttl), RateLimiter(args.rate_burst, args.rate_per_hour / 3600.0)
            )
        release_trust = read_release_trust(args.release_trust) if args.release_trust else frozenset()
        if (args.tls_key or args.tls_client_ca) and not args.tls_cert:
            named = " and ".join(
                o for o, v in (("--tls-key", args.tls_key), ("--tls-client-ca", args.tls_client_ca)) if v
            )
            verb = "applies" if " and " not in named else "apply"
            raise ValueError(f"{named} {verb} to serving HTTPS: give the server's certificate with --tls-cert FILE too")
        tls = server_tls_context(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        if os.path.isdir(args.db):
            raise ValueError(f"--db {args.db} is a folder; give the database file's path (made if missing)")
        limits = HttpLimits(args.header_timeout_s, args.body_timeout_s, args.max_connections, args.max_header_bytes)
        retention = Retention(args.keep_rounds, args.keep_days)
        store = ServerStore(args.db, hold=True)
    except (AdminKeyError, TrustAnchorError, ReleaseTrustError, StoreLayoutError, DatabaseInUse, ValueError) as exc:
        print(f"fedfleet server: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a URL whose driver is not installed
        print(
            f"fedfleet server: cannot open the database {args.db} ({exc}); install the driver its URL names into "
            "this Python, or give --db a SQLite file",
            file=sys.stderr,
        )
        return 2
    except ArgumentError as exc:  # a URL SQLAlchemy cannot read, said over lines with its valid forms
        said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()).replace(":;", ":")
        print(
            f"fedfleet server: --db {args.db} is not a database URL SQLAlchemy takes ({said}); give a SQLite "
            "file's path, or a URL such as sqlite:///fl.db",
            file=sys.stderr,
        )
        return 2
    except (SQLAlchemyError, OSError) as exc:
        print(f"fedfleet server: cannot open the database {args.db}: {store_advice(exc)}", file=sys.stderr)
        return 2
    try:
        service = FLService(
            store,
            verifier=verifier,
            require_release_reports=not args.allow_untested_plans,
            release_trust=release_trust,
            retention=retention,
        )
    except DamagedStore as exc:
        store.close()
        print(f"fedfleet server: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        store.close()
        print(f"fedfleet server: cannot read the database {args.db}: {store_advice(exc)}", file=sys.stderr)
        return 2
    server = GuardedServer(
        create_app(service, admin_keys=keys),
        limits,
        tls=tls,
        host=args.host,
        port=args.port,
        log_level="warning" if args.log_level == "info" else args.log_level,
        access_log=False,
    )
    if args.admin_key_file:
        reload_keys_on_hangup(keys, args.admin_key_file)
    try:  # say so now, not after printing where it listens
        args.port = server.listen()
    except OSError as exc:
        store.close()
        print(
            f"fedfleet server: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); pick another --port "
            "(0 picks a free one) or --host",
            file=sys.stderr,
        )
        return 2
    attestation = (
        f"on ({args.attestation_trust}, burst {args.rate_burst:g}, {args.rate_per_hour:g}/hour)" if verifier else "off"
    )
    if tls is None and not _loopback(args.host):
        print(
            f"fedfleet server: warning: listening on {args.host} in plain HTTP: admin keys, session tokens and "
            "updates cross the network readable; serve HTTPS (--tls-cert, --tls-key) or put a TLS proxy in front "
            "and bind --host 127.0.0.1 behind it",
            file=sys.stderr,
            flush=True,
        )
    if tls is not None and (warning := certificate_warning(args.tls_cert)) is not None:
        print(f"fedfleet server: warning: {warning}", file=sys.stderr, flush=True)
    base = listen_url(args.host, args.port, tls=tls is not None)
    print(f"fedfleet server listening on {base}", file=out)
    print(f"  database:    {args.db}", file=out)
    if tls is not None:
        clients = (
            f"only with a certificate from {args.tls_client_ca}"
            if args.tls_client_ca
            else "any (no client certificate)"
        )
        print(f"  tls:         {args.tls_cert}; clients: {clients}", file=out)
    print(f"  attestation: {attestation}", file=out)
    print(
        f"  deploys:     {'any plan (--allow-untested-plans)' if args.allow_untested_plans else 'only with a passed release report'}",
        file=out,
    )
    print(f"  signers:     {_release_trust_line(args, release_trust)}", file=out)
    print(f"  admin keys:  {source}", file=out)
    for line in _rounds_lines(service):
        print(f"  rounds:      {line}", file=out)
    for line in _refused_lines(service):
        print(f"  refused:     {line}", file=out)
    print(f"  keeps:       {retention.describe()}", file=out)
    cap = "" if args.max_connections is not None else " (under the file-descriptor limit)"
    print(
        f"  clients:     head within {limits.header_timeout_s:g} s, body within {limits.body_timeout_s:g} s (+1 s per KiB), "
        f"{limits.connections} connections{cap}, headers up to {limits.max_header_bytes} bytes",
        file=out,
    )
    print(f"  OpenAPI:     {base}/openapi.json", file=out, flush=True)
    try:
        server.run()
    finally:
        server.close_listener()
        store.close()
    return 0


def run_server_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``fedfleet server backup``, ``restore`` (``server_stub.backup``) and ``retire``. Returns an exit status."""
    out = out or sys.stdout
    command = f"fedfleet server {args.server_command}"
    given = _serving_options_given(args)
    if given:  # (before the command's name they parse as the server's, which this command does not run)
        print(
            f"{command}: {' and '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of running the "
            f"server, which {args.server_command} does not do; leave {'it' if len(given) == 1 else 'them'} out",
            file=sys.stderr,
        )
        return 2
    if args.server_command == "retire":
        return _retire(args, command, out)
    written = args.out if args.server_command == "backup" else args.db
    try:
        with sigterm_as_interrupt():
            return _backup_or_restore(args, command, out)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the copy under way is removed, nothing is put in place
        print(
            f"\n{command}: interrupted; its copy under way is removed ({written} is only ever replaced by a "
            "checked copy): run it again",
            file=sys.stderr,
        )
        return 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch scheduler's stop, ``kill``) while a command runs: it unwinds as Ctrl-C does,
    so what the command has open is closed and what it has half written removed."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises :class:`Terminated`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum: int, _frame: object) -> None:
        raise Terminated

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _backup_or_restore(args: argparse.Namespace, command: str, out: TextIO) -> int:
    try:
        if args.server_command == "backup":
            contents = backup.backup(args.db, args.out, force=args.force)
            said = f"backed up {args.db} to {args.out}: {contents.describe()}; integrity check ok"
        else:
            contents = backup.restore(args.backup, args.db)
            said = (
                f"restored {args.db} from {args.backup}: {contents.describe()}; integrity check ok; a server started "
                "on it goes on from each task's last committed round in the backup"
            )
            if contents.layout != SCHEMA_VERSION:  # what the upgrade at that start does to the file
                said += (
                    f", upgrading it first from {'a layout older than layouts are recorded' if contents.layout is None else f'layout {contents.layout}'} "
                    f"to layout {SCHEMA_VERSION}, which older servers refuse (the backup stays as it is, to go back)"
                )
    except backup.BackupError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    print(said, file=out)
    return 0


def _serving_options_given(args: argparse.Namespace) -> list[str]:
    """The options of running the server given with another of its commands, each as written."""
    serving = argparse.ArgumentParser(add_help=False)
    add_server_arguments(serving)
    defaults = vars(serving.parse_args([]))
    return [
        action.option_strings[0]
        for action in serving._actions
        if action.dest in defaults
        and action.dest not in ("db", "server_command")  # every other command has a --db of its own
        and vars(args).get(action.dest, defaults[action.dest]) != defaults[action.dest]
    ]


def _retire(args: argparse.Namespace, command: str, out: TextIO) -> int:
    """``fedfleet server retire``: ``task_runs.retire_refused`` on a stopped server's database."""
    try:
        backup.server_database(args.db)  # (a store would make its tables in a file of another kind)
        store = ServerStore(args.db, hold=True)
    except (backup.BackupError, DatabaseInUse, StoreLayoutError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except (SQLAlchemyError, OSError) as exc:
        print(f"{command}: cannot open the database {args.db}: {store_advice(exc)}", file=sys.stderr)
        return 2
    try:
        rounds = retire_refused(store, args.population, args.task)
    except NotRetired as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except (SQLAlchemyError, OSError) as exc:
        print(f"{command}: {store_advice(exc)}", file=sys.stderr)
        return 2
    finally:
        store.close()
    print(
        f"retired task {args.population}/{args.task}: no server runs it; its {rounds} round record(s), models and "
        "privacy figures stay on record, and its name stays taken",
        file=out,
    )
    return 0


def add_prune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, help="the server's SQLite file; no server may run on it")
    p.add_argument(
        "--older-than-days",
        type=_days,
        required=True,
        metavar="DAYS",
        help="drop the models of committed rounds that ended more than this many days ago "
        "(each task's latest model is kept)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be dropped, and drop nothing")


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = math.nan
    if not 0.0 <= days <= 100_000.0:
        raise argparse.ArgumentTypeError(f"give a number of days from 0 to 100000, not {text!r}")
    return days


def run_prune(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``fedfleet prune``: drop old rounds' models from a stopped server's database
    (``ServerStore.prune_models``). Returns an exit status."""
    out = out or sys.stdout
    if "://" not in args.db and not os.path.isfile(args.db):
        why = "is a folder; give the server's database file" if os.path.isdir(args.db) else "does not exist"
        print(f"fedfleet prune: {args.db} {why} (the --db the server ran with)", file=sys.stderr)
        return 2
    try:
        store = ServerStore(args.db, hold=True)
    except DatabaseInUse as exc:
        print(f"fedfleet prune: {exc}", file=sys.stderr)
        return 2
    except (StoreLayoutError, ImportError, SQLAlchemyError, OSError) as exc:
        reason = store_advice(exc) if isinstance(exc, (SQLAlchemyError, OSError)) else str(exc)
        print(f"fedfleet prune: cannot open the database {args.db}: {reason}", file=sys.stderr)
        return 2
    try:
        if not store.held:
            print(
                f"fedfleet prune: {args.db} is not a SQLite file this process can hold, so it cannot know that no "
                "server runs on it; prune only a server's SQLite file",
                file=sys.stderr,
            )
            return 2
        cutoff = time.time() - args.older_than_days * 86_400.0
        pruned = store.prune_models(cutoff, dry_run=args.dry_run)
    except (SQLAlchemyError, OSError) as exc:
        print(f"fedfleet prune: {store_advice(exc)}", file=sys.stderr)
        return 2
    finally:
        store.close()
    verb = "would drop" if args.dry_run else "dropped"
    print(
        f"{verb} the models of {pruned.rounds} round(s) that ended more than {args.older_than_days:g} day(s) ago "
        f"and {pruned.checkpoints} checkpoint(s), plan(s) and release report(s) nothing names any more, "
        f"{pruned.bytes} bytes",
        file=out,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m server_stub", description="Run the FL server.")
    add_server_arguments(parser)
    read_negative_numbers(show_defaults(parser))
    return run_server(parser.parse_args(argv))
