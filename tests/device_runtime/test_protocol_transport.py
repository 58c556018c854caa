"""The protocol client's transport is pluggable, and a retried attested check-in signs a fresh
nonce: a check-in whose answer was lost (the server consumed the nonce) is not refused as a replay.
A TLS mistake (an untrusted certificate, https:// to a plain HTTP server) is said at the first attempt."""

from __future__ import annotations

import http.server
import logging
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import FLRuntime, Outcome, ProtocolError
from device_runtime.protocol import RetryPolicy, shared_tls_context
from emulator import AttestationAuthority
from example_store import SQLiteExampleStore
from server_stub import AttestationVerifier, NonceRegistry, RateLimiter, ServerThread
from tests.support import COLLECTION, deploy


class LoseFirstCheckinAnswer(httpx.BaseTransport):
    """Real HTTP, except that the first check-in's answer is lost after the server handled it."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.checkins: list[dict] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/checkin"):
            response.read()
            self.checkins.append(response.json() if response.status_code < 500 else {})
            if len(self.checkins) == 1:
                raise httpx.ReadTimeout("the answer was lost", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def test_a_retried_attested_checkin_signs_a_fresh_nonce(tmp_path, digits):
    authority = AttestationAuthority.generate()
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=60), RateLimiter(burst=10, rate_per_s=1)
    )
    with ServerThread(tmp_path / "server.db", verifier=verifier) as server, server.admin() as admin:
        deploy(admin, goal_count=1, over_selection=3.0)
        store = SQLiteExampleStore(tmp_path / "app.db")
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:20], digits.y_train[:20])))
        transport = LoseFirstCheckinAnswer()
        runtime = FLRuntime(
            "digits",
            server.url,
            store,
            transport=transport,
            retry=RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02),
            attestor=authority.new_device_attestor("emulated-pixel", time.time()),
        )
        result = runtime.run_session()
        runtime.close()
    # The lost attempt was accepted by the server; the retry was a new, accepted check-in, not a replay.
    assert [c.get("status") for c in transport.checkins] == ["accepted", "accepted"]
    assert result.outcome is Outcome.COMPLETED


def test_every_client_shares_one_tls_context():
    assert shared_tls_context() is shared_tls_context()
    from device_runtime.protocol import ProtocolClient

    a, b = ProtocolClient("http://127.0.0.1:1"), ProtocolClient("https://127.0.0.1:1")
    try:
        assert a.http._transport._pool._ssl_context is b.http._transport._pool._ssl_context is shared_tls_context()
    finally:
        a.close()
        b.close()


def test_before_any_rejection_the_retry_delay_is_jittered_inside_the_default_window(tmp_path):
    import random

    from device_runtime.runtime import DEFAULT_RETRY_WINDOW_S

    runtime = FLRuntime("p", "http://127.0.0.1:9", SQLiteExampleStore(tmp_path / "a.db"), rng=random.Random(1))
    delays = [runtime.next_retry_delay() for _ in range(200)]
    runtime.close()
    lo, hi = DEFAULT_RETRY_WINDOW_S
    assert all(lo <= d <= hi for d in delays) and max(delays) - min(delays) > (hi - lo) / 2


class LoseFirstReportAnswer(httpx.HTTPTransport):
    """Real HTTP, except that the first report's answer is lost after the server took the update."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/report"):
            response.read()
            self.reports.append(response.status_code)
            if len(self.reports) == 1:
                raise httpx.ReadError("the connection dropped before the answer", request=request)
        return response


def test_a_report_whose_answer_was_lost_completes_once(tmp_path, server, admin, digits):
    """The server took the update and the answer was lost: the retry was refused as a second
    report of the session (409 DUPLICATE_REPORT), and the device kept the session as rejected
    (``-v[]+#``): not counted as taking part by its eligibility policies, its resumption token not
    moved, its examples trained and reported again in the next session."""
    from device_runtime import OpStatsStore

    deploy(admin, goal_count=5)
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:20], digits.y_train[:20])))
    transport = LoseFirstReportAnswer()
    with OpStatsStore(tmp_path / "app.db") as opstats:
        with FLRuntime(
            "digits",
            server.url,
            store,
            opstats=opstats,
            transport=transport,
            retry=RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02),
        ) as runtime:
            result = runtime.run_session()
        assert [s.shape for s in opstats.sessions()] == ["-v[]+^"]
    store.close()
    assert transport.reports == [200, 409]  # the server took one update, and refused it again
    assert result.outcome is Outcome.COMPLETED and result.rejection_code is None
    assert admin.status("digits")["current_round"]["reported"] == 1


def test_a_refusal_a_later_session_may_not_meet_is_retryable_and_one_it_would_meet_again_is_not(server, admin):
    """A round closed under the session (here an operator's stop; a deadline alike) answers its
    report 409 ``REPORT_LATE``, and an aborted session ``SESSION_CLOSED``: every 4xx was read as
    final, so an app that branches on ``retryable`` logged them as needing a fix. The device's own
    mistakes (a malformed update) stay final."""
    import numpy as np

    from device_runtime import PlanExecutor, encode_checkpoint
    from device_runtime.protocol import ProtocolClient

    plan, _ = deploy(admin, goal_count=3, over_selection=1.0, selection_timeout_s=60, report_timeout_s=60)
    update = {name: np.zeros(shape, dtype) for name, (shape, dtype) in PlanExecutor(plan).client_update_spec().items()}
    update["num_examples"] = update["count"] = np.array(10, np.float32)
    client = ProtocolClient(server.url, retry=RetryPolicy(attempts=1))
    late, aborted, malformed = (client.checkin("digits", "1.31.1") for _ in range(3))

    def refused(call) -> ProtocolError:
        with pytest.raises(ProtocolError) as caught:
            call()
        return caught.value

    client.abort(aborted, "the app was closed")
    said = refused(lambda: client.report(aborted, encode_checkpoint(update)))
    assert (said.status, said.code, said.retryable) == (409, "SESSION_CLOSED", True)
    said = refused(lambda: client.report(malformed, b"not a checkpoint"))
    assert (said.status, said.retryable) == (422, False)
    admin.stop_task("digits", "train")  # the round closes with the session mid-way
    said = refused(lambda: client.report(late, encode_checkpoint(update)))
    assert (said.status, said.code, said.retryable) == (409, "REPORT_LATE", True)
    client.close()


def _self_signed_tls_server(folder) -> tuple[str, list[int]]:
    """A TLS server on a loopback port whose certificate no authority the device trusts issued; the list counts the
    handshakes it was offered."""
    import http.server
    import ssl
    import threading

    from tests.tls import issue, make_authority

    cert_file, key_file = issue(folder, make_authority(folder), "127.0.0.1")  # an authority the device never met
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    offered: list[int] = []

    class Server(http.server.HTTPServer):
        def get_request(self):
            offered.append(1)
            sock, address = self.socket.accept()
            return context.wrap_socket(sock, server_side=True), address

        def handle_error(self, request, client_address) -> None:  # the device's refused handshakes
            pass

    server = Server(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"https://127.0.0.1:{server.server_address[1]}", offered


def test_a_tls_mistake_in_the_servers_url_or_certificate_is_said_at_once(tmp_path, server):
    """A server whose certificate the device does not trust, or an https:// URL of a plain HTTP
    server: each attempt failed alike and the app read, after every retry, that the server 'did
    not answer'. The first attempt says what is wrong."""
    from device_runtime import ServerUnreachable
    from device_runtime.protocol import ProtocolClient

    untrusted, offered = _self_signed_tls_server(tmp_path)
    cases = [
        (untrusted, "its certificate (is self-signed|was issued by an authority not trusted here)"),
        (server.url.replace("http://", "https://"), "it does not speak TLS on this port: is its URL http://"),
    ]
    for url, said in cases:
        client = ProtocolClient(url, retry=RetryPolicy(attempts=4))
        with pytest.raises(ServerUnreachable, match=f"could not be reached over TLS: {said}") as refused:
            client.checkin("digits", "1.31.1")
        assert not refused.value.retryable  # the trust store or the URL must change first
        client.close()
    assert len(offered) == 1  # one handshake: a certificate no retry changes is not tried again


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Any server: every request is answered 404 (the device logs it, and says what it was told)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_password_in_the_server_url_is_in_no_message_and_no_log_line(tmp_path, caplog):
    """``https://user:secret@host/``: the device's messages and logs named the URL whole."""
    from device_runtime import InvalidSetting, ServerUnreachable
    from device_runtime.protocol import ProtocolClient
    from server_stub.serve import free_port

    caplog.set_level(logging.DEBUG)
    fast = RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.001)
    url = f"http://operator:hunter2@127.0.0.1:{free_port()}/"  # nothing listens there
    with (
        FLRuntime("p", url, SQLiteExampleStore(tmp_path / "a.db"), cache_dir=tmp_path / "cache", retry=fast) as runtime,
        pytest.raises(ServerUnreachable) as unreachable,
    ):
        runtime.run_session()
    assert "at http://operator:***@127.0.0.1:" in str(unreachable.value)
    with pytest.raises(InvalidSetting) as not_a_url:  # no http://: the refusal names the URL, and the one to give
        ProtocolClient("operator:hunter2@127.0.0.1:8000")
    assert "'operator:***@127.0.0.1:8000' is not a server URL" in str(not_a_url.value)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ProtocolClient(f"http://operator:hunter2@127.0.0.1:{server.server_address[1]}", retry=fast)
    try:
        with pytest.raises(ProtocolError):  # answered: httpx logs the request, URL and all
            client.checkin("p", "1.31.1")
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    assert any("HTTP Request: POST http://127.0.0.1:" in r.getMessage() for r in caplog.records)
    for said in (str(unreachable.value), str(not_a_url.value), *(r.getMessage() for r in caplog.records)):
        assert "hunter2" not in said, said


@settings(max_examples=150, deadline=None)
@given(password=st.text(alphabet="ab1/?#@:%.", min_size=1, max_size=12))
def test_a_password_holding_a_url_delimiter_is_shown_as_stars_or_refused_without_it(password):
    """A password typed with '/', '?', '#' or '@' in it (``https://op:pa/ss@host``) cut the URL's
    host short as it is read, and the refusal, or the device's messages about a URL read with the
    rest of the password as its path, showed it."""
    from device_runtime import InvalidSetting
    from device_runtime.protocol import checked_server_url, redacted_url

    url = f"https://operator:Zq{password}@fl.example:8443/"
    assert redacted_url(url) == "https://operator:***@fl.example:8443/"
    assert redacted_url("https://ghp_Zq0token@fl.example/") == "https://***@fl.example/"  # a token as the user
    try:
        checked = checked_server_url(url)
    except InvalidSetting as exc:
        assert f"Zq{password}" not in str(exc) and "operator:***@fl.example:8443/" in str(exc), str(exc)
    else:  # taken only as the URL of fl.example, with the password its userinfo
        assert httpx.URL(checked).host == "fl.example"


class _BasicAuthGateway:
    """A gateway in front of the server that lets through only requests with its basic-auth
    credentials and passes ``Authorization`` on, as nginx's ``auth_basic`` does, or with
    ``rewrite`` replaces it by a bearer token of its own, as an identity proxy does."""

    def __init__(self, app, user: str, password: str, *, rewrite: bool = False, drop_token: bool = False) -> None:
        """``drop_token``: the request goes on without ``X-FL-Token``, as a server of a release
        before it read it (only ``Authorization``, here the gateway's basic auth)."""
        import base64

        self.app = app
        self.expected = b"Basic " + base64.b64encode(f"{user}:{password}".encode())
        self.rewrite = rewrite
        self.drop_token = drop_token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["type"] == "http" and self.rewrite:
            headers = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
            scope = {**scope, "headers": [*headers, (b"authorization", b"Bearer the-gateways-own-identity-token")]}
        if scope["type"] == "http" and self.drop_token:
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"x-fl-token"]}
        await self.app(scope, receive, send)


@pytest.mark.parametrize("rewrite", [False, True], ids=["passes-authorization-on", "rewrites-it"])
def test_a_device_and_an_operator_reach_a_server_behind_a_gateway_that_takes_the_urls_credentials(
    tmp_path, digits, rewrite
):
    """``http://user:secret@gateway/``: the URL's credentials go as basic auth in ``Authorization``,
    where every session request carries its token too; the token then went nowhere (the basic auth
    replaced it) and every session ended at its plan download, MISSING_TOKEN, as did every operator
    call. The token now goes in ``X-FL-Token`` beside the gateway's credentials."""
    from server_stub import AdminClient, AdminKeys, FLService, ServerStore
    from server_stub.app import create_app
    from tests.support import LoopbackApp

    admin_key = "gateway-test-admin-key-0123456789abcdef"
    store_of_server = ServerStore(f"sqlite:///{tmp_path / 'server.db'}")
    service = FLService(store_of_server)
    app = _BasicAuthGateway(create_app(service, admin_keys=AdminKeys([admin_key])), "device", "s3cret", rewrite=rewrite)
    with LoopbackApp(app) as gateway:
        behind = gateway.url.replace("http://", "http://device:s3cret@")
        with AdminClient(behind, admin_key=admin_key) as admin:
            deploy(admin)
            assert admin.status("digits")["tasks"]
        store = SQLiteExampleStore(tmp_path / "app.db")
        store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])])
        with FLRuntime("digits", behind, store, cache_dir=tmp_path / "cache") as runtime:
            result = runtime.run_session()
        assert result.outcome is Outcome.COMPLETED, result
        fast = RetryPolicy(attempts=1, base_delay_s=0.001, max_delay_s=0.001)
        with FLRuntime("digits", gateway.url, store, cache_dir=tmp_path / "c2", retry=fast) as stranger:
            with pytest.raises(ProtocolError, match="401"):  # the gateway's own refusal: no credentials
                stranger.run_session()
    store_of_server.close()


def test_a_device_whose_token_the_server_does_not_read_beside_the_urls_credentials_is_told_why(tmp_path, digits):
    """A server of a release before ``X-FL-Token`` reads the token in ``Authorization`` only, which
    the URL's credentials take (here a gateway drops the header, as such a server ignores it): its
    MISSING_TOKEN asked for 'Authorization: Bearer', which the device cannot send there. The
    session's rejection says which header the server did not read, and why."""
    from server_stub import AdminClient, AdminError, AdminKeys, FLService, ServerStore
    from server_stub.app import create_app
    from tests.support import LoopbackApp

    admin_key = "gateway-test-admin-key-0123456789abcdef"
    store_of_server = ServerStore(f"sqlite:///{tmp_path / 'server.db'}")
    app = create_app(FLService(store_of_server), admin_keys=AdminKeys([admin_key]))
    with (
        LoopbackApp(app) as server,
        LoopbackApp(_BasicAuthGateway(app, "device", "s3cret", drop_token=True)) as gateway,
    ):
        with AdminClient(server.url, admin_key=admin_key) as admin:
            deploy(admin)
        store = SQLiteExampleStore(tmp_path / "app.db")
        store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])])
        behind = gateway.url.replace("http://", "http://device:s3cret@")
        with FLRuntime("digits", behind, store, cache_dir=tmp_path / "cache") as runtime:
            result = runtime.run_session()
        with AdminClient(behind, admin_key=admin_key) as operator, pytest.raises(AdminError) as refused:
            operator.status("digits")
    store_of_server.close()
    assert refused.value.code == "ADMIN_KEY_REQUIRED"
    assert "did not read the admin key sent in X-FL-Token" in str(refused.value), refused.value
    assert (result.outcome, result.rejection_code) == (Outcome.REPORT_REJECTED, "MISSING_TOKEN")
    said = result.events[-1].detail["detail"]
    assert "did not read the session token sent in X-FL-Token" in said, said
    assert "a server of a release before X-FL-Token" in said and "Authorization: Bearer" not in said
