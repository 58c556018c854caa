"""A small HTTP client for the server's operator endpoints (populations, tasks, rounds, model)."""

from __future__ import annotations

import base64
import functools
import json
import os
import ssl
import time
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from device_runtime.checkpoint import decode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.errors import InvalidSetting, ProtocolError
from device_runtime.plan import Plan, serialize_plan
from device_runtime.protocol import (
    MAX_RESOURCE_BYTES,
    NO_TLS,
    REFUSED_CERTIFICATE,
    TOKEN_HEADER,
    ClientTLS,
    answer_bound,
    checked_server_url,
    closed_unsaid,
    foreign_answer,
    redacted_url,
    tls_refusal,
    token_headers,
    url_credentials,
)
from device_runtime.wire import (
    DeployedGroup,
    DeployedTask,
    PopulationCreated,
    PopulationList,
    PopulationStatus,
    RoundList,
    TaskStopped,
)

from .metrics import rounds_frame
from .rounds import RoundConfig
from .schemas import MAX_ROUND_ID, MAX_ROUNDS_PAGE, is_name

#: The largest deploy a server of this release takes (``server_stub.app.MAX_DEPLOY_BYTES``): an
#: initial checkpoint of up to the 1 GiB a device downloads, in base64, and 512 MiB for the plans.
DEPLOY_BYTES = 4 * MAX_RESOURCE_BYTES // 3 + (512 << 20)

#: The least pace at which a server checks a deploy, in bytes of its JSON a second: a deploy is
#: answered once its plans loaded and ran on its checkpoint and it is stored, which takes a server
#: tens of seconds for a large model (measured on 2 busy cores: ResNet-50's 137 MB of JSON in 40 to
#: 80 s, DistilBERT's 360 MB in about 100 s). A deploy waits ``timeout_s`` plus a second per this
#: many bytes for its answer; with ``timeout_s`` alone, 30 s, ``fedfleet deploy`` of DistilBERT said
#: the server did not answer while the server went on and took it.
DEPLOY_CHECK_BYTES_PER_S = 1 << 20


def task_body(
    name: str,
    plan: Plan | bytes,
    checkpoint: bytes | None,
    config: RoundConfig | None = None,
    eligibility: EligibilityPolicies | None = None,
    *,
    weight: float = 1.0,
    evaluates: str | None = None,
    versioned_plans: Mapping[str, Plan | bytes] | None = None,
    release_report: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON of one task to deploy (see ``TaskDeploy`` in the OpenAPI document).
    ``versioned_plans`` (release -> plan) and ``release_report`` go together: a server that
    requires release reports accepts the task only with a report covering every claimed release."""
    plan_bytes = plan if isinstance(plan, bytes) else serialize_plan(plan)
    body: dict[str, Any] = {
        "name": name,
        "plan": base64.b64encode(plan_bytes).decode(),
        "config": (config or RoundConfig()).changes(),
        "eligibility": (eligibility or EligibilityPolicies()).to_dict(),
        "weight": weight,
    }
    if checkpoint is not None:
        body["checkpoint"] = base64.b64encode(checkpoint).decode()
    if evaluates is not None:
        body["evaluates"] = evaluates
    if versioned_plans:
        body["versioned_plans"] = {
            release: base64.b64encode(p if isinstance(p, bytes) else serialize_plan(p)).decode()
            for release, p in versioned_plans.items()
        }
    if release_report is not None:
        body["release_report"] = dict(release_report)
    return body


def _is_round(text: str) -> bool:
    """Whether ``text`` is a round number a server gives (ASCII digits, 1 to ``MAX_ROUND_ID``):
    ``int`` refuses ``'²'``, which ``isdigit`` takes, and a number of over 4,300 digits."""
    return text.isascii() and text.isdigit() and len(text) <= 19 and 1 <= int(text) <= MAX_ROUND_ID


class AdminError(Exception):
    """The server refused an operator request; ``code`` is its stable error code."""

    def __init__(self, message: str, status: int, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ServerUnreachable(Exception):
    """No answer from the server (nothing listens there, a wrong host, a URL that is not ``http(s)://``):
    the message is one line saying what to check, for a command line to print as it is."""


def check_server_url(url: str) -> str:
    """``url`` without a trailing slash, once it names an ``http://`` or ``https://`` server (the
    rule devices hold too, ``checked_server_url``); a bare ``host:port`` is refused with the URL to
    give instead (httpx would say only "unsupported protocol")."""
    try:
        return checked_server_url(url)
    except InvalidSetting as exc:
        raise ServerUnreachable(str(exc)) from None


def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context (``SSL_CERT_FILE``/``SSL_CERT_DIR`` honoured as httpx
    honours them, read at each call as a device's ``shared_tls_context`` reads them), built once
    per process and setting: building one loads the CA bundle, about 60 ms of CPU, which every
    operator client (each test's, the CLI's) paid."""
    return _context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _context_for(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    return httpx.create_ssl_context()


def _environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``$HTTPS_PROXY``, ``$HTTP_PROXY``, ``$ALL_PROXY``
    and ``$NO_PROXY``, which httpx follows), as a message names it, or None. A proxy that did not
    answer was said as "no answer from the server ... check that fedfleet server runs there", for
    a server that ran there."""
    parsed = httpx.URL(url)
    found = urllib.request.getproxies_environment()
    scheme = parsed.scheme if parsed.scheme in found else "all"
    if scheme not in found or urllib.request.proxy_bypass(parsed.host):
        return None
    return f"{redacted_url(found[scheme])} (${scheme.upper()}_PROXY)"


class AdminClient:
    """An operator's client: every request carries the admin key as a bearer token.

    Answers are parsed by their wire models (``device_runtime.wire``): one out of shape is an
    ``AdminError`` with code ``MALFORMED_ANSWER``. They are handed back as the JSON objects the models
    read (fields a newer server added are left out), as the CLI and notebooks index them."""

    def __init__(
        self,
        server_url: str,
        *,
        admin_key: str,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        """``tls``: the operator's client certificate for a server that admits only clients with one
        (``fedfleet server --tls-client-ca``), or the authority of the server's certificate."""
        self.url = check_server_url(server_url)
        self.gives_certificate = tls is not None and tls.cert_file is not None
        try:
            verify = tls.context() if tls is not None else _tls_context()
        except InvalidSetting as exc:
            raise ServerUnreachable(str(exc)) from None
        self.timeout_s = timeout_s
        base_url, auth = url_credentials(self.url)  # not in the URL: httpx logs each request's
        self._env_proxies = transport is None  # httpx follows the environment's proxies only then
        self.http = httpx.Client(
            base_url=base_url,
            auth=auth,
            timeout=timeout_s,
            # what the device's bound decodes: each answer is read through it, so that a hostile or
            # broken server's endless answer (a model of gigabytes) is cut off, not held in memory
            headers={**token_headers(admin_key, auth), "Accept-Encoding": "gzip, deflate"},
            transport=transport,
            verify=verify,
            event_hooks={"response": [answer_bound(time.monotonic, timeout_s)]},
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Every request goes through here, so that a server that does not answer is one
        ``ServerUnreachable`` whatever the call, and a refusal one ``AdminError``."""
        try:
            response = self.http.request(method, path, **kwargs)
        except ProtocolError as exc:  # an answer past the bounds a device reads (MAX_RESOURCE_BYTES)
            raise AdminError(str(exc), 200, "MALFORMED_ANSWER") from None
        except httpx.TimeoutException as exc:
            # only a deploy sent whole and not answered may have been taken: one that found no
            # server (ConnectTimeout) or was not read (WriteTimeout) never arrived
            if isinstance(exc, httpx.ReadTimeout) and method == "POST" and path.endswith(("/tasks", "/task-groups")):
                waited = httpx.Timeout(kwargs.get("timeout", self.timeout_s)).read
                raise ServerUnreachable(
                    f"the server at {redacted_url(self.url)} did not answer the deploy within {waited:g} s; it may "
                    "still be checking it: fedfleet status shows whether it was taken (the same deploy sent again "
                    "is taken once)"
                ) from None
            raise self._unreachable(exc) from None
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        return self._check(response)

    def _deploy(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST a deploy, waiting for its answer as long as the server may take to check it
        (``DEPLOY_CHECK_BYTES_PER_S``)."""
        content = json.dumps(body, separators=(",", ":")).encode()
        wait = self.timeout_s + len(content) / DEPLOY_CHECK_BYTES_PER_S
        try:
            return self._send(
                "POST",
                path,
                content=content,
                headers={"Content-Type": "application/json"},
                timeout=httpx.Timeout(wait, connect=self.timeout_s),  # a server not there is said as soon as ever
            )
        except AdminError as exc:
            if exc.code != "BODY_TOO_LARGE" or len(content) > DEPLOY_BYTES:
                raise
            # a server of this release takes it: the server that refused it is of an earlier one
            raise AdminError(
                f"{exc}; a deploy of {len(content):,} bytes is within this release's bound ({DEPLOY_BYTES:,} bytes, "
                "a checkpoint of up to 1 GiB): the server is of an earlier release, which takes 512 MiB; "
                "upgrade the server, or deploy a smaller model",
                exc.status,
                exc.code,
            ) from None

    def _unreachable(self, exc: httpx.TransportError) -> ServerUnreachable:
        reason = str(exc) or type(exc).__name__
        refusal = tls_refusal(exc)
        if refusal not in (None, NO_TLS):
            # a certificate refused: said as the device says it, where it was "speaks plain HTTP"
            return ServerUnreachable(
                f"the server at {redacted_url(self.url)} could not be reached over TLS: {refusal} ({reason})"
            )
        if self.url.startswith("https://") and "SSL" in reason:  # a TLS hello to fedfleet server's plain HTTP
            return ServerUnreachable(
                f"no TLS answer from the server at {redacted_url(self.url)} ({reason}); fedfleet server speaks plain HTTP: "
                f"give {'http://' + redacted_url(self.url).removeprefix('https://')}, or the URL of the TLS proxy in front of it "
                "(a server started without --tls-cert)"
            )
        if self.gives_certificate and self.url.startswith("https://") and closed_unsaid(exc):
            return ServerUnreachable(
                f"the server at {redacted_url(self.url)} closed the connection with no answer ({reason}); {REFUSED_CERTIFICATE}"
            )
        proxy = _environment_proxy(self.url) if self._env_proxies else None
        if proxy is not None:  # httpx went through it (trust_env): the proxy did not answer, or refused
            return ServerUnreachable(
                f"no answer from the server at {redacted_url(self.url)} through the proxy {proxy} ({reason}); "
                "check that proxy, or name the server's host in $NO_PROXY to reach it directly"
            )
        return ServerUnreachable(
            f"no answer from the server at {redacted_url(self.url)} ({reason}); check that fedfleet server "
            "runs there and the URL's host and port"
        )

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                # pydantic-core's parser: json.loads (httpx's) recursed once per bracket, and a refusal
                # of 100,000 nested '[' raised RecursionError, not an AdminError
                err = from_json(response.content)["error"]
                message = f"{err['message']} ({err['code']})"
                if err["code"] == "NOT_FOUND" and (path := httpx.URL(self.url).path.rstrip("/")):
                    # a route no server has: the URL carries a path of the server's own (``.../v1``)
                    message += (
                        f"; {redacted_url(self.url)} has no such route: give the server's URL without {path} (behind a "
                        f"proxy that serves it at {path}, have the proxy strip {path} before it passes a request on)"
                    )
                if err["code"] == "CLIENT_CERTIFICATE_REQUIRED":
                    message += "; give the operator's certificate: fedfleet's --tls-cert FILE --tls-key FILE"
                if err["code"] == "ADMIN_KEY_REQUIRED" and TOKEN_HEADER in response.request.headers:
                    # the server read only ``Authorization``, which the URL's credentials take
                    message = (
                        f"the server did not read the admin key sent in {TOKEN_HEADER} beside the URL's credentials: "
                        f"a server of a release before {TOKEN_HEADER} (upgrade it) or a gateway that drops the header "
                        f"({err['code']})"
                    )
                raise AdminError(message, response.status_code, err["code"])
            except (ValueError, KeyError, TypeError):  # a proxy's page, or another server's
                raise AdminError(foreign_answer(response), response.status_code, None) from None
        return response

    @staticmethod
    def _answer(response: httpx.Response, model: type[BaseModel]) -> dict[str, Any]:
        """The answer, once its model accepts it, as the JSON object the model read."""
        try:
            return model.model_validate_json(response.content).model_dump(mode="json", exclude_unset=True)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            first_loc, first_msg = (errors[0]["loc"], errors[0]["msg"]) if errors else ((), "out of shape")
            where = ".".join(str(part) for part in first_loc)
            raise AdminError(
                f"the server's answer to {response.request.method} {response.request.url.path} is not a "
                f"{model.__name__}: {where + ': ' if where else ''}{first_msg}",
                response.status_code,
                "MALFORMED_ANSWER",
            ) from None

    def create_population(self, name: str) -> dict[str, Any]:
        return self._answer(self._send("POST", "/v1/populations", json={"name": name}), PopulationCreated)

    def populations(self) -> list[str]:
        return self._answer(self._send("GET", "/v1/populations"), PopulationList)["populations"]

    def deploy_task(
        self,
        population: str,
        name: str,
        plan: Plan | bytes,
        checkpoint: bytes,
        config: RoundConfig | None = None,
        eligibility: EligibilityPolicies | None = None,
        *,
        versioned_plans: Mapping[str, Plan | bytes] | None = None,
        release_report: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Deploy one task; it trains once no earlier task of the population is active."""
        body = task_body(
            name, plan, checkpoint, config, eligibility, versioned_plans=versioned_plans, release_report=release_report
        )
        return self._answer(self._deploy(f"/v1/populations/{population}/tasks", body), DeployedTask)

    def deploy_body(self, population: str, body: dict[str, Any]) -> dict[str, Any]:
        """Deploy one task given as its JSON (``task_body`` makes it)."""
        return self._answer(self._deploy(f"/v1/populations/{population}/tasks", body), DeployedTask)

    def deploy_tasks(self, population: str, tasks: list[dict[str, Any]], strategy: str = "alternate") -> dict[str, Any]:
        """Deploy tasks that share the population's rounds (``task_body`` makes each item);
        ``strategy`` is ``alternate`` (take turns) or ``weighted`` (draw by each task's weight)."""
        body = {"strategy": strategy, "tasks": tasks}
        return self._answer(self._deploy(f"/v1/populations/{population}/task-groups", body), DeployedGroup)

    def status(self, population: str) -> dict[str, Any]:
        return self._answer(self._send("GET", f"/v1/populations/{population}"), PopulationStatus)

    def stop_task(self, population: str, task: str) -> dict[str, Any]:
        """Stop a task on the running server for good (its open round closed without committing,
        the rest of its deploy or the next deploy runs): what was stopped (``TaskStopped``).
        ``AdminError`` with ``TASK_STOPPED`` when it is stopped already, ``TASK_NOT_RUNNING`` when
        it completed, was retired or is refused."""
        return self._answer(self._send("POST", f"/v1/populations/{population}/tasks/{task}/stop"), TaskStopped)

    def rounds(self, population: str, task: str | None = None, last: int | None = None) -> list[dict[str, Any]]:
        """Finished rounds, oldest first; ``last``: only the newest so many (1 to ``MAX_ROUNDS_PAGE``);
        without it every round on record, read ``MAX_ROUNDS_PAGE`` at a time (a long run's history
        is 2 KB a round)."""
        if last is not None:
            return self.round_page(population, task, last)[0]
        pages: list[list[dict[str, Any]]] = []
        before: int | None = None
        seen: set[int] = set()
        while True:
            page, before = self.round_page(population, task, MAX_ROUNDS_PAGE, before)
            pages.append(page)
            if before is None or before in seen:  # a server that pages in a circle stops here
                return [r for older_first in reversed(pages) for r in older_first]
            seen.add(before)

    def round_page(
        self, population: str, task: str | None = None, last: int | None = None, before: int | None = None
    ) -> tuple[list[dict[str, Any]], int | None]:
        """One page of finished rounds, oldest first: the newest ``last`` (the server's default,
        ``ROUNDS_PAGE``, without it) of those older than the round ``before`` names; and the
        ``before`` of the page of older ones, None when none is on record."""
        params: dict[str, Any] = {}
        if task is not None:
            params["task"] = task
        if last is not None:
            params["last"] = last
        if before is not None:
            params["before"] = before
        response = self._send("GET", f"/v1/populations/{population}/rounds", params=params)
        rounds = self._answer(response, RoundList)["rounds"]
        link = response.links.get("next", {}).get("url")
        if link is None:
            return rounds, None
        older = parse_qs(urlsplit(link).query).get("before", [""])[-1]
        # older than the page asked for: a server that pages in a circle, or forward, would be read for ever
        if not _is_round(older) or (before is not None and int(older) >= before):
            raise AdminError(
                f"the server's answer to GET {response.request.url.path} names no older round to page back from "
                f"in its Link header: {link[:100]!r}",
                response.status_code,
                "MALFORMED_ANSWER",
            )
        return rounds, int(older)

    def rounds_frame(self, population: str, task: str | None = None):  # -> pandas.DataFrame
        """The rounds as a pandas DataFrame, one row per round (needs ``fedfleet[analysis]``)."""
        return rounds_frame(self.rounds(population, task))

    def checkpoint(self, resource_id: str) -> dict:
        """A checkpoint resource, e.g. the model a given round committed."""
        return decode_checkpoint(self.checkpoint_bytes(resource_id))

    def checkpoint_bytes(self, resource_id: str) -> bytes:
        """A checkpoint resource as the server stores it (what ``decode_checkpoint`` reads)."""
        return self._send("GET", f"/v1/resources/{resource_id}").content

    def model(self, population: str, task: str | None = None) -> tuple[dict, int]:
        data, number, _ = self.model_bytes(population, task)
        return decode_checkpoint(data), number

    def model_bytes(self, population: str, task: str | None = None) -> tuple[bytes, int, str]:
        """The newest model of ``task`` (default: the running deploy's first training task) as
        checkpoint bytes, the round that committed it (0: none has, it is the initial model) and
        the task's name."""
        params = {"task": task} if task is not None else None
        response = self._send("GET", f"/v1/populations/{population}/model", params=params)
        number = response.headers.get("X-Round", "")
        if not (number == "0" or _is_round(number)):
            raise AdminError(
                f"the server's answer to GET {response.request.url.path} is not a model: it names no round (X-Round)",
                response.status_code,
                "MALFORMED_ANSWER",
            )
        name = unquote(response.headers.get("X-Task", task or ""))
        if not is_name(name):  # said in the caller's messages, and asked for again as a task
            raise AdminError(
                f"the server's answer to GET {response.request.url.path} is not a model: it names no task (X-Task)",
                response.status_code,
                "MALFORMED_ANSWER",
            )
        return response.content, int(number), name
