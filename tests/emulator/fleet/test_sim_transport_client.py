"""The simulation's lean httpx client: the SDK's ``ProtocolClient`` sends through it into the
real server's ASGI app, and the server and the network model see the bytes an ``httpx.Client``
would have sent."""

from __future__ import annotations

import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import ProtocolError, ServerUnreachable
from device_runtime.protocol import ProtocolClient, RetryPolicy
from device_runtime.wire import CheckinAccepted, CheckinRejected
from emulator.fleet.sim_transport import (
    DEFAULT_HEADERS,
    AsgiCaller,
    LeanClient,
    SimTransport,
    WireRequest,
    wire_request,
)
from server_stub.admin_auth import AdminKeys
from server_stub.app import create_app
from server_stub.persistence import ServerStore
from server_stub.service import FLService


class Network:
    down_bps, up_bps, latency_s = 1e6, 1e6, 0.05


class Device:
    def __init__(self, network_up: bool = True) -> None:
        self.t, self.up = 0.0, network_up

    def network_up(self, at: float) -> bool:
        return self.up

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    store = ServerStore(tmp_path_factory.mktemp("server") / "server.db")
    service = FLService(store, rng=random.Random(0))
    service.create_population("pop")
    keys, _ = AdminKeys.generate()
    caller = AsgiCaller(create_app(service, admin_keys=keys, offload=False))
    yield caller
    caller.close()
    store.close()


def _checkin(caller: AsgiCaller, lean: bool) -> tuple[CheckinAccepted | CheckinRejected, SimTransport, Device]:
    device = Device()
    transport = SimTransport(caller, device, Network())
    http = LeanClient(transport) if lean else httpx.Client(transport=transport)
    client = ProtocolClient("http://fl.sim", client=http, sleep=device.sleep)  # type: ignore[arg-type]
    answer = client.checkin("pop", "1.20.0")
    return answer, transport, device


def test_the_lean_client_sends_what_an_httpx_client_sends(caller):
    lean, lean_transport, lean_device = _checkin(caller, lean=True)
    full, full_transport, full_device = _checkin(caller, lean=False)
    assert lean == full and lean.status == "rejected"
    assert lean_transport.meter.bytes_up == full_transport.meter.bytes_up > 0
    assert lean_transport.meter.bytes_down == full_transport.meter.bytes_down > 0
    assert lean_device.t == full_device.t > 0


def test_errors_reach_the_protocol_client_as_from_httpx(caller):
    device = Device(network_up=False)
    transport = SimTransport(caller, device, Network())
    client = ProtocolClient(
        "http://fl.sim",
        client=LeanClient(transport),
        retry=RetryPolicy(attempts=2),  # type: ignore[arg-type]
        sleep=device.sleep,
    )
    with pytest.raises(ServerUnreachable):
        client.checkin("pop", "1.20.0")
    assert transport.meter.failures == 2
    answer = ProtocolClient("http://fl.sim", client=LeanClient(SimTransport(caller, Device(), Network())))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as refused:
        answer.checkin("pop", "not-a-version")
    assert (refused.value.status, refused.value.code) == (400, "BAD_RUNTIME_VERSION")


_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    method=st.sampled_from(["GET", "POST"]),
    path=st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), min_size=1, max_size=4),
    body=st.one_of(st.none(), st.binary(max_size=64), _JSON.map(lambda j: ("json", j))),
    params=st.one_of(
        st.none(),
        st.dictionaries(
            st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.from_regex(r"[0-9.-]{1,8}", fullmatch=True), max_size=3
        ),
    ),
    headers=st.dictionaries(st.sampled_from(["Authorization", "Content-Type", "X-Stats"]), _TEXT, max_size=3),
)
def test_a_wire_request_is_the_request_httpx_would_build(method, path, body, params, headers):
    url = "http://fl.sim/" + "/".join(path)
    content = body if isinstance(body, bytes) else None
    json = body[1] if isinstance(body, tuple) else None
    merged = DEFAULT_HEADERS + list(headers.items())
    ours = wire_request(method, url, content=content, json=json, params=params or None, headers=merged)
    theirs = WireRequest.from_httpx(
        httpx.Request(method, url, content=content, json=json, params=params or None, headers=merged)
    )
    assert ours == theirs
    assert ours.size() == theirs.size()
