"""The HTTP shell: Starlette routes that parse and bound requests, then call FLService."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from device_runtime.opstats import SHAPE_ALPHABET
from device_runtime.protocol import STATS_HEADER

from device_runtime.eligibility import EligibilityPolicies

from .errors import ApiError, BodyTooLarge, MalformedBody, TooManyRequests, Unauthorized
from .persistence import ServerStore
from .rounds import RoundConfig
from .service import FLService

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 * 1024
MAX_DEPLOY_BYTES = 512 * 1024 * 1024
MAX_SECAGG_BYTES = 64 * 1024 * 1024
MAX_SECAGG_WAIT_S = 10.0
TICK_INTERVAL_S = 0.05
CACHE_FOREVER = "public, max-age=31536000, immutable"


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes; a larger body is refused before it is all in memory."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(f"the body is {declared} bytes; the limit here is {limit}")
        except ValueError:
            raise MalformedBody("Content-Length is not a number") from None
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MalformedBody("the body must be a JSON object")
    return data


def _field(data: dict, name: str, kind: type | tuple[type, ...], *, required: bool = True, default: Any = None) -> Any:
    if name not in data:
        if required:
            raise MalformedBody(f"field {name!r} is required", code="MISSING_FIELD")
        return default
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise MalformedBody(f"field {name!r} has the wrong type", code="BAD_FIELD")
    return value


def _b64(data: dict, name: str) -> bytes:
    try:
        return base64.b64decode(_field(data, name, str), validate=True)
    except (binascii.Error, ValueError):
        raise MalformedBody(f"field {name!r} is not valid base64", code="BAD_FIELD") from None


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("send the session token as 'Authorization: Bearer <token>'", code="MISSING_TOKEN")
    return token.strip()


MAX_SHAPE = 16


def session_shape(stats: object) -> str | None:
    """The shape from a device's session statistics, if it is a plausible one; else None.

    Statistics are advisory: malformed ones are ignored rather than failing a good report."""
    if not isinstance(stats, dict):
        return None
    shape = stats.get("shape")
    if isinstance(shape, str) and 0 < len(shape) <= MAX_SHAPE and set(shape) <= SHAPE_ALPHABET:
        return shape
    return None


def _stats_header(request: Request) -> object:
    raw = request.headers.get(STATS_HEADER.lower())
    if raw is None or len(raw) > 2048:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


class _Broadcast:
    """Wakes every waiter at once; waiters take ``event()`` before checking their condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def event(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise MalformedBody(f"query parameter {name!r} must be an integer", code="BAD_QUERY") from None


def _float_param(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise MalformedBody(f"query parameter {name!r} must be a non-negative number", code="BAD_QUERY")
    return value


def create_app(service: FLService) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def create_population(request: Request) -> Response:
        data = await read_json(request)
        created = service.create_population(_field(data, "name", str))
        return JSONResponse({"name": data["name"], "created": created}, status_code=201 if created else 200)

    async def population_status(request: Request) -> Response:
        return JSONResponse(service.population_status(request.path_params["population"]))

    async def deploy_task(request: Request) -> Response:
        data = await read_json(request, MAX_DEPLOY_BYTES)
        name = _field(data, "name", str)
        plan = _b64(data, "plan")
        checkpoint = _b64(data, "checkpoint")
        try:
            config = RoundConfig.from_dict(_field(data, "config", dict, required=False, default={}))
            eligibility = EligibilityPolicies.from_dict(_field(data, "eligibility", dict, required=False, default={}))
        except (ValueError, TypeError) as exc:
            raise MalformedBody(f"the task config is not valid: {exc}", code="BAD_CONFIG") from None
        population = request.path_params["population"]
        record = await run_in_threadpool(service.deploy_task, population, name, plan, checkpoint, config, eligibility)
        return JSONResponse(
            {"task": record.name, "population": population, "plan_id": record.plan_id, "checkpoint_id": record.initial_checkpoint_id},
            status_code=201,
        )

    async def checkin(request: Request) -> Response:
        data = await read_json(request)
        runtime_version = _field(data, "runtime_version", str)
        eligibility = _field(data, "eligibility", dict, required=False)
        if eligibility:
            _field(eligibility, "task", str)
            _field(eligibility, "eligible", bool)
            failed = _field(eligibility, "failed", list, required=False, default=[])
            if not all(isinstance(f, str) for f in failed):
                raise MalformedBody("eligibility.failed must be a list of policy names", code="BAD_FIELD")
        attestation = data.get("attestation")
        return JSONResponse(service.checkin(request.path_params["population"], runtime_version, eligibility, attestation))

    async def attestation_nonce(request: Request) -> Response:
        await read_body(request, MAX_JSON_BYTES)
        return JSONResponse(service.attestation_challenge())

    async def eligibility_info(request: Request) -> Response:
        return JSONResponse(service.eligibility_info(request.path_params["population"]))

    async def resource(request: Request) -> Response:
        rid = request.path_params["rid"]
        etag = f'"{rid}"'
        if request.headers.get("if-none-match") == etag:
            service.resource(rid)
            return Response(status_code=304, headers={"ETag": etag, "Cache-Control": CACHE_FOREVER})
        data = await run_in_threadpool(service.resource, rid)
        return Response(data, media_type="application/octet-stream", headers={"ETag": etag, "Cache-Control": CACHE_FOREVER})

    async def report(request: Request) -> Response:
        sid = request.path_params["sid"]
        token = _bearer(request)
        limit = service.report_limit(sid)
        body = await read_body(request, limit)
        shape = session_shape(_stats_header(request))
        return JSONResponse(await run_in_threadpool(service.report, sid, token, body, shape))

    async def abort(request: Request) -> Response:
        sid = request.path_params["sid"]
        token = _bearer(request)
        data = await read_json(request)
        reason = _field(data, "reason", str, required=False, default="unspecified")
        shape = session_shape(data.get("stats"))
        return JSONResponse(service.abort(sid, token, reason[:200], shape))

    secagg_signal = _Broadcast()

    async def secagg_poll(request: Request) -> Response:
        """With ``after`` (the last message seq the device has) and ``wait`` (seconds), a long
        poll: it answers once the device's state moves on, or when ``wait`` runs out."""
        sid, token = request.path_params["sid"], _bearer(request)
        after, wait = _int_param(request, "after", -1), min(_float_param(request, "wait", 0.0), MAX_SECAGG_WAIT_S)
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            changed = secagg_signal.event()
            state = await run_in_threadpool(service.secagg_status, sid, token)
            settled = state["status"] == "waiting" or (state["status"] == "active" and int(state["seq"]) <= after)
            remaining = until - loop.time()
            if not settled or remaining <= 0:
                return JSONResponse(state)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def secagg_send(request: Request) -> Response:
        sid = request.path_params["sid"]
        token = _bearer(request)
        body = await read_body(request, MAX_SECAGG_BYTES)
        return JSONResponse(await run_in_threadpool(service.secagg_message, sid, token, body))

    async def list_rounds(request: Request) -> Response:
        rounds = await run_in_threadpool(service.rounds, request.path_params["population"])
        return JSONResponse({"rounds": rounds})

    async def model(request: Request) -> Response:
        data, number, task = await run_in_threadpool(service.current_model, request.path_params["population"])
        return Response(data, media_type="application/octet-stream", headers={"X-Round": str(number), "X-Task": task})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, TooManyRequests) else None
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"code": "INTERNAL", "message": "internal server error"}}, status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        service.on_secagg_change = lambda: loop.call_soon_threadsafe(secagg_signal.fire)
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

    routes = [
        Route("/v1/health", health),
        Route("/v1/populations", create_population, methods=["POST"]),
        Route("/v1/populations/{population}", population_status),
        Route("/v1/populations/{population}/tasks", deploy_task, methods=["POST"]),
        Route("/v1/populations/{population}/checkin", checkin, methods=["POST"]),
        Route("/v1/attestation/nonce", attestation_nonce, methods=["POST"]),
        Route("/v1/populations/{population}/eligibility", eligibility_info),
        Route("/v1/populations/{population}/rounds", list_rounds),
        Route("/v1/populations/{population}/model", model),
        Route("/v1/resources/{rid}", resource),
        Route("/v1/sessions/{sid}/report", report, methods=["POST"]),
        Route("/v1/sessions/{sid}/abort", abort, methods=["POST"]),
        Route("/v1/sessions/{sid}/secagg", secagg_poll, methods=["GET"]),
        Route("/v1/sessions/{sid}/secagg", secagg_send, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
    )
    app.state.service = service
    return app


def create_app_from_path(db_path: str) -> Starlette:
    """An app over its own SQLite database file (what ``uvicorn --factory`` would call)."""
    return create_app(FLService(ServerStore(db_path)))
