"""The device side of the FL protocol over HTTP: check-in, resources, report, abort.

Connection errors and 5xx answers are retried with exponential backoff and full jitter; 4xx
answers are final and raised as ProtocolError with the server's stable error code."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import certifi
import httpx

from .attestation import AttestationError, decode_nonce
from .errors import CorruptResource, ProtocolError, ServerUnreachable

#: The header a report carries its session statistics in (shape so far, training time).
STATS_HEADER = "X-FL-Session-Stats"
#: The longest wait a server can ask for (a week): a longer one is cut to it.
MAX_RETRY_WINDOW_S = 7 * 86_400.0


@functools.lru_cache(maxsize=1)
def shared_tls_context() -> ssl.SSLContext:
    """The default verifying TLS context, built once per process and shared by every client."""
    return ssl.create_default_context(cafile=certifi.where())


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


@dataclass(frozen=True)
class CheckinAccepted:
    session_id: str
    token: str
    task: str
    round: int
    plan_id: str
    checkpoint_id: str
    aggregation: str
    report_deadline_s: float
    secagg_commitment: str | None = None  # H(seed) of the round's Secure Aggregation groups
    # The round's bounds on one device's influence; under Secure Aggregation the device applies
    # them to its own update before masking it (the server sees only its group's sum).
    max_examples_per_report: int | None = None
    clip_update_norm: float | None = None


#: What an accepted check-in's fields must look like before the device uses them: ids name
#: files of the plan cache and path segments of later requests, the token goes into a header.
_RESOURCE_ID = re.compile(r"[0-9a-f]{64}")
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_TOKEN = re.compile(r"[\x21-\x7e]{1,512}")
AGGREGATIONS = ("simple", "secure_sum")


def _json_object(response: httpx.Response, what: str) -> dict:
    """The JSON object a successful answer must be; anything else is the server's ``ProtocolError``."""
    if not 200 <= response.status_code < 300:
        raise ProtocolError(f"the server's {what} came with HTTP {response.status_code}, not a success", status=response.status_code)
    try:
        data = response.json()
    except ValueError:  # not JSON, or not UTF-8
        raise ProtocolError(f"the server's {what} is not JSON: {response.content[:80]!r}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"the server's {what} is not a JSON object: {str(data)[:80]!r}")
    return data


def _accepted(data: dict) -> CheckinAccepted:
    """The accepted check-in, every field checked: a broken or hostile server's answer is a
    ``ProtocolError`` naming the field, never a value that reaches a path, a header or a clock."""

    def field(name: str, ok: Callable[[object], bool], what: str) -> Any:
        if name not in data:
            raise ProtocolError(f"the check-in answer is missing {name!r}")
        value = data[name]
        if not ok(value):
            raise ProtocolError(f"the check-in answer's {name!r} is not {what}: {str(value)[:80]!r}")
        return value

    def matches(pattern: re.Pattern) -> Callable[[object], bool]:
        return lambda v: isinstance(v, str) and pattern.fullmatch(v) is not None

    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    def positive_int(v: object) -> TypeGuard[int]:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    def positive_or_null(v: object) -> bool:
        return v is None or (positive_int(v) and v < 2**1023) or (isinstance(v, float) and math.isfinite(v) and v > 0)

    secure = data.get("aggregation") == "secure_sum"

    def bound(name: str, ok: Callable[[object], bool], what: str) -> Any:
        """One of the round's bounds, required under Secure Aggregation: nobody but the device can apply it."""
        return field(name, ok, what) if secure or name in data else None

    commitment = data.get("secagg_commitment")
    max_examples = bound("max_examples_per_report", positive_int, "a positive integer")
    clip = bound("clip_update_norm", positive_or_null, "a positive number or null")
    return CheckinAccepted(
        session_id=field("session_id", matches(_SESSION_ID), "a session id"),
        token=field("token", matches(_TOKEN), "a token"),
        task=field("task", lambda v: isinstance(v, str) and 0 < len(v) <= 128, "a task name"),
        round=int(field("round", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a round number")),
        plan_id=field("plan_id", matches(_RESOURCE_ID), "a resource id"),
        checkpoint_id=field("checkpoint_id", matches(_RESOURCE_ID), "a resource id"),
        aggregation=field("aggregation", lambda v: v in AGGREGATIONS, f"one of {AGGREGATIONS}"),
        report_deadline_s=float(field("report_deadline_s", number, "a finite number of seconds")),
        secagg_commitment=commitment if isinstance(commitment, str) else None,
        max_examples_per_report=max_examples,
        clip_update_norm=None if clip is None else float(clip),
    )


class ProtocolClient:
    """One device's connection to one FL server."""

    def __init__(
        self,
        server_url: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport``: how requests travel (httpx's, e.g. an in-process one in a simulation);
        by default real HTTP. ``client``: an httpx client to share between devices instead."""
        self.server_url = server_url.rstrip("/")
        self.retry = retry
        self.rng = rng or random.Random()
        self.sleep = sleep
        self._owns_client = client is None
        # One TLS context for every device of the process: building one loads the CA bundle
        # (about 18 ms and 0.8 MB each), which a fleet of emulated devices paid per device.
        self.http = client or httpx.Client(timeout=httpx.Timeout(timeout_s), transport=transport, verify=shared_tls_context())
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        if self._owns_client:
            self.http.close()

    def _request(self, method: str, path: str, *, json_body: Callable[[], Any] | None = None, **kwargs: Any) -> httpx.Response:
        """``json_body``: builds the JSON body afresh for each attempt (a signed nonce must not
        be sent twice: the server refuses a replay)."""
        url = self.server_url + path
        last_error: Exception | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                self.sleep(self.retry.delay(attempt, self.rng))
            try:
                if json_body is not None:
                    kwargs["json"] = json_body()
                response = self.http.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                last_error = exc
                continue
            body = kwargs.get("content") or b""
            self.bytes_sent += len(body) if isinstance(body, (bytes, bytearray)) else 0
            self.bytes_received += len(response.content)
            if response.status_code >= 500:
                last_error = ProtocolError(f"server error {response.status_code}", status=response.status_code)
                continue
            return response
        raise ServerUnreachable(
            f"the FL server at {self.server_url} did not answer {method} {path} after {self.retry.attempts} attempts: {last_error}"
        )

    @staticmethod
    def _raise_for_error(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        code, message = None, response.text[:200]
        try:
            err = response.json()["error"]
            code, message = err["code"], err["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ProtocolError(f"{message} (HTTP {response.status_code}, {code})", status=response.status_code, code=code)

    def attestation_nonce(self) -> bytes:
        """A fresh challenge from the server, to be signed into this check-in's attestation."""
        response = self._request("POST", "/v1/attestation/nonce", json={})
        self._raise_for_error(response)
        try:
            return decode_nonce(_json_object(response, "attestation challenge").get("nonce"))
        except (AttestationError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"the server's attestation challenge is malformed: {exc}") from None

    def checkin(
        self,
        population: str,
        runtime_version: str,
        eligibility: dict | None = None,
        attestation: dict | Callable[[], dict] | None = None,
    ) -> CheckinAccepted | dict:
        """Returns CheckinAccepted, or the rejection dict with ``reason`` and ``retry_after_s``.
        ``attestation`` may be a function that attests a fresh nonce: it is called for every
        attempt, so a retried check-in never replays a nonce the server has already consumed."""

        def body() -> dict:
            data: dict = {"runtime_version": runtime_version, "eligibility": eligibility or {}}
            if attestation is not None:
                data["attestation"] = attestation() if callable(attestation) else attestation
            return data

        response = self._request("POST", f"/v1/populations/{population}/checkin", json_body=body)
        self._raise_for_error(response)
        data = _json_object(response, "check-in answer")
        if data.get("status") == "accepted":
            return _accepted(data)
        if data.get("status") == "rejected":
            return data
        raise ProtocolError(f"unexpected check-in answer: {data!r}")

    def eligibility_info(self, population: str) -> dict:
        response = self._request("GET", f"/v1/populations/{population}/eligibility")
        self._raise_for_error(response)
        return _json_object(response, "eligibility answer")

    def fetch_resource(self, resource_id: str, token: str) -> bytes:
        """Download a content-addressed resource of the session whose bearer ``token`` is given
        and check that it is what its id names."""
        response = self._request("GET", f"/v1/resources/{resource_id}", headers={"Authorization": f"Bearer {token}"})
        self._raise_for_error(response)
        data = response.content
        if hashlib.sha256(data).hexdigest() != resource_id:
            raise CorruptResource(f"resource {resource_id} arrived corrupted (its SHA-256 does not match); it was discarded")
        return data

    def report(self, session: CheckinAccepted, update: bytes, stats: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {session.token}", "Content-Type": "application/octet-stream"}
        if stats:
            headers[STATS_HEADER] = json.dumps(stats, separators=(",", ":"))
        response = self._request("POST", f"/v1/sessions/{session.session_id}/report", content=update, headers=headers)
        self._raise_for_error(response)
        if not 200 <= response.status_code < 300:
            raise ProtocolError(f"the server answered the report with HTTP {response.status_code}, not a success",
                                status=response.status_code)
        try:  # the report was taken (2xx); what the answer adds is advice, and a broken one is none
            return _json_object(response, "answer to the report")
        except ProtocolError:
            return {}

    def secagg_poll(self, session: CheckinAccepted, *, after: int | None = None, wait_s: float = 0.0) -> dict:
        """This session's Secure Aggregation state and the server's latest message for it. With
        ``after`` (the last message seq seen) the server holds the answer up to ``wait_s`` seconds
        until there is something new."""
        params = {} if after is None else {"after": str(after), "wait": f"{max(0.0, wait_s):.3f}"}
        response = self._request(
            "GET",
            f"/v1/sessions/{session.session_id}/secagg",
            params=params,
            headers={"Authorization": f"Bearer {session.token}"},
        )
        self._raise_for_error(response)
        return _json_object(response, "Secure Aggregation state")

    def secagg_send(self, session: CheckinAccepted, message: bytes) -> None:
        response = self._request(
            "POST",
            f"/v1/sessions/{session.session_id}/secagg",
            content=message,
            headers={"Authorization": f"Bearer {session.token}", "Content-Type": "application/octet-stream"},
        )
        self._raise_for_error(response)

    def abort(self, session: CheckinAccepted, reason: str, stats: dict | None = None) -> None:
        response = self._request(
            "POST",
            f"/v1/sessions/{session.session_id}/abort",
            json={"reason": reason, "stats": stats or {}},
            headers={"Authorization": f"Bearer {session.token}"},
        )
        self._raise_for_error(response)


def retry_window(answer: object) -> tuple[float, float] | None:
    """The ``retry_after_s`` window a server's answer names, cut to a week; None when it names
    none or a malformed one (a server is not trusted to)."""
    window = answer.get("retry_after_s") if isinstance(answer, dict) else None
    if not isinstance(window, (list, tuple)) or len(window) < 2:
        return None
    try:
        lo, hi = float(window[0]), float(window[1])
    except (TypeError, ValueError, OverflowError):
        return None
    if not (0.0 <= lo <= hi and math.isfinite(hi)):
        return None
    return (min(lo, MAX_RETRY_WINDOW_S), min(hi, MAX_RETRY_WINDOW_S))
