"""The `fedfleet` command: every subcommand's parser and runner, in one place."""

from .commands import main

__all__ = ["main"]
