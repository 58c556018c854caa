"""Exceptions the SDK raises to an app, each saying what happened and what to do."""

from __future__ import annotations


class RuntimeSdkError(Exception):
    """Base class of the device runtime's errors."""


class InvalidSetting(RuntimeSdkError, ValueError):
    """An argument the app gave the runtime that it cannot work with; the message says what is allowed."""


class ServerUnreachable(RuntimeSdkError):
    """The FL server could not be reached after all retries; try again later."""


class SessionRejected(RuntimeSdkError):
    """The server did not select this device; come back within ``retry_after_s`` = (min, max) seconds."""

    def __init__(self, reason: str, retry_after_s: tuple[float, float]) -> None:
        super().__init__(f"check-in rejected ({reason}); retry in {retry_after_s[0]:.0f}-{retry_after_s[1]:.0f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class ProtocolError(RuntimeSdkError):
    """The server answered with an error or with something this runtime does not understand."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class CorruptResource(RuntimeSdkError):
    """A downloaded plan or checkpoint does not match its id or cannot be parsed; it was not used."""


class NoExamples(RuntimeSdkError):
    """The plan's example selector matched no examples in this app's stores."""


class OverBudget(RuntimeSdkError):
    """A plan declares, or reaches while running, more memory or time than this device gives."""
