"""An app's service lives as long as the app: FastAPI keeps the endpoint functions it classified in
process-wide caches, and a process that makes many apps (a sweep of simulated fleets, a notebook,
a test worker) must not keep every old app's service, and the fleet behind its clock, alive."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
from fastapi import FastAPI

from server_stub import AdminKeys, FLService, ServerStore, create_app


def test_a_dropped_apps_service_is_freed_once_its_routes_have_served(tmp_path):
    keys, key = AdminKeys.generate()
    store = ServerStore(tmp_path / "server.db")
    service = FLService(store)
    app = create_app(service, admin_keys=keys, offload=False)

    async def serve(app: FastAPI) -> list[int]:  # a device route, an operator route and its dependency
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fl.test") as client:
            answers = [
                await client.get("/v1/health"),
                await client.get("/v1/populations", headers={"Authorization": f"Bearer {key}"}),
                await client.post("/v1/populations/none/checkin", json={}),
            ]
            return [a.status_code for a in answers]

    statuses = asyncio.run(serve(app))
    assert statuses[:2] == [200, 200] and 400 <= statuses[2] < 500
    store.close()
    freed = weakref.ref(service)
    del service, app
    gc.collect()
    assert freed() is None, [type(r).__name__ for r in gc.get_referrers(freed())]
