"""Typed API errors: each carries the HTTP status and a stable code that clients can branch on."""

from __future__ import annotations

import json
import os

# one did-you-mean for the project, at its bottom package (the example store's refusals say it too)
from example_store.spelling import closest as closest
from example_store.spelling import did_you_mean as did_you_mean

#: Messages echo parts of the request (names, ids); a hostile one must not come back whole.
MAX_MESSAGE_CHARS = 500
#: How much of a name from the request a message quotes: any valid name whole (1-128 characters).
QUOTED_NAME_CHARS = 128


def install_hint(extra: str) -> str:
    """How to install an optional extra: by name where fedfleet came from a wheel, and in a checkout
    into ``./dev``'s environment (a plain ``pip install 'fedfleet[X]'`` there fetches whatever an
    index calls fedfleet instead)."""
    return f"pip install 'fedfleet[{extra}]' (in a checkout: .venv/bin/pip install -e '.[{extra}]')"


def quoted(name: object) -> str:
    """``name`` as a message quotes it: its ``repr``, or for a longer one than any valid name (a
    path segment of thousands of characters) the ``repr`` of its first ``QUOTED_NAME_CHARS``
    characters and its length, so the message stays short and says all of what it says."""
    text = str(name)
    if len(text) <= QUOTED_NAME_CHARS:
        return repr(text)
    return f"{text[:QUOTED_NAME_CHARS]!r}... ({len(text):,} characters)"


def unreadable(exc: BaseException) -> str:
    """Why a file an operator named could not be read, said so they know what to change."""
    if isinstance(exc, IsADirectoryError):
        return "it is a folder; give the file's path"
    if isinstance(exc, FileNotFoundError):
        return f"no such file{did_you_mean_path(exc.filename) if exc.filename else ''}; check the path"
    if isinstance(exc, PermissionError):
        return "permission denied; make it readable by the user this runs as"
    if isinstance(exc, UnicodeDecodeError):
        return "it is not text (UTF-8); give the file that was written for this option"
    return str(exc)


#: The key files the project writes, by their JSON ``format`` or the first word of their line:
#: what each is, and what to give in its place to the options that take another kind.
KEY_FILES = {
    "fedfleet-release-signing-key": ("the private signing key of `fedfleet plan keygen`", "{path}.pub"),
    "ed25519": ("a release trust file (testers' public keys, `fedfleet plan keygen`'s KEY.pub)", "{path}"),
    "fedfleet-attestation-authority": (
        "the attestation authority's private key (`fedfleet authority --key`)",
        "the trust anchor `fedfleet authority --trust FILE` wrote with it",
    ),
    "fedfleet-attestation-trust": ("an attestation trust anchor (`fedfleet authority --trust`)", "{path}"),
}
#: The kinds of ``KEY_FILES`` each option takes, and what it takes said for a file of another kind.
KEY_OPTIONS = {
    "--release-trust": (
        "ed25519",
        "a release trust file",
        "the testers' trust lines (`fedfleet plan keygen --key KEY` writes KEY.pub)",
    ),
    "--attestation-trust": (
        "fedfleet-attestation-trust",
        "a trust anchor",
        "the trust anchor `fedfleet authority --trust FILE` wrote",
    ),
    "--admin-key-file": (None, "an admin key file", "a file of operator keys, one per line"),
}


def key_file_mistake(option: str, path: str | os.PathLike[str]) -> str | None:
    """What to give ``option`` (one of ``KEY_OPTIONS``) when ``path`` is another of the project's
    key files (``--release-trust tester.key``: "this is the private key; give tester.key.pub"),
    None when it is not one (the option's own reader then checks it)."""
    kind = _key_file_kind(path)
    takes, noun, wanted = KEY_OPTIONS[option]
    if kind is None or kind == takes:
        return None
    what, instead = KEY_FILES[kind]
    if (
        kind == "fedfleet-release-signing-key"
        and option == "--release-trust"
        or (kind == "fedfleet-attestation-authority" and option == "--attestation-trust")
    ):
        return f"{option} {os.fspath(path)} is {what}, which stays secret; give {instead.format(path=os.fspath(path))}"
    return f"{option} {os.fspath(path)} is {what}, not {noun}; give {wanted}"


def _key_file_kind(path: str | os.PathLike[str]) -> str | None:
    """Which of ``KEY_FILES`` the file at ``path`` is, None for another file or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 16).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        lines = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        return "ed25519" if lines and all(ln[0] == "ed25519" and len(ln) >= 2 for ln in lines) else None
    kind = data.get("format") if isinstance(data, dict) else None
    return kind if kind in KEY_FILES else None


def did_you_mean_path(path: str | os.PathLike[str]) -> str:
    """A message's ending that names the file or folder beside a missing ``path`` whose name is
    closest to its name and ends as it does, " (did you mean DIR/NAME?)" (``digits_taks.py``:
    ``digits_task.py``; not ``model.onnx``: ``model.pt``, a file of another kind); "" when none is."""
    missing = os.fspath(path)
    folder, name = os.path.split(missing)
    suffix = os.path.splitext(name)[1].lower()
    try:
        names = [n for n in os.listdir(folder or ".") if os.path.splitext(n)[1].lower() == suffix]
    except OSError:
        return ""
    meant = closest(name, names)
    return f" (did you mean {os.path.join(folder, meant)}?)" if meant else ""


class ApiError(Exception):
    """An error the API reports as JSON ``{"error": {"code", "message"}}`` with a 4xx status (a full server: 503)."""

    status: int = 400
    code: str = "BAD_REQUEST"
    #: Seconds a client should wait before trying again, sent as ``Retry-After`` (None: no header).
    retry_after_s: float | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


class BadRequest(ApiError):
    status, code = 400, "BAD_REQUEST"


class MalformedBody(ApiError):
    status, code = 400, "MALFORMED_BODY"


class Unauthorized(ApiError):
    status, code = 401, "UNAUTHORIZED"


class NotFound(ApiError):
    status, code = 404, "NOT_FOUND"


class Conflict(ApiError):
    status, code = 409, "CONFLICT"


class ReportLate(ApiError):
    status, code = 409, "REPORT_LATE"


class DuplicateReport(ApiError):
    status, code = 409, "DUPLICATE_REPORT"


class SessionClosed(ApiError):
    status, code = 409, "SESSION_CLOSED"


class UploadSuperseded(ApiError):
    """A newer upload of the same session began while this one's body was arriving: it was dropped."""

    status, code = 409, "UPLOAD_SUPERSEDED"


class PollSuperseded(ApiError):
    """A newer long poll of the same session's Secure Aggregation state began while this one waited."""

    status, code = 409, "POLL_SUPERSEDED"


class BodyTooLarge(ApiError):
    status, code = 413, "BODY_TOO_LARGE"


class TooManyRequests(ApiError):
    status, code = 429, "RATE_LIMITED"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: float = 60.0) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class InvalidUpdate(ApiError):
    status, code = 422, "INVALID_UPDATE"


class InvalidPlan(ApiError):
    status, code = 422, "INVALID_PLAN"


class InvalidCheckpoint(ApiError):
    status, code = 422, "INVALID_CHECKPOINT"


class BodyTimeout(ApiError):
    """The client stopped sending its request body (``http_guards.SlowBodyGuard``)."""

    status, code = 408, "BODY_TIMEOUT"


class ClientDisconnected(ApiError):
    """The client closed its connection before its request body was in: nobody reads the answer."""

    status, code = 400, "CLIENT_DISCONNECTED"


# Answers of the HTTP server itself (``http_guards``), written before any route sees the request.
class MalformedRequest(ApiError):
    status, code = 400, "MALFORMED_REQUEST"


class HeaderTimeout(ApiError):
    status, code = 408, "HEADER_TIMEOUT"


class HeadersTooLarge(ApiError):
    status, code = 431, "HEADERS_TOO_LARGE"


class VersionNotSupported(ApiError):
    """A request line of another major HTTP version than 1 ('HTTP/9.9', 'HTTP/2.0'): RFC 9110's
    answer to a version the server does not speak, which h11 reads as any other."""

    status, code = 505, "HTTP_VERSION_NOT_SUPPORTED"


class ClientCertificateRequired(ApiError):
    """A TLS connection without a client certificate to a server that admits only clients with one
    (``fedfleet server --tls-client-ca``)."""

    status, code = 401, "CLIENT_CERTIFICATE_REQUIRED"


class ServerBusy(ApiError):
    """Every connection the server allows is busy with a request; clients retry 5xx later."""

    status, code = 503, "SERVER_BUSY"


class DatabaseGone(ApiError):
    """The database file was deleted or replaced while the server runs: its writes are lost at
    its stop (the health check says so, for a monitor or a load balancer)."""

    status, code = 503, "DATABASE_GONE"


class DatabaseUnavailable(ApiError):
    """The database refused a write or a read the request needs (a full disk, a lock held past the
    busy timeout, a read-only or failing file): nothing of the request was kept; try again later
    (``Retry-After``; the server tries its own queued writes again with a backoff of up to a minute)."""

    status, code = 503, "DATABASE_UNAVAILABLE"
    retry_after_s = 30.0
