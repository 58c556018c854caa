"""The HTTP shell: FastAPI routes that authenticate, bound and parse requests, then call FLService.

Every call into the service runs in the thread pool, so the event loop only moves bytes: a slow
commit, a locked database or a large deploy never stalls the health check, check-ins or reports.
Request bodies are read with a size limit before they are parsed, and parsed by the schemas in
``schemas.py`` (in the thread pool for deploys, whose bodies can be large). A report's body goes to a
spool file as it arrives (``reports.BodySpool``), and the report waits for its turn to be checked
in the event loop, not in a worker thread."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import inspect
import json
import logging
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import from_json
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from device_runtime.attestation import AttestationError
from device_runtime.opstats import SHAPE_ALPHABET
from device_runtime.protocol import MAX_RESOURCE_BYTES, STATS_HEADER, TOKEN_HEADER
from device_runtime.wire import (
    AbortAnswer,
    AttestationChallenge,
    CheckinAccepted,
    CheckinAnswer,
    CheckinRejected,
    DeployedGroup,
    DeployedTask,
    EligibilityInfo,
    Health,
    PopulationCreated,
    PopulationList,
    PopulationStatus,
    ReportAnswer,
    RoundList,
    SecAggAccepted,
    SecAggState,
    TaskStopped,
)

from . import reports
from .admin_auth import MAX_KEY_CHARS, AdminKeys
from .direct_routes import add_direct_routes
from .errors import (
    ApiError,
    BodyTooLarge,
    ClientDisconnected,
    DatabaseGone,
    DatabaseUnavailable,
    MalformedBody,
    PollSuperseded,
    ServerBusy,
    Unauthorized,
    UploadSuperseded,
)
from .persistence import ServerStore, store_advice
from .release_gate import RELEASE_CODES
from .reports import BodySpool
from .schemas import (
    MAX_ROUND_ID,
    MAX_ROUNDS_PAGE,
    NAME_RULE,
    REQUEST_SCHEMAS,
    ROUNDS_PAGE,
    Abort,
    Checkin,
    CreatePopulation,
    GroupDeploy,
    TaskDeploy,
)
from .service import FLService, TaskSpec

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 * 1024
#: A deploy's JSON carries its initial checkpoint in base64 (4/3 of its bytes) beside its plans: the
#: bound takes a checkpoint as large as a device downloads (``MAX_RESOURCE_BYTES``, 1 GiB), with 512
#: MiB for the plans and the rest. At 512 MiB in all, a checkpoint over about 380 MB was refused
#: (BERT-base's 440 MB, GPT-2's 500 MB), though devices of 1 GB take it.
MAX_DEPLOY_BYTES = 4 * MAX_RESOURCE_BYTES // 3 + (512 << 20)
#: What a deploy refused for its size is told to change.
DEPLOY_SIZE_ADVICE = (
    "a deploy carries its plans and its initial checkpoint in base64, and the checkpoint is at most "
    f"{MAX_RESOURCE_BYTES:,} bytes, the most a device downloads: train fewer weights or a smaller model"
)
MAX_SECAGG_WAIT_S = 10.0
MAX_STATS_HEADER = 2048
MAX_SHAPE = 16
TICK_INTERVAL_S = 0.05
CACHE_FOREVER = "private, max-age=31536000, immutable"
API_VERSION = "1"

Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")


async def read_body(request: Request, limit: int, advice: str = "") -> bytearray:
    """Read at most ``limit`` bytes; a larger body is refused before it is all in memory, its
    message ending with ``advice`` (what to change) where given. The pieces go into one buffer as
    they arrive (``BodySpool``): joined at the end, they held the body twice at that moment, 3.6 GB
    for a deploy at its bound."""
    _check_declared_size(request, limit, advice)
    spool = BodySpool(in_memory_bytes=limit)
    await _receive(request, limit, advice, spool)
    return spool.in_memory()


async def spool_body(request: Request, limit: int) -> BodySpool:
    """Read at most ``limit`` bytes into a ``BodySpool``: in memory up to its own bound, then in a
    file. The caller closes it."""
    _check_declared_size(request, limit, "")
    spool = BodySpool()
    try:
        await _receive(request, limit, "", spool)
    except BaseException:
        spool.close()
        raise
    return spool


def _check_declared_size(request: Request, limit: int, advice: str) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise MalformedBody("Content-Length is not a number") from None
    if size > limit:
        more = f"; {advice}" if advice else ""
        raise BodyTooLarge(f"the body is {declared} bytes; the limit here is {limit}{more}")


async def _receive(request: Request, limit: int, advice: str, spool: BodySpool) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            more = f"; {advice}" if advice else ""
            raise BodyTooLarge(f"the body is larger than the limit of {limit} bytes{more}")
        try:
            spool.write(chunk)
        except OSError as exc:  # the spool's folder is full or failing: the server cannot keep it
            log.error("a request body could not be spooled to disk: %s", exc)
            raise ServerBusy("the server has no room for the body now; nothing was kept: try again later") from None


class _Newest:
    """Per session, the one request of a kind that may wait on its client or on the round (an
    upload whose body is arriving, a long poll): a newer one of the same session drops the one
    before it. Held once the session's token is checked: a stranger cannot drop a session's request."""

    def __init__(self) -> None:
        self._held: dict[str, asyncio.Event] = {}

    @contextlib.contextmanager
    def hold(self, sid: str) -> Iterator[asyncio.Event]:
        """The event set when a newer request of the session takes this one's place."""
        previous = self._held.get(sid)
        if previous is not None:
            previous.set()
        dropped = self._held[sid] = asyncio.Event()
        try:
            yield dropped
        finally:
            if self._held.get(sid) is dropped:
                del self._held[sid]


class _Uploads:
    """The upload of each session whose body is arriving (a report or a Secure Aggregation message):
    one at a time, the newest. A device sends its uploads one after another, and sends one again
    only when it gave up on the first (its connection lost); every connection of one session's
    token was otherwise read in full and held, so that one selected device opening a thousand
    uploads held a thousand report bodies (800 of 68 KB: 70 MB) and, stalling them, every
    connection the server allows, each for 30 s plus a second per KiB it had sent."""

    def __init__(self) -> None:
        self._newest = _Newest()

    async def read(self, sid: str, request: Request, limit: int) -> bytearray:
        """The body of the session's upload (``read_body``), or ``UploadSuperseded`` when a newer
        upload of the session begins before it is all in. Called once the token is checked."""
        return await self._newest_only(sid, read_body(request, limit))

    async def spool(self, sid: str, request: Request, limit: int) -> BodySpool:
        """``read``, into a ``BodySpool`` (``spool_body``) that the caller closes."""
        return await self._newest_only(sid, spool_body(request, limit))

    async def _newest_only(self, sid: str, reading: Coroutine[Any, Any, T]) -> T:
        """``reading``'s result, or ``UploadSuperseded`` (``reading`` cancelled: what it read is let go)."""
        with self._newest.hold(sid) as dropped:
            work = asyncio.ensure_future(reading)
            if not await _first(work, dropped):
                raise UploadSuperseded("a newer upload of this session began; this one was dropped")
            return work.result()


async def _first(work: asyncio.Future, dropped: asyncio.Event, timeout: float | None = None) -> bool:
    """Wait for ``work`` until ``dropped`` is set or ``timeout`` passes: False when dropped (``work``
    then cancelled), True otherwise (``work`` cancelled too if it is not done by the timeout)."""
    waiting = asyncio.ensure_future(dropped.wait())
    try:
        await asyncio.wait((work, waiting), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))  # its end, without raising what it raised
    return not (work.cancelled() and dropped.is_set())


def parse(model: type[Model], raw: bytes | bytearray) -> Model:
    """Validate a JSON body against its schema; every refusal is a 400 with a stable code."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _bad_input(
            exc.errors(include_url=False, include_input=False), deploy=model in (TaskDeploy, GroupDeploy)
        ) from None


def _bad_input(errors: list[Any], *, deploy: bool = False) -> ApiError:
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return MalformedBody(f"the body is not valid JSON: {first.get('msg')}")
    if kind == "missing":
        return MalformedBody(f"field {where!r} is required", code="MISSING_FIELD")
    loc = first.get("loc", ())
    if kind == "string_pattern_mismatch" and loc and loc[-1] in ("plan", "checkpoint"):
        return MalformedBody(f"field {where!r} is not valid base64", code="BAD_FIELD")
    if kind == "string_pattern_mismatch" and tuple(loc) == ("runtime_version",):
        return MalformedBody("runtime_version is not a version like '1.31.1'", code="BAD_RUNTIME_VERSION")
    if kind == "string_pattern_mismatch" and loc and loc[-1] in ("name", "evaluates"):
        return MalformedBody(f"{where}: {NAME_RULE}", code="BAD_NAME")
    if deploy and any(part in ("config", "eligibility") for part in loc):
        return MalformedBody(f"the task config is not valid: {message}", code="BAD_CONFIG")
    return MalformedBody(message, code="BAD_FIELD")


def b64(value: str | None, name: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedBody(f"field {name!r} is not valid base64", code="BAD_FIELD") from None


def bearer(request: Request) -> str | None:
    """The request's bearer token: ``TOKEN_HEADER`` where the client sent one (its URL's
    credentials took ``Authorization``, which a gateway may pass on as it came or rewrite into a
    bearer token of its own), else ``Authorization: Bearer``."""
    token = request.headers.get(TOKEN_HEADER, "")
    if not token:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = ""
    token = token.strip()
    if not token or len(token) > MAX_KEY_CHARS:
        return None
    return token


def session_token(request: Request) -> str:
    token = bearer(request)
    if token is None:
        raise Unauthorized(
            "send the session token as 'Authorization: Bearer <token>' (or X-FL-Token behind a gateway that takes Authorization)",
            code="MISSING_TOKEN",
        )
    return token


def session_shape(stats: object) -> str | None:
    """The shape from a device's session statistics, if it is a plausible one; else None.

    Statistics are advisory: malformed ones are ignored rather than failing a good report."""
    if not isinstance(stats, dict):
        return None
    shape = stats.get("shape")
    if isinstance(shape, str) and 0 < len(shape) <= MAX_SHAPE and set(shape) <= SHAPE_ALPHABET:
        return shape
    return None


def advisory_stats(stats: object) -> dict | None:
    """Only the statistics the server uses, each checked: a plausible shape and a training time."""
    if not isinstance(stats, dict):
        return None
    out: dict[str, Any] = {}
    shape = session_shape(stats)
    if shape is not None:
        out["shape"] = shape
    training = stats.get("training_s")
    if isinstance(training, (int, float)) and not isinstance(training, bool):
        out["training_s"] = training
    return out


def _stats_header(request: Request) -> dict | None:
    raw = request.headers.get(STATS_HEADER.lower())
    if raw is None or len(raw) > MAX_STATS_HEADER:
        return None
    try:
        return advisory_stats(from_json(raw, allow_inf_nan=False))
    except ValueError:
        return None


def _etag_matches(header: str | None, rid: str) -> bool:
    """RFC 9110 If-None-Match: ``*``, or a list of (possibly weak) entity tags, one of them ours."""
    if not header:
        return False
    tags = [t.strip() for t in header.split(",")]
    return "*" in tags or any(t.removeprefix("W/") == f'"{rid}"' for t in tags)


class _Broadcast:
    """Wakes every waiter at once; waiters take ``event()`` before checking their condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def event(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()


def _json_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a JSON body the handler reads itself (to bound its size before parsing)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


def _binary_body() -> dict:
    return {"requestBody": {"required": True, "content": _BINARY}}


def _answers(model: Any) -> dict[str, Any]:
    """A route's declared JSON answer: ``response_model`` types it in the OpenAPI document, and
    FastAPI checks what the route returns against it. The device routes' answers are built as
    these models by the service (a direct route sends the model as it is); the operators' dicts
    are checked by FastAPI on every answer, and ``tests/server_stub/test_wire_answers.py`` checks
    both. Unset fields stay out of the answer, as the service leaves them out."""
    return {"response_model": model, "response_model_exclude_unset": True}


def _binary_answer(description: str, *codes: str, more: dict[int | str, Any] | None = None) -> dict[str, Any]:
    """A route whose answer is bytes (a plan, a checkpoint, a model), not JSON, and its error ``codes``."""
    return {
        "response_class": Response,
        **_route(*codes, more={200: {"description": description, "content": _BINARY}, **(more or {})}),
    }


def _attestation_codes() -> dict[str, int]:
    """Every code an attestation refusal carries (the errors below ``AttestationError``), with its status."""
    found: dict[str, int] = {}
    todo = list(AttestationError.__subclasses__())
    while todo:
        error = todo.pop()
        found[error.code] = error.http_status
        todo.extend(error.__subclasses__())
    return dict(sorted(found.items()))


_ATTESTATION = _attestation_codes()
#: What each error status means, for the routes' documented answers.
_STATUS_TEXT = {
    400: "malformed request",
    401: "missing or wrong credential",
    404: "unknown population, task or resource",
    408: "the request body stopped arriving",
    409: "conflict with the current state",
    413: "body too large",
    422: "a plan, checkpoint or update that does not fit",
    429: "rate limited",
    500: "an internal error (logged by the server)",
    503: "the server cannot keep what it is sent",
}
#: The status of every stable error code a route sends. The attestation codes come from their
#: errors (``device_runtime.attestation``), the deploy gate's from ``release_gate.RELEASE_CODES``.
_STATUS_OF: dict[str, int] = {
    **dict.fromkeys(
        (
            "MALFORMED_BODY",
            "MISSING_FIELD",
            "BAD_FIELD",
            "BAD_NAME",
            "BAD_CONFIG",
            "BAD_QUERY",
            "BAD_RUNTIME_VERSION",
            "SECAGG_REJECTED",
            "CLIENT_DISCONNECTED",
        ),
        400,
    ),
    **dict.fromkeys(("ADMIN_KEY_REQUIRED", "BAD_ADMIN_KEY", "MISSING_TOKEN", "BAD_SESSION_TOKEN"), 401),
    "ATTESTATION_REQUIRED": 401,
    **_ATTESTATION,
    **dict.fromkeys(
        ("UNKNOWN_POPULATION", "UNKNOWN_TASK", "UNKNOWN_ROUND", "NO_TASK", "UNKNOWN_RESOURCE", "ATTESTATION_DISABLED"),
        404,
    ),
    "BODY_TIMEOUT": 408,
    **dict.fromkeys(
        (
            "TASK_EXISTS",
            "TASK_STOPPED",
            "TASK_NOT_RUNNING",
            "REPORT_LATE",
            "DUPLICATE_REPORT",
            "SESSION_CLOSED",
            "SECURE_AGGREGATION_REQUIRED",
            "NOT_IN_GROUP",
            "SECAGG_ROUND_CLOSED",
            "SECAGG_ALREADY_ANSWERED",
            "UPLOAD_SUPERSEDED",
            "POLL_SUPERSEDED",
        ),
        409,
    ),
    "BODY_TOO_LARGE": 413,
    **dict.fromkeys(
        ("INVALID_PLAN", "INVALID_CHECKPOINT", "INVALID_UPDATE", "MALFORMED_UPDATE", "INVALID_METRICS", *RELEASE_CODES),
        422,
    ),
    "INTERNAL": 500,
    "DATABASE_GONE": 503,
    "DATABASE_UNAVAILABLE": 503,
    "SERVER_BUSY": 503,
}
#: A body the route reads (``read_body``): a bad Content-Length, a client gone or too slow, too large.
_BODY = ("MALFORMED_BODY", "CLIENT_DISCONNECTED", "BODY_TIMEOUT", "BODY_TOO_LARGE")
#: A JSON body parsed by its schema (``parse``).
_JSON = (*_BODY, "MISSING_FIELD", "BAD_FIELD")
_ADMIN = ("ADMIN_KEY_REQUIRED", "BAD_ADMIN_KEY")
_SESSION = ("MISSING_TOKEN", "BAD_SESSION_TOKEN")
#: What a deploy's service checks refuse (``deploy.new_tasks``, the DP configs).
_DEPLOY = (
    *_ADMIN,
    *_JSON,
    "BAD_NAME",
    "BAD_CONFIG",
    "UNKNOWN_POPULATION",
    "TASK_EXISTS",
    "INVALID_PLAN",
    "INVALID_CHECKPOINT",
    *RELEASE_CODES,
)


def _errors(*codes: str, database: bool = True) -> dict[int | str, dict[str, Any]]:
    """A route's error answers: one per status its ``codes`` have (listed in the description and
    as ``x-error-codes``), the 500 every route may send and, for a route that reads or writes the
    database (``database``), its 503 ``DATABASE_UNAVAILABLE``. The answers the HTTP server gives
    before a request reaches any route are in the app's description instead."""
    by_status: dict[int, list[str]] = {}
    for code in (*codes, *(("DATABASE_UNAVAILABLE",) if database else ()), "INTERNAL"):
        by_status.setdefault(_STATUS_OF[code], []).append(code)
    return {
        status: {
            "description": f"{_STATUS_TEXT[status]}: {', '.join(by_status[status])}",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
            "x-error-codes": by_status[status],
        }
        for status in sorted(by_status)
    }


def _route(*codes: str, more: dict[int | str, Any] | None = None, database: bool = True) -> dict[str, Any]:
    """The ``responses`` of a route that sends ``codes`` (and ``more``, its other answers)."""
    return {"responses": {**(more or {}), **_errors(*codes, database=database)}}


_REDEPLOYED = "the same deploy, stored before as it is (sent again after its answer was lost): the tasks it made"
_DESCRIPTION = (
    "Populations, tasks, check-in, resources, reports and Secure Aggregation rounds.\n\n"
    "Each route lists the error codes it sends. Any request may also be answered before it reaches "
    "a route: 400 MALFORMED_REQUEST (not an HTTP/1 request), 408 HEADER_TIMEOUT, 431 HEADERS_TOO_LARGE, "
    "503 SERVER_BUSY (every connection is busy with a request: try again shortly), 401 "
    "CLIENT_CERTIFICATE_REQUIRED (a server that admits only clients with a certificate, to a connection that gave "
    "none) or 505 "
    "HTTP_VERSION_NOT_SUPPORTED by the HTTP server, 404 NOT_FOUND for a path the server does not have "
    "(a route's path with a trailing slash too: it is not redirected), "
    "405 METHOD_NOT_ALLOWED for a method a path does not take."
)


def _error_answer(error: ApiError) -> JSONResponse:
    """An error's JSON answer, with ``Retry-After`` where the error names a wait."""
    wait = error.retry_after_s
    headers = {"Retry-After": str(max(1, round(wait)))} if wait is not None else None
    return JSONResponse(error.to_json(), status_code=error.status, headers=headers)


def create_app(service: FLService, *, admin_keys: AdminKeys, offload: bool = True, telemetry: bool = True) -> FastAPI:
    """The FL server's ASGI app. Operator endpoints need one of ``admin_keys`` as a bearer key;
    device endpoints need attestation (when the service verifies it) and session tokens.
    ``offload=False`` calls the service on the event loop itself: for a caller that sends one
    request at a time (a fleet simulation), where the thread pool's hand-offs were its largest cost.
    ``telemetry=False`` turns off FastAPI's own OpenTelemetry spans and metrics (a simulation on
    a virtual clock, whose wall-clock spans would mean nothing: FastAPI looks up the process's
    OpenTelemetry providers on every request, a tenth of a check-in's time in the app); left on,
    they follow whatever providers the process configured."""
    app = FastAPI(
        **_without_telemetry(telemetry),
        title="fedfleet FL server",
        version=API_VERSION,
        description=_DESCRIPTION,
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
        # a path with a slash too many is a path the server does not have (404 NOT_FOUND, as any
        # other), not a 307 with an empty body to the path without it
        redirect_slashes=False,
    )
    app.state.service = service
    # The routes reach the service through a weak proxy: FastAPI keeps the last few thousand endpoint
    # functions it classified in process-wide caches, and a strong reference from them would keep
    # the last hundred-odd apps' services alive after their apps are gone (with a simulated fleet's
    # whole world behind each, through its clock). The app holds the service itself.
    service = weakref.proxy(service)
    secagg_signal = _Broadcast()
    uploads = _Uploads()
    # Reports in the thread pool at once (``reports.CHECKED_AT_ONCE``, one a core), from the start of
    # their checks to their answers: the others wait their turn here, holding no worker thread (40 of
    # them waiting left none for a check-in) and nothing of their bodies but a spool file each.
    checking = asyncio.Semaphore(reports.CHECKED_AT_ONCE)
    polls = _Newest()  # the long polls of the sessions' Secure Aggregation states

    def admin(request: Request) -> None:
        key = bearer(request)
        if key is None:
            raise Unauthorized(
                "operator endpoints need 'Authorization: Bearer <admin key>' (or X-FL-Token behind a gateway that takes Authorization)",
                code="ADMIN_KEY_REQUIRED",
            )
        if not admin_keys.verify(key):
            raise Unauthorized("the admin key is not one this server accepts", code="BAD_ADMIN_KEY")

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        if not offload:
            return fn(*args)
        return await run_in_threadpool(fn, *args)

    @app.get("/v1/health", tags=["health"], **_answers(Health), **_route("DATABASE_GONE", database=False))
    async def health() -> Health:
        problem = service.database_problem
        if problem is not None:  # a monitor must hear of it: every write from now on is lost at the stop
            raise DatabaseGone(problem)
        return Health(status="ok")

    # ----------------------------------------------------------------- devices
    # (declared first: the router tries routes in order, and devices send nearly every request)
    @app.post(
        "/v1/populations/{population}/checkin",
        tags=["devices"],
        openapi_extra=_json_body(Checkin),
        **_answers(CheckinAnswer),
        **_route(*_JSON, "BAD_RUNTIME_VERSION", "ATTESTATION_REQUIRED", *_ATTESTATION),
    )
    async def checkin(population: str, request: Request) -> CheckinAccepted | CheckinRejected:
        body = parse(Checkin, await read_body(request, MAX_JSON_BYTES))
        eligibility = body.eligibility.model_dump() if body.eligibility is not None else None
        return await call(service.checkin, population, body.runtime_version, eligibility, body.attestation)

    @app.post(
        "/v1/attestation/nonce",
        tags=["devices"],
        **_answers(AttestationChallenge),
        **_route(*_BODY, "ATTESTATION_DISABLED", database=False),
    )
    async def attestation_nonce(request: Request) -> AttestationChallenge:
        await read_body(request, MAX_JSON_BYTES)
        return await call(service.attestation_challenge)

    @app.get(
        "/v1/populations/{population}/eligibility",
        tags=["devices"],
        **_answers(EligibilityInfo),
        **_route(database=False),
    )
    async def eligibility_info(population: str) -> EligibilityInfo:
        return await call(service.eligibility_info, population)

    @app.get(
        "/v1/resources/{rid}",
        tags=["devices", "operators"],
        **_binary_answer(
            "the plan or checkpoint's bytes", *_SESSION, "UNKNOWN_RESOURCE", more={304: {"description": "not modified"}}
        ),
    )
    async def resource(rid: str, request: Request) -> Response:
        token = bearer(request)
        is_admin = token is not None and admin_keys.verify(token)
        data = await call(lambda: service.resource(rid, token, admin=is_admin))
        etag = f'"{rid}"'
        headers = {"ETag": etag, "Cache-Control": CACHE_FOREVER}
        if _etag_matches(request.headers.get("if-none-match"), rid):
            return Response(status_code=304, headers=headers)
        return Response(data, media_type="application/octet-stream", headers=headers)

    # A session's uploads are authorized and bounded before a byte of the body is read.
    @app.post(
        "/v1/sessions/{sid}/report",
        tags=["devices"],
        openapi_extra=_binary_body(),
        **_answers(ReportAnswer),
        **_route(
            *_SESSION,
            *_BODY,
            "UPLOAD_SUPERSEDED",
            "SERVER_BUSY",
            "SESSION_CLOSED",
            "REPORT_LATE",
            "DUPLICATE_REPORT",
            "SECURE_AGGREGATION_REQUIRED",
            "INVALID_UPDATE",
            "MALFORMED_UPDATE",
            "INVALID_METRICS",
        ),
    )
    async def report(sid: str, request: Request) -> ReportAnswer:
        token = session_token(request)
        limit = await call(service.report_limit, sid, token)
        with await uploads.spool(sid, request, limit) as spool:
            async with checking:  # its turn, waited for here: a worker thread each only once it has it
                return await call(service.report, sid, token, spool.view(), _stats_header(request))

    @app.post(
        "/v1/sessions/{sid}/abort",
        tags=["devices"],
        openapi_extra=_json_body(Abort),
        **_answers(AbortAnswer),
        **_route(*_SESSION, *_JSON),
    )
    async def abort(sid: str, request: Request) -> AbortAnswer:
        token = session_token(request)
        body = parse(Abort, await read_body(request, MAX_JSON_BYTES))
        return await call(service.abort, sid, token, body.reason[:200], advisory_stats(body.stats))

    @app.get(
        "/v1/sessions/{sid}/secagg",
        tags=["devices"],
        **_answers(SecAggState),
        **_route(*_SESSION, "BAD_QUERY", "SESSION_CLOSED", "NOT_IN_GROUP", "POLL_SUPERSEDED"),
    )
    async def secagg_poll(
        sid: str,
        request: Request,
        after: int = Query(-1, ge=-1, le=2**31),
        wait: float = Query(0.0, ge=0.0, le=3600.0, allow_inf_nan=False),
    ) -> Response:
        """With ``after`` (the last message seq the device has) and ``wait`` (seconds), a long
        poll: it answers once the device's state moves on, or when ``wait`` runs out. The state is
        sent as the service built it (``SecAggState`` documents it): a malicious-server test bends
        it, and the device must refuse what it bends into."""
        token = session_token(request)
        loop = asyncio.get_running_loop()
        until = loop.time() + min(wait, MAX_SECAGG_WAIT_S)
        with contextlib.ExitStack() as held:
            superseded: asyncio.Event | None = None
            while True:
                changed = secagg_signal.event()
                state = await call(service.secagg_status, sid, token)
                settled = state["status"] == "waiting" or (state["status"] == "active" and int(state["seq"]) <= after)
                remaining = until - loop.time()
                if not settled or remaining <= 0:
                    return JSONResponse(state)
                if superseded is None:  # the token is checked: the session holds one poll, the newest
                    superseded = held.enter_context(polls.hold(sid))
                if not await _first(asyncio.ensure_future(changed.wait()), superseded, remaining):
                    raise PollSuperseded("a newer poll of this session's Secure Aggregation state began")

    @app.post(
        "/v1/sessions/{sid}/secagg",
        tags=["devices"],
        openapi_extra=_binary_body(),
        **_answers(SecAggAccepted),
        **_route(
            *_SESSION,
            *_BODY,
            "UPLOAD_SUPERSEDED",
            "SECAGG_REJECTED",
            "SESSION_CLOSED",
            "NOT_IN_GROUP",
            "SECAGG_ROUND_CLOSED",
            "SECAGG_ALREADY_ANSWERED",
        ),
    )
    async def secagg_send(sid: str, request: Request) -> SecAggAccepted:
        token = session_token(request)
        limit = await call(service.secagg_limit, sid, token)
        body = await uploads.read(sid, request, limit)
        return await call(service.secagg_message, sid, token, body)

    # ----------------------------------------------------------------- operators
    @app.get("/v1/populations", tags=["operators"], **_answers(PopulationList), **_route(*_ADMIN))
    async def list_populations(request: Request) -> PopulationList:
        admin(request)
        return PopulationList(populations=await call(service.populations))

    @app.post(
        "/v1/populations",
        tags=["operators"],
        openapi_extra=_json_body(CreatePopulation),
        status_code=201,
        **_answers(PopulationCreated),
        **_route(
            *_ADMIN,
            *_JSON,
            "BAD_NAME",
            more={200: {"model": PopulationCreated, "description": "the population existed already"}},
        ),
    )
    async def create_population(request: Request) -> Response:
        admin(request)
        body = parse(CreatePopulation, await read_body(request, MAX_JSON_BYTES))
        created = await call(service.create_population, body.name)
        answer = PopulationCreated(name=body.name, created=created)
        return JSONResponse(answer.model_dump(mode="json"), status_code=201 if created else 200)

    @app.get(
        "/v1/populations/{population}",
        tags=["operators"],
        **_answers(PopulationStatus),
        **_route(*_ADMIN, "UNKNOWN_POPULATION"),
    )
    async def population_status(population: str, request: Request) -> dict:
        admin(request)
        return await call(service.population_status, population)

    def _spec(task: TaskDeploy) -> TaskSpec:
        versioned = {
            release: b64(data, f"versioned_plans.{release}") or b"" for release, data in task.versioned_plans.items()
        }
        return TaskSpec(
            task.name,
            b64(task.plan, "plan") or b"",
            b64(task.checkpoint, "checkpoint"),
            task.config,
            task.eligibility,
            task.weight,
            task.evaluates,
            versioned_plans=versioned,
            release_report=task.release_report,
        )

    def _deployed(population: str, records: list, created: bool) -> list[DeployedTask]:
        """What a deploy made, with each task's state: ``queued`` (and behind which tasks) tells the
        operator that it waits, rather than leaving them to wonder why no round opens."""
        states = service.task_states(population)
        repeated: dict[str, Any] = {} if created else {"already_deployed": True}
        return [
            DeployedTask(
                task=r.name,
                population=population,
                plan_id=r.plan_id,
                checkpoint_id=r.initial_checkpoint_id,
                **states.get(r.name, {"status": r.status}),
                **repeated,
            )
            for r in records
        ]

    @app.post(
        "/v1/populations/{population}/tasks",
        tags=["operators"],
        openapi_extra=_json_body(TaskDeploy),
        status_code=201,
        **_answers(DeployedTask),
        **_route(*_DEPLOY, more={200: {"model": DeployedTask, "description": _REDEPLOYED}}),
    )
    async def deploy_task(population: str, request: Request) -> Response:
        admin(request)
        # the body is let go once parsed: a deploy near its bound is 1.8 GB of JSON, its parsed copy as much again
        task = await call(parse, TaskDeploy, await read_body(request, MAX_DEPLOY_BYTES, DEPLOY_SIZE_ADVICE))
        if task.evaluates is not None:
            raise MalformedBody("'evaluates' names a task of the same deploy: use /task-groups", code="BAD_CONFIG")
        spec = await call(_spec, task)
        records, created = await call(service.deploy, population, [spec])
        (answer,) = await call(_deployed, population, records, created)
        return JSONResponse(answer.model_dump(mode="json", exclude_unset=True), status_code=201 if created else 200)

    @app.post(
        "/v1/populations/{population}/task-groups",
        tags=["operators"],
        openapi_extra=_json_body(GroupDeploy),
        status_code=201,
        **_answers(DeployedGroup),
        **_route(*_DEPLOY, more={200: {"model": DeployedGroup, "description": _REDEPLOYED}}),
    )
    async def deploy_group(population: str, request: Request) -> Response:
        admin(request)
        group = await call(parse, GroupDeploy, await read_body(request, MAX_DEPLOY_BYTES, DEPLOY_SIZE_ADVICE))
        specs = [await call(_spec, t) for t in group.tasks]
        records, created = await call(service.deploy, population, specs, group.strategy)
        tasks = await call(_deployed, population, records, created)
        answer = DeployedGroup(strategy=group.strategy.value, tasks=tasks)
        return JSONResponse(answer.model_dump(mode="json", exclude_unset=True), status_code=201 if created else 200)

    @app.post(
        "/v1/populations/{population}/tasks/{task}/stop",
        tags=["operators"],
        **_answers(TaskStopped),
        **_route(*_ADMIN, "UNKNOWN_POPULATION", "UNKNOWN_TASK", "TASK_STOPPED", "TASK_NOT_RUNNING"),
    )
    async def stop_task(population: str, task: str, request: Request) -> TaskStopped:
        """Stop a task for good: its open round is closed without committing, it is marked
        ``stopped`` (on record before the answer), and the rest of its deploy, or the next deploy,
        runs. The body is empty."""
        admin(request)
        return await call(service.stop_task, population, task)

    @app.get(
        "/v1/populations/{population}/rounds",
        tags=["operators"],
        **_answers(RoundList),
        **_route(*_ADMIN, "BAD_QUERY", "UNKNOWN_POPULATION", "UNKNOWN_TASK", "UNKNOWN_ROUND"),
    )
    async def list_rounds(
        population: str,
        request: Request,
        response: Response,
        task: str | None = Query(None, max_length=128),
        last: int = Query(
            ROUNDS_PAGE, ge=1, le=MAX_ROUNDS_PAGE, description=f"the newest so many rounds (1 to {MAX_ROUNDS_PAGE})"
        ),
        before: int | None = Query(
            None,
            ge=1,
            le=MAX_ROUND_ID,
            description="only rounds older than the one this cursor names: the before of the Link header's "
            "rel=next of the page after",
        ),
    ) -> dict:
        """Finished rounds, oldest first across the tasks: the newest ``last`` (by default 100). When
        older ones are on record the answer has a ``Link: <rounds?last=N&before=C>; rel="next"``
        header, the same request for the page before this one, as a reference relative to the
        request's URL (RFC 8288 section 3.2, resolved as RFC 3986 section 5 says)."""
        admin(request)
        rounds, older = await call(service.round_page, population, task, last, before)
        if older is not None:
            url = request.url.include_query_params(last=last, before=older)
            # relative: behind a proxy at a path prefix (https://host/fl/ to the app's /) the path
            # the app sees lacks the prefix, and a root-relative link resolved to https://host/v1/...,
            # the proxy's 404; this one resolves against the URL the client asked, prefix and all
            response.headers["Link"] = f'<{url.path.rsplit("/", 1)[-1]}?{url.query}>; rel="next"'
        return {"rounds": rounds}  # checked against RoundList as it leaves

    @app.get(
        "/v1/populations/{population}/model",
        tags=["operators"],
        **_binary_answer(
            "the newest model as checkpoint bytes, with X-Round and X-Task headers",
            *_ADMIN,
            "BAD_QUERY",
            "UNKNOWN_POPULATION",
            "NO_TASK",
            "UNKNOWN_TASK",
            "UNKNOWN_RESOURCE",
        ),
    )
    async def model(population: str, request: Request, task: str | None = Query(None, max_length=128)) -> Response:
        admin(request)
        data, number, name = await call(service.current_model, population, task)
        headers = {"X-Round": str(number), "X-Task": urllib.parse.quote(name, safe="")}
        return Response(data, media_type="application/octet-stream", headers=headers)

    # ----------------------------------------------------------------- errors
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error_answer(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = _bad_input(list(exc.errors()))
        if error.code == "BAD_FIELD":
            error = MalformedBody(error.message, code="BAD_QUERY")
        return JSONResponse(error.to_json(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
        return JSONResponse(
            {"error": {"code": code, "message": str(exc.detail)}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # Not the app's fault, and nobody reads the answer: one line, no traceback.
        log.debug("the client of %s %s disconnected before its request body was in", request.method, request.url.path)
        error = ClientDisconnected("the client disconnected before its request body was in")
        return JSONResponse(error.to_json(), status_code=error.status)

    @app.exception_handler(OperationalError)
    async def database_unavailable(request: Request, exc: OperationalError) -> Response:
        # Not a bug: the database refused (a full disk, a lock past the busy timeout, a read-only
        # file). One line saying what to do, no traceback; the client is told to come back.
        log.error("%s %s: the database refused it: %s", request.method, request.url.path, store_advice(exc))
        return _error_answer(
            DatabaseUnavailable(
                "the server cannot use its database now; nothing of the request was kept: try again later"
            )
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"code": "INTERNAL", "message": "internal server error"}}, status_code=500)

    # ----------------------------------------------------------------- OpenAPI and lifespan
    def openapi() -> dict:
        if app.openapi_schema is None:
            # The error responses reach every operation through FastAPI(responses=...) on the router.
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in REQUEST_SCHEMAS], ref_template="#/components/schemas/{model}"
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            window = schema["components"]["schemas"]["RoundConfig"]["properties"]["retry_window_s"]
            # The one RoundConfig rule JSON Schema cannot state; clients read it here.
            window["description"] = "(min, max) seconds a device waits before it checks in again, with min <= max"
            schema["components"]["securitySchemes"] = {
                "adminKey": {"type": "http", "scheme": "bearer", "description": "an operator's admin key"},
                "sessionToken": {"type": "http", "scheme": "bearer", "description": "the token a check-in returned"},
            }
            for path, item in schema["paths"].items():
                for operation in item.values():
                    # FastAPI adds a 422 to every route with parameters; this app answers a bad
                    # parameter 400 BAD_QUERY (``validation_error``), so it lists only its own 422s.
                    if "x-error-codes" not in operation["responses"].get("422", {"x-error-codes": ()}):
                        del operation["responses"]["422"]
                    tags = operation.get("tags", [])
                    if "operators" in tags and "devices" in tags:
                        operation["security"] = [{"adminKey": []}, {"sessionToken": []}]
                    elif "operators" in tags:
                        operation["security"] = [{"adminKey": []}]
                    elif path.startswith("/v1/sessions/"):
                        operation["security"] = [{"sessionToken": []}]
            if "HTTPValidationError" not in json.dumps(schema["paths"]):
                for unused in ("HTTPValidationError", "ValidationError"):
                    schema["components"]["schemas"].pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def secagg_changed() -> None:
            loop.call_soon_threadsafe(secagg_signal.fire)

        service.on_secagg_change = secagg_changed

        async def ticker() -> None:
            while True:
                await asyncio.sleep(TICK_INTERVAL_S)
                try:
                    await run_in_threadpool(service.tick)
                except Exception:  # keep ticking: one bad tick must not stop rounds forever
                    log.exception("round tick failed")

        task = asyncio.create_task(ticker())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await run_in_threadpool(service.write_unwritten)  # round records still waiting for a retry
            await run_in_threadpool(service.write_late_metrics)  # what the ticker had not written yet

    app.router.lifespan_context = lifespan
    add_direct_routes(app, "devices")
    return app


def _without_telemetry(telemetry: bool) -> dict[str, Any]:
    """FastAPI's arguments that turn its OpenTelemetry instrumentation off (none before FastAPI
    had it, 0.165, nor when it is wanted)."""
    if telemetry or "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def create_app_from_path(db: str, *, admin_keys: AdminKeys) -> FastAPI:
    """An app over its own database (a SQLite path or a SQLAlchemy URL)."""
    return create_app(FLService(ServerStore(db)), admin_keys=admin_keys)
