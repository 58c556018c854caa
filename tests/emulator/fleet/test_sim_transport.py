"""The simulated network: requests reach a real ASGI app in process, cost the device virtual
time for the bytes they move, and fail as a phone's would when its network is down."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from emulator.fleet.sim_transport import AsgiCaller, SimTransport


class Network:
    def __init__(self, down_bps: float, up_bps: float, latency_s: float) -> None:
        self.down_bps, self.up_bps, self.latency_s = down_bps, up_bps, latency_s


class Device:
    """The transport's link: a clock that only moves when the device spends time, and a
    network that is down over ``[down_from, down_until)``."""

    def __init__(self, down_from: float = -1.0, down_until: float = -1.0) -> None:
        self.t = 0.0
        self.down_from, self.down_until = down_from, down_until

    def network_up(self, at: float) -> bool:
        return not (self.down_from <= at < self.down_until)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(scope="module")
def app():
    calls: list[tuple[str, int]] = []

    async def echo(request):
        body = await request.body()
        calls.append((request.url.path, len(body)))
        return Response(b"x" * int(request.query_params.get("size", "0")), media_type="application/octet-stream")

    application = Starlette(
        routes=[Route("/echo", echo, methods=["GET", "POST"]), Route("/v1/sessions/s/report", echo, methods=["POST"])]
    )
    application.state.calls = calls
    caller = AsgiCaller(application)
    yield application, caller
    caller.close()


@settings(max_examples=30, deadline=None)
@given(
    up=st.integers(0, 200_000),
    down=st.integers(0, 200_000),
    latency=st.floats(0.0, 0.5),
    down_bps=st.floats(1e5, 1e9),
    up_bps=st.floats(1e5, 1e9),
)
def test_a_request_costs_two_latencies_and_its_bytes_over_the_bandwidth(app, up, down, latency, down_bps, up_bps):
    application, caller = app
    device = Device()
    transport = SimTransport(caller, device, Network(down_bps, up_bps, latency))
    with httpx.Client(transport=transport, base_url="http://fl.sim") as client:
        response = client.post("/echo", params={"size": down}, content=b"y" * up)
    assert response.status_code == 200 and len(response.content) == down
    meter = transport.meter
    assert application.state.calls[-1] == ("/echo", up)
    assert meter.bytes_up >= up and meter.bytes_down >= down
    expected = 2 * latency + 8.0 * meter.bytes_up / up_bps + 8.0 * meter.bytes_down / down_bps
    assert device.t == pytest.approx(expected) and meter.network_s == pytest.approx(expected)


def test_without_a_network_the_request_never_reaches_the_server(app):
    application, caller = app
    before = len(application.state.calls)
    device = Device(down_from=0.0, down_until=100.0)
    transport = SimTransport(caller, device, Network(1e6, 1e6, 0.05))
    with httpx.Client(transport=transport, base_url="http://fl.sim") as client, pytest.raises(httpx.ConnectError):
        client.get("/echo")
    assert len(application.state.calls) == before and transport.meter.failures == 1


def test_an_answer_that_arrives_after_the_network_went_down_is_lost_though_the_server_acted(app):
    application, caller = app
    before = len(application.state.calls)
    device = Device(down_from=0.1, down_until=100.0)  # up when sent; down before 1 MB comes back
    transport = SimTransport(caller, device, Network(1e6, 1e9, 0.05))
    with httpx.Client(transport=transport, base_url="http://fl.sim") as client, pytest.raises(httpx.ReadError):
        client.get("/echo", params={"size": 1_000_000})
    assert len(application.state.calls) == before + 1
    assert transport.meter.bytes_down == 0  # nothing arrived


def test_a_straggler_holds_its_report_back_before_sending_it(app):
    application, caller = app
    device = Device()
    transport = SimTransport(caller, device, Network(1e9, 1e9, 0.0), hold_report=lambda: 600.0)
    with httpx.Client(transport=transport, base_url="http://fl.sim") as client:
        client.post("/echo")
        assert device.t < 1.0  # only reports are held
        client.post("/v1/sessions/s/report", content=b"update")
    assert device.t >= 600.0
    assert application.state.calls[-1] == ("/v1/sessions/s/report", 6)
    assert transport.meter.network_s < 1.0  # the hold is the device's delay, not network time
