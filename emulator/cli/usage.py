"""``fedfleet``'s usage mistakes around its command groups, one line each that says what to do.

``server_stub.cli.CommandParser`` makes every usage error one line and names the closest option of
an argument no command took. A group of commands (``fedfleet`` itself, ``fedfleet plan``) adds
mistakes of its own, which argparse words by its internal names ("argument plan_command: invalid
choice: 'y'", "the following arguments are required: plan_command"): an option given before the
command it belongs to (``fedfleet plan --lable y``), a command left out or misspelled. And where a
required option is misspelled (``--lable`` for ``--label``), argparse says the option is missing,
not that the one typed is unknown. ``FleetParser`` words these instead."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from server_stub.cli import CommandParser, meant_options, parsers
from server_stub.errors import closest, did_you_mean

#: The options every parser has, which name no command.
HELP = ("-h", "--help")


class FleetParser(CommandParser):
    """``CommandParser``, with the group mistakes said as what to do (the module's docstring).
    Subcommands' parsers are of the same class (``add_subparsers`` makes them so)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)  # what the errors below read
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        given = getattr(self, "_given", None)
        commands = _commands(self)
        if given is not None and commands is not None:
            message = _group_mistake(self, commands, given) or message
        elif given is not None and message.startswith("the following arguments are required"):
            message = _unknown_options(self, given) or message
        super().error(message)


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    """The group of commands ``parser`` chooses from, if it is one: a command that runs without one
    of its commands (``fedfleet server``, beside ``server backup``) takes options of its own."""
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction) and a.required), None)


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o not in HELP]


def _group_mistake(parser: argparse.ArgumentParser, commands: argparse._SubParsersAction, given: list[str]) -> str:
    """What to do when a group's command is missing or unknown, or an option comes before it; ""
    when the command was one of the group's (the error is another's)."""
    first = next((i for i, token in enumerate(given) if not token.startswith("-")), len(given))
    word = given[first] if first < len(given) else None
    if word in commands.choices:
        return ""
    every = f"{parser.prog} {'|'.join(commands.choices)}"
    if first > 0:  # an option before any command
        typed = given[0].split("=")[0]
        takers: dict[str, list[str]] = {}  # each option close to the one typed, and the commands that take it
        for sub in parsers(parser)[1:]:
            if _commands(sub) is None:
                if (close := closest(typed, _options(sub))) is not None:
                    takers.setdefault(close, []).append(sub.prog.removeprefix(parser.prog).strip())
        if not takers:
            return f"{typed} is an option of neither {parser.prog} nor its commands ({every} --help lists theirs)"
        option, taken_by = max(takers.items(), key=lambda item: (item[0] == typed, len(item[1])))
        meant = "" if option == typed else f" (did you mean {option}?)"
        return f"{typed} comes after a command: {parser.prog} {'|'.join(taken_by)} ... {option}{meant}"
    if word is None:
        return f"name a command: {every} ..."
    return f"{word} is not a command{did_you_mean(word, commands.choices)}: {every} ..."


def _unknown_options(parser: argparse.ArgumentParser, given: list[str]) -> str:
    """An option ``parser`` does not take, named with its closest option: argparse would say that a
    required option the typo was meant as is missing. "" when every option is known."""
    known = _options(parser) + list(HELP)
    unknown = [
        token
        for token in given
        if token.startswith("-")
        and not parser._negative_number_matcher.match(token)
        and not any(option.startswith(token.split("=")[0]) for option in known)  # argparse takes a prefix
        and not (not token.startswith("--") and token[:2] in known)  # and -oDIR for -o DIR
    ]
    if not unknown:
        return ""
    return f"unrecognized arguments: {' '.join(unknown)}{meant_options(parser, unknown)}"
