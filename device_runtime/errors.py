"""Exceptions the SDK raises to an app, each saying what happened and what to do."""

from __future__ import annotations

import math
import numbers
import os


class RuntimeSdkError(Exception):
    """Base class of the device runtime's errors; each message says what happened and what to do.

    ``retryable`` tells an app what to do next without reading the message: True when the same
    call, made again later with nothing changed on the device, may succeed (the server was
    unreachable or busy, did not select the device, another session of the population was
    running): try again after ``FLRuntime.next_retry_delay()``, as a scheduled job does. False
    when it fails the same way until the app, its data or the device changes (a wrong setting, no
    examples for the plan, a plan past this device's budget, a full disk): retrying sooner only
    spends the battery, so log the message and fix what it names."""

    #: Whether trying the same call again later, with nothing changed, may succeed (see the class).
    retryable: bool = False


class InvalidSetting(RuntimeSdkError, ValueError):
    """An argument the app gave the runtime that it cannot work with; the message says what is allowed."""


def check_number(
    name: str, value: object, *, positive: bool = False, signed: bool = False, unit: str = "seconds"
) -> float:
    """``value`` as a float if it is a finite number (not a bool) from 0 up, above 0 with
    ``positive``, of either sign with ``signed`` (a time); else ``InvalidSetting`` naming the
    setting: a negative poll or a timeout of "10" was taken and failed far from where it was given
    (a watchdog spinning on a core)."""
    number = math.nan
    # a float or an int spares the look-up of numbers.Real (a device's build checks a dozen)
    if type(value) is float or type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Real)):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range (math.isfinite raised it)
            pass
    if not math.isfinite(number) or (number < 0 and not signed) or (positive and number <= 0):
        bound = "" if signed else " above 0" if positive else " from 0 up"
        raise InvalidSetting(f"{name} is a finite number of {unit}{bound}, not {value!r:.100}")
    return number


def check_count(name: str, value: object, *, least: int = 0) -> int:
    """``value`` if it is an int (not a bool) of at least ``least``; else ``InvalidSetting``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise InvalidSetting(f"{name} is a whole number from {least} up, not {value!r:.100}")
    return int(value)


def check_path(name: str, value: object, *, of: str = "file") -> str | os.PathLike:
    """``value`` if it is a path (a str or an os.PathLike) of a ``of``; else ``InvalidSetting``."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidSetting(
            f"{name} is a {of}'s path (a str or a pathlib.Path), not {type(value).__name__} {value!r:.100}"
        )
    return value


class ServerUnreachable(RuntimeSdkError):
    """The FL server could not be reached after all retries; try again later. A TLS handshake
    that fails for a reason no retry changes (a server certificate the device does not trust, an
    ``https://`` URL of a plain HTTP server) raises it at the first attempt, saying which; that one
    is not ``retryable`` (the device's trust store or the URL must change), the others are."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class SessionRejected(RuntimeSdkError):
    """The server did not select this device (``reason``, the server's code: ``NO_TASK``, a round
    full, pace steering, ``INELIGIBLE:<policy>``); come back within ``retry_after_s`` = (min, max)
    seconds, as ``FLRuntime.next_retry_delay()`` draws. Always ``retryable``."""

    retryable = True

    def __init__(self, reason: str, retry_after_s: tuple[float, float]) -> None:
        super().__init__(f"check-in rejected ({reason}); retry in {retry_after_s[0]:.0f}-{retry_after_s[1]:.0f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class SessionInProgress(RuntimeSdkError):
    """This ``FLRuntime`` is running a session (a call from another thread or one of its hooks), or
    another of the same population is, over the same example store in this process: the device
    takes part once at a time, and this call sent nothing. ``retryable``: skip this call and
    try again once that session has ended."""

    retryable = True


#: The server's 4xx codes that end a request or its session while a later session may succeed:
#: the round closed under the session (an operator's stop, its deadline: ``REPORT_LATE``), the
#: session is over (``SESSION_CLOSED``, ``DUPLICATE_REPORT``: its report was taken), its Secure
#: Aggregation group went on without it, a newer request of the same session took its place, or
#: the server no longer knows the session (``BAD_SESSION_TOKEN``: it restarted). None is the
#: device's mistake: the next check-in starts afresh.
RETRY_LATER_CODES = frozenset(
    {
        "REPORT_LATE",
        "SESSION_CLOSED",
        "DUPLICATE_REPORT",
        "SECAGG_ROUND_CLOSED",
        "SECAGG_ALREADY_ANSWERED",
        "UPLOAD_SUPERSEDED",
        "POLL_SUPERSEDED",
        "BAD_SESSION_TOKEN",
    }
)


class ProtocolError(RuntimeSdkError):
    """The server answered with an error or with something this runtime does not understand.

    ``status`` and ``code`` are the server's HTTP status and error code when it answered with an
    error. ``retryable`` unless the server refused the request as the device made it (a 4xx
    answer: an attestation it requires, a runtime it no longer serves, a malformed update), which
    no retry changes; but 408, 429 and the codes of ``RETRY_LATER_CODES`` (a round that closed
    mid-session, a session the server no longer knows) are retryable: a later session may
    succeed. An answer cut off, too large, too slow or malformed may be a network's or a server's
    passing fault."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retryable = status is None or not 400 <= status < 500 or status in (408, 429) or code in RETRY_LATER_CODES


class CorruptResource(RuntimeSdkError):
    """A downloaded plan or checkpoint does not match its id or cannot be parsed; it was not used,
    nor kept. ``retryable``: the next session downloads it again."""

    retryable = True


class NoExamples(RuntimeSdkError):
    """The plan's example selector matched no examples in this app's stores (or names a
    collection no store is registered for); the message names the collection. Not ``retryable``
    until the app adds examples to that collection."""


class CacheUnavailable(RuntimeSdkError, OSError):
    """A runtime given no ``cache_dir`` could not make its plan cache folder in the temp folder (a
    full disk, an unwritable or missing ``TMPDIR``); the message says what to do."""


class OverBudget(RuntimeSdkError):
    """A plan declares, or reaches while running, more memory or time than this device gives; or
    a plan larger than an eighth of its ``DeviceClass.memory_mb``, or a checkpoint larger than half,
    came to download (refused as it arrives, unread when its size is declared)."""
