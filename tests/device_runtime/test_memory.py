"""The estimate of a step's peak memory (``device_runtime.memory``) and the device's refusal of a
plan it does not fit, before the checkpoint is downloaded."""

from __future__ import annotations

import hashlib
import json
import logging

import httpx
import numpy as np
import pytest

from device_runtime import (
    DeviceClass,
    FLRuntime,
    OpStatsStore,
    OverBudget,
    build_mlp_plan,
    encode_checkpoint,
    initial_weights,
    serialize_plan,
)
from device_runtime.memory import ARENA_FACTOR, SESSION_BYTES, training_peak
from device_runtime.plan import largest_work_tensor
from example_store import ExampleSelector, InMemoryExampleStore

SELECTOR = ExampleSelector("app:/memory")


def mlp(hidden: int, batch_size: int):
    return build_mlp_plan(64, (hidden,), 10, learning_rate=0.1, batch_size=batch_size, epochs=1, selector=SELECTOR)


def test_the_estimate_counts_the_state_twice_a_batch_and_the_step_s_working_values_with_onnxruntime_s_share():
    plan = mlp(32, 8)
    estimate = training_peak(plan)
    parameters = 64 * 32 + 32 + 32 * 10 + 10
    assert estimate.weights_bytes == 4 * parameters and estimate.optimizer_bytes == 0
    assert estimate.updated_bytes >= estimate.weights_bytes  # the new set beside the old one
    assert estimate.batch_bytes == 8 * 64 * 4 + 8 * 8  # x float32, y int64
    assert estimate.working_bytes >= 8 * (32 + 10) * 4  # at least the forward activations
    assert estimate.overhead_bytes == int((ARENA_FACTOR - 1) * estimate.working_bytes) + SESSION_BYTES
    assert estimate.total_bytes == sum(
        (estimate.weights_bytes, estimate.updated_bytes, estimate.batch_bytes, estimate.working_bytes)
    ) + (estimate.constant_bytes + estimate.overhead_bytes)
    assert not estimate.open_dims


def test_the_working_values_grow_with_the_batch_but_not_as_the_sum_of_every_value():
    """Values are let go after their last reader: the peak is below every intermediate held at once,
    and grows with the batch size."""
    small, large = training_peak(mlp(256, 16)), training_peak(mlp(256, 64))
    assert large.working_bytes > 3 * small.working_bytes
    assert large.weights_bytes == small.weights_bytes
    assert training_peak(mlp(256, 64)) is large  # found once per graph and batch


class Server(httpx.BaseTransport):
    """Accepts every check-in with ``plan``; records the resources asked for and the aborts' bodies."""

    def __init__(self, plan) -> None:
        self.plan, self.checkpoint = serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0))
        self.ids = {hashlib.sha256(b).hexdigest(): b for b in (self.plan, self.checkpoint)}
        self.fetched: list[str] = []
        self.aborts: list[dict] = []
        self.reports = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/checkin"):
            return httpx.Response(
                200,
                json={
                    "status": "accepted",
                    "session_id": "s1",
                    "token": "t0k3n",
                    "task": "train",
                    "round": 1,
                    "plan_id": hashlib.sha256(self.plan).hexdigest(),
                    "checkpoint_id": hashlib.sha256(self.checkpoint).hexdigest(),
                    "aggregation": "simple",
                    "report_deadline_s": 60.0,
                },
            )
        if path.startswith("/v1/resources/"):
            resource = path.rsplit("/", 1)[1]
            self.fetched.append("plan" if self.ids[resource] == self.plan else "checkpoint")
            return httpx.Response(200, content=self.ids[resource])
        if path.endswith("/abort"):
            self.aborts.append(json.loads(request.content))
            return httpx.Response(200, json={"status": "aborted"})
        if path.endswith("/report"):
            self.reports += 1
        return httpx.Response(200, json={"status": "accepted"})


def _store() -> InMemoryExampleStore:
    store = InMemoryExampleStore()
    rng = np.random.default_rng(0)
    store.add(SELECTOR.collection_uri, [{"x": rng.random(64).astype(np.float32), "y": i % 10} for i in range(64)])
    return store


def test_a_plan_whose_step_does_not_fit_is_refused_before_its_checkpoint_is_downloaded(tmp_path, caplog):
    """A device of 4 MB and a plan whose step takes about 8 MB, though no tensor of it and no batch
    is over the device's checks of them: the device said nothing of it and trained (the server's
    plan had declared no budget). Now it refuses it, and says why to the app, its opstats and the
    server; a device of twice the estimate runs it."""
    plan = mlp(1024, 256)
    estimate = training_peak(plan)
    largest = largest_work_tensor(plan)
    assert largest is not None and largest[1] <= (1 << 20) and 4 < estimate.peak_mb < 16
    server = Server(plan)
    opstats = OpStatsStore(tmp_path / "app.db")
    small = DeviceClass("small", memory_mb=4)
    with caplog.at_level(logging.WARNING, logger="device_runtime.runtime"):
        with FLRuntime(
            "memory", "http://fl.test", _store(), transport=server, device_class=small, opstats=opstats
        ) as runtime:
            with pytest.raises(
                OverBudget, match=r"takes about [\d.]+ MB at a batch of 256 .* a small device gives 4 MB"
            ):
                runtime.run_session()
    assert server.fetched == ["plan"] and server.reports == 0
    [abort] = server.aborts
    assert "OverBudget" in abort["reason"] and "a small device gives 4 MB" in abort["reason"]
    [session] = opstats.sessions()
    [error] = [e for e in session.events if e.kind == "error"]
    assert error.detail["error"] == "OverBudget" and "a small device gives 4 MB" in error.detail["reason"]
    assert "session not run" in caplog.text and "a small device gives 4 MB" in caplog.text
    big = DeviceClass("big", memory_mb=2 * estimate.peak_mb)
    with FLRuntime("memory", "http://fl.test", _store(), transport=Server(plan), device_class=big) as runtime:
        assert runtime.run_session().outcome.value == "completed"
