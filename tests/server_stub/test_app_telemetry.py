"""FastAPI's own OpenTelemetry instrumentation: on by default (it follows the process's
providers), off for a simulation on a virtual clock (``create_app(telemetry=False)``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_stub import AdminKeys, FLService, ServerStore, create_app

pytest.importorskip("fastapi.telemetry")  # FastAPI instruments itself from 0.165, through OpenTelemetry's API
from opentelemetry import trace  # noqa: E402


class _Recording(trace.TracerProvider):
    """A configured tracer provider that notes the spans started through it."""

    def __init__(self) -> None:
        self.spans: list[str] = []

    def get_tracer(self, *args, **kwargs) -> trace.Tracer:
        spans = self.spans

        class Tracer(trace.NoOpTracer):
            def start_span(self, name, *a, **k):
                spans.append(name)
                return super().start_span(name, *a, **k)

            def start_as_current_span(self, name, *a, **k):
                spans.append(name)
                return super().start_as_current_span(name, *a, **k)

        return Tracer()


@pytest.mark.parametrize("telemetry", [True, False])
def test_spans_follow_the_process_provider_unless_turned_off(tmp_path, monkeypatch, telemetry):
    provider = _Recording()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    store = ServerStore(tmp_path / "server.db")
    app = create_app(FLService(store), admin_keys=AdminKeys.generate()[0], telemetry=telemetry)

    async def health() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fl.test") as client:
            return (await client.get("/v1/health")).status_code

    try:
        assert asyncio.run(health()) == 200
    finally:
        store.close()
    assert ("GET" in provider.spans) is telemetry
    assert bool(provider.spans) is telemetry
