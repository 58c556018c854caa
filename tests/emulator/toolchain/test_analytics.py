"""A federated analytics plan counts and histograms device data; the server sums the devices'
counts in the clear or through Secure Aggregation's codec, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import (
    FLRuntime,
    Outcome,
    PlanExecutor,
    RuntimeEnvironment,
    encode_checkpoint,
    load_plan,
    serialize_plan,
)
from device_runtime.clock import VirtualClock
from device_runtime.secure_sum import SecureSumCodec
from emulator.devices.inprocess import InProcessTransport
from emulator.toolchain import analytics_plan
from example_store import ExampleSelector, SQLiteExampleStore
from server_stub import AdminClient, AdminKeys, FLService, RoundConfig, ServerStore, create_app

URL = "http://fl.internal"
COLLECTION = "app:/sessions"
EDGES = [0.0, 1.0, 5.0, 30.0, 120.0]


def _device_values(rng, n):
    return rng.choice([0.0, 0.5, 1.0, 4.99, 5.0, 29.0, 30.0, 119.0, 120.0, 500.0, -1.0], size=n).astype(np.float32)


def _histogram(values):
    counts, _ = np.histogram(values[(values >= EDGES[0]) & (values <= EDGES[-1])], bins=EDGES)
    return counts


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), devices=st.integers(1, 6))
def test_secure_sum_of_device_histograms_is_the_exact_fleet_histogram(seed, devices):
    plan = load_plan(
        serialize_plan(
            analytics_plan(
                feature="minutes",
                edges=EDGES,
                example_selector=ExampleSelector(COLLECTION),
                secure_aggregation=True,
                batch_size=7,
            )
        )
    )
    executor = PlanExecutor(plan)
    codec = SecureSumCodec(plan, executor)
    rng = np.random.default_rng(seed)
    all_values, total = [], None
    for _ in range(devices):
        values = _device_values(rng, int(rng.integers(0, 40)))
        all_values.append(values)
        update = executor.run_device(
            {}, lambda v=values: [{"minutes": v[i : i + 7]} for i in range(0, len(v), 7)]
        ).update
        encoded = codec.encode(update, rng).astype(np.uint64)
        total = encoded if total is None else total + encoded
    summed = codec.decode_sum(total, devices)
    _, metrics = executor.update({}, executor.report(executor.accumulate(executor.zero(), summed)))
    expected = _histogram(np.concatenate(all_values))
    assert [round(metrics[f"bin_{i:02d}"]) for i in range(len(EDGES) - 1)] == list(expected)
    assert all(abs(metrics[f"bin_{i:02d}"] - expected[i]) < 1e-3 for i in range(len(EDGES) - 1))
    assert round(metrics["num_examples"]) == sum(len(v) for v in all_values)


def test_a_histogram_task_runs_through_the_server(tmp_path):
    clock = VirtualClock()
    service = FLService(ServerStore(tmp_path / "server.db"), clock=clock.now, wall_clock=clock.now)
    keys, key = AdminKeys.generate()
    plan = analytics_plan(feature="minutes", edges=EDGES, example_selector=ExampleSelector(COLLECTION))
    rng = np.random.default_rng(0)
    data = [_device_values(rng, 25) for _ in range(3)]
    with InProcessTransport(create_app(service, admin_keys=keys)) as transport:
        with AdminClient(URL, admin_key=key, transport=transport) as admin:
            admin.create_population("usage")
            admin.deploy_task(
                "usage",
                "histogram",
                plan,
                encode_checkpoint({}),
                RoundConfig(goal_count=3, over_selection=1.0, min_fraction=1.0, min_reports=1),
            )
            for i, values in enumerate(data):
                store = SQLiteExampleStore(tmp_path / f"d{i}.db")
                store.add(COLLECTION, ({"minutes": np.float32(v)} for v in values))
                with FLRuntime(
                    "usage", URL, store, transport=transport, environment=RuntimeEnvironment(clock=clock.now)
                ) as runtime:
                    assert runtime.run_session().outcome is Outcome.COMPLETED
                store.close()
            (record,) = admin.rounds("usage")
    service.store.close()
    expected = _histogram(np.concatenate(data))
    assert record["status"] == "committed"
    assert [record["metrics"][f"bin_{i:02d}"] for i in range(4)] == pytest.approx(list(expected))
    assert record["metrics"]["num_examples"] == 75


def test_bad_edges_are_refused():
    with pytest.raises(ValueError, match="strictly increasing"):
        analytics_plan(feature="f", edges=[1.0, 1.0], example_selector=ExampleSelector(COLLECTION))


@pytest.fixture
def attested_server(tmp_path):
    """A real server that admits attested devices only, and the authority that certifies them:
    the SDK's default policy runs Secure Aggregation only among attested devices."""
    from emulator import AttestationAuthority
    from server_stub import AttestationVerifier, NonceRegistry, RateLimiter, ServerThread

    authority = AttestationAuthority.generate()
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=60), RateLimiter(burst=20, rate_per_s=5)
    )
    with ServerThread(tmp_path / "server.db", verifier=verifier) as server, server.admin() as admin:
        yield server, admin, authority


def test_a_fleet_histograms_its_labels_through_secure_aggregation(tmp_path, attested_server, digits):
    """Emulated devices on the real server: the round's bins are the fleet's exact label counts,
    and the server only ever saw the Secure Aggregation sum."""
    import time

    from emulator import DeviceProfile, EmulatedDevice, RealTimeFleet

    server, admin, authority = attested_server

    plan = analytics_plan(
        feature="y",
        edges=list(range(11)),
        example_selector=ExampleSelector("app:/digits"),
        secure_aggregation=True,
        batch_size=64,
    )
    admin.create_population("digits")
    admin.deploy_task(
        "digits",
        "label-histogram",
        plan,
        encode_checkpoint({}),
        RoundConfig(
            goal_count=6,
            over_selection=1.0,
            min_fraction=1.0,
            min_reports=1,
            report_timeout_s=20,
            selection_timeout_s=20,
            secagg_min_group_size=5,
            secagg_round_timeout_s=2.0,
            max_rounds=1,
        ),
    )
    parts = np.array_split(np.arange(120), 6)
    devices = []
    for i, idx in enumerate(parts):
        device = EmulatedDevice(
            f"d{i}",
            tmp_path / f"d{i}",
            server.url,
            "digits",
            profile=DeviceProfile(cooldown_s=(0.05, 0.2)),
            collection_uri="app:/digits",
            seed=i,
            attestor=authority.new_device_attestor("emulated-phone", time.time()),
            trust_anchor=authority.trust_anchor(),
        )
        device.add_examples(digits.x_train[idx], digits.y_train[idx])
        devices.append(device)
    fleet = RealTimeFleet(devices)
    fleet.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(r["status"] == "committed" for r in admin.rounds("digits")):
            time.sleep(0.2)
    finally:
        fleet.stop()
    (record,) = [r for r in admin.rounds("digits") if r["status"] == "committed"]
    assert record["metrics"]["secagg"]["summed_devices"] == 6
    expected = np.bincount(digits.y_train[:120], minlength=10)
    assert [round(record["metrics"][f"bin_{i:02d}"]) for i in range(10)] == list(expected)
    assert round(record["metrics"]["num_examples"]) == 120
