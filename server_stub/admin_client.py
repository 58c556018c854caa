"""A small HTTP client for the server's operator endpoints (populations, tasks, rounds, model)."""

from __future__ import annotations

import base64
from typing import Any

import httpx

from device_runtime.checkpoint import decode_checkpoint
from device_runtime.eligibility import EligibilityPolicies
from device_runtime.plan import Plan, serialize_plan

from .rounds import RoundConfig


class AdminError(Exception):
    """The server refused an operator request; ``code`` is its stable error code."""

    def __init__(self, message: str, status: int, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class AdminClient:
    def __init__(self, server_url: str, *, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                err = response.json()["error"]
                raise AdminError(f"{err['message']} ({err['code']})", response.status_code, err["code"])
            except (ValueError, KeyError, TypeError):
                raise AdminError(response.text[:300], response.status_code, None) from None
        return response

    def create_population(self, name: str) -> dict[str, Any]:
        return self._check(self.http.post("/v1/populations", json={"name": name})).json()

    def deploy_task(
        self,
        population: str,
        name: str,
        plan: Plan | bytes,
        checkpoint: bytes,
        config: RoundConfig,
        eligibility: EligibilityPolicies | None = None,
    ) -> dict[str, Any]:
        plan_bytes = plan if isinstance(plan, bytes) else serialize_plan(plan)
        body = {
            "name": name,
            "plan": base64.b64encode(plan_bytes).decode(),
            "checkpoint": base64.b64encode(checkpoint).decode(),
            "config": config.to_dict(),
            "eligibility": (eligibility or EligibilityPolicies()).to_dict(),
        }
        return self._check(self.http.post(f"/v1/populations/{population}/tasks", json=body)).json()

    def status(self, population: str) -> dict[str, Any]:
        return self._check(self.http.get(f"/v1/populations/{population}")).json()

    def rounds(self, population: str) -> list[dict[str, Any]]:
        return self._check(self.http.get(f"/v1/populations/{population}/rounds")).json()["rounds"]

    def checkpoint(self, resource_id: str) -> dict:
        """A checkpoint resource, e.g. the model a given round committed."""
        return decode_checkpoint(self._check(self.http.get(f"/v1/resources/{resource_id}")).content)

    def model(self, population: str) -> tuple[dict, int]:
        response = self._check(self.http.get(f"/v1/populations/{population}/model"))
        return decode_checkpoint(response.content), int(response.headers["X-Round"])
