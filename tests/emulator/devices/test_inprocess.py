"""Devices run the SDK's real protocol code against the server's ASGI app in process: no socket,
the server on a virtual clock."""

from __future__ import annotations

import numpy as np

from device_runtime import FLRuntime, Outcome, RuntimeEnvironment, encode_checkpoint, initial_weights
from device_runtime.clock import VirtualClock
from emulator.devices.inprocess import InProcessTransport
from example_store import SQLiteExampleStore
from server_stub import AdminClient, AdminKeys, FLService, RoundConfig, ServerStore, create_app
from tests.support import COLLECTION, digits_plan

URL = "http://fl.internal"


def test_a_round_commits_through_the_in_process_transport(tmp_path, digits):
    clock = VirtualClock()
    service = FLService(ServerStore(tmp_path / "server.db"), clock=clock.now, wall_clock=clock.now)
    keys, key = AdminKeys.generate()
    plan = digits_plan()
    with InProcessTransport(create_app(service, admin_keys=keys)) as transport:
        with AdminClient(URL, admin_key=key, transport=transport) as admin:
            admin.create_population("digits")
            admin.deploy_task(
                "digits",
                "train",
                plan,
                encode_checkpoint(initial_weights(plan)),
                RoundConfig(goal_count=5, over_selection=1.0, min_fraction=1.0),
            )
            results = []
            for i in range(5):
                store = SQLiteExampleStore(tmp_path / f"d{i}.db")
                part = slice(20 * i, 20 * i + 20)
                store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
                with FLRuntime(
                    "digits", URL, store, transport=transport, environment=RuntimeEnvironment(clock=clock.now)
                ) as runtime:
                    results.append(runtime.run_session())
                store.close()
            rounds = admin.rounds("digits")
            model, number = admin.model("digits")
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 5
    assert [r["status"] for r in rounds] == ["committed"] and number == 1
    assert rounds[0]["metrics"]["reported"] == 5
    start = initial_weights(plan)
    assert any(not np.array_equal(model[w], start[w]) for w in plan.weight_names)
    service.store.close()
