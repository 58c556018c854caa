"""The ``fedfleet`` command's entry point (pyproject.toml's ``[project.scripts]``): a Ctrl-C is one
line and exit 130 from the first moment to the last, not only while a command runs.

The command's modules take a second or two to import (numpy, onnxruntime, SQLAlchemy, FastAPI, all
below ``emulator/__init__.py``), and a Ctrl-C there printed a KeyboardInterrupt traceback, or an
ImportError's where it landed in a compiled module's initialisation; this module imports none of
them at its top, so that the one line is in place before they start. Once the command has ended, a
Ctrl-C while the interpreter exits (joining threads, running exit callbacks) is the same line, the
callbacks' cleanup goes on and the process then ends with 130 (a second Ctrl-C ends it at once); in
the teardown after the last exit callback, which only frees memory, it is ignored and the command's
own status stands, where the interpreter had put back the signal's default and the process died of
it without a word. Only the interpreter's own start (some tens of milliseconds, before this module
runs) is left to Python."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

#: The exit status of a command stopped by Ctrl-C, as a shell gives one (128 + SIGINT).
INTERRUPTED = 130


def interrupted_line(argv: list[str]) -> str:
    """``fedfleet plan: interrupted``: the command named as typed (its first word), as every
    command's own Ctrl-C line does."""
    named = argv[0] if argv and not argv[0].startswith("-") else ""
    return f"fedfleet {named}".rstrip() + ": interrupted"


def _say(line: str) -> None:
    """``line`` on stderr after what stdout holds (a pipe's buffer included), on a line of its own
    after the ``^C`` the terminal echoed."""
    with contextlib.suppress(Exception):  # a stream closed or mid-write: the exit status still says it
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(f"\n{line}", file=sys.stderr, flush=True)


def _quit_interrupted(line: str | None) -> Callable[[int, FrameType | None], None]:
    """A SIGINT handler that says ``line`` (unless None) and ends the process at once with 130."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if line is not None:
            _say(line)
        os._exit(INTERRUPTED)

    return handler


#: The Ctrl-Cs that came while the interpreter exits (see ``_while_exiting``).
_PRESSED_WHILE_EXITING: list[int] = []


def _while_exiting(line: str | None) -> Callable[[int, FrameType | None], None]:
    """The SIGINT handler once the command has ended: a first Ctrl-C says ``line`` (unless None) and
    lets the exit callbacks finish their cleanup (a Ray cluster's, a process pool's), after which
    the process ends with 130; a second ends it at once, a hung thread or callback or not."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if _PRESSED_WHILE_EXITING:
            os._exit(INTERRUPTED)
        _PRESSED_WHILE_EXITING.append(signum)
        if line is not None:
            _say(line)

    return handler


def _last_exit_callback() -> None:
    """Registered first, so run last: past it the interpreter tears its modules down with the
    signal's default action, which would kill the process without a line, so a Ctrl-C is ignored
    from here; and after one that came during the exit, the process ends with 130 without that
    teardown, which only frees memory (a second or more once torch is loaded)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _PRESSED_WHILE_EXITING:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(INTERRUPTED)


def _import_command(line: str) -> Callable[[], int]:
    """``emulator.cli.commands.main``, imported under a SIGINT handler that notes the Ctrl-C it
    raises: one in the middle of a compiled module's initialisation comes out as that module's
    ImportError ("initialization failed"), or is swallowed by an import that falls back to another.
    Either way the process then says the line and ends at once, without the interpreter's teardown,
    which a half-initialised extension module can crash."""
    pressed = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        pressed.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        from emulator.cli.commands import main as run
    except BaseException:
        if not pressed:
            raise
    else:
        if not pressed:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # asyncio.run, for one, looks for it
            return run
    signal.signal(signal.SIGINT, _quit_interrupted(None))  # a second Ctrl-C while saying it: no traceback
    _say(line)
    os._exit(INTERRUPTED)


def main() -> int:
    argv = sys.argv[1:]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background: it stays ignored
        from emulator.cli.commands import main as run

        return run()
    atexit.register(_last_exit_callback)
    exiting: str | None = f"{interrupted_line(argv)} as it exited; the command had finished"
    try:
        status = _import_command(interrupted_line(argv))()
        if status == INTERRUPTED:  # the command said it was interrupted
            exiting = None
        return status
    except KeyboardInterrupt:  # while the arguments are read
        signal.signal(signal.SIGINT, _quit_interrupted(None))
        _say(interrupted_line(argv))
        exiting = None
        return INTERRUPTED
    finally:  # from here on the interpreter exits
        signal.signal(signal.SIGINT, _while_exiting(exiting))


if __name__ == "__main__":
    sys.exit(main())
