"""Devices and operators reach the server through what stands in front of it in a deployment: a
TLS proxy whose certificate comes from the operator's own authority, at a path prefix
(``https://host/fl/`` to the app at ``/``). The authority and certificates are made here with
``cryptography``, the proxy is an ASGI app served by uvicorn over TLS on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from device_runtime import FLRuntime, Outcome, ServerUnreachable
from device_runtime.protocol import RetryPolicy
from example_store import SQLiteExampleStore
from server_stub import AdminClient, ServerThread
from server_stub import ServerUnreachable as OperatorUnreachable
from tests.support import COLLECTION, LoopbackApp, deploy
from tests.tls import issue, make_authority

FAST = RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.002)


NGINX_PAGE = (
    "<html>\r\n<head><title>{status}</title></head>\r\n<body>\r\n<center><h1>{status}</h1></center>\r\n"
    "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)


class PrefixProxy:
    """A reverse proxy: ``/fl/...`` to the upstream's ``/...``, anything else its own 404 page;
    ``seen`` holds the path of every request it took."""

    def __init__(
        self, upstream: str, prefix: str = "/fl", bad_gateway: str | None = None, max_body: int | None = None
    ) -> None:
        """``bad_gateway``: requests whose path ends so get nginx's 502 page, as when the server
        behind is down; ``max_body``: a larger request body gets its 413 (nginx's
        ``client_max_body_size``)."""
        self.upstream, self.prefix, self.bad_gateway, self.max_body = upstream, prefix, bad_gateway, max_body
        self.seen: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, query = scope["path"], scope["query_string"].decode()
        self.seen.append(path)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        page = [(b"content-type", b"text/html")]
        if not path.startswith(self.prefix + "/"):
            status, headers, content = 404, page, NGINX_PAGE.format(status="404 Not Found").encode()
        elif self.max_body is not None and len(body) > self.max_body:
            status, headers, content = 413, page, NGINX_PAGE.format(status="413 Request Entity Too Large").encode()
        elif self.bad_gateway is not None and path.endswith(self.bad_gateway):
            status, headers, content = 502, page, NGINX_PAGE.format(status="502 Bad Gateway").encode()
        else:
            forwarded = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
            async with httpx.AsyncClient(base_url=self.upstream) as client:
                answer = await client.request(
                    scope["method"],
                    path[len(self.prefix) :] + (f"?{query}" if query else ""),
                    headers=forwarded,
                    content=body,
                )
            status, content = answer.status_code, answer.content
            drop = ("content-length", "content-encoding", "transfer-encoding", "connection")
            headers = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in drop]
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


@pytest.fixture(scope="module")
def authority(tmp_path_factory) -> Iterator[tuple[Path, tuple]]:
    folder = tmp_path_factory.mktemp("ca")
    yield folder, make_authority(folder)


def _store(tmp_path: Path, digits) -> SQLiteExampleStore:
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])])
    return store


def test_a_device_and_an_operator_trust_the_operators_authority_behind_a_tls_proxy_at_a_path_prefix(
    tmp_path, digits, authority, monkeypatch
):
    """``$SSL_CERT_FILE`` names the authority that issued the proxy's certificate: the device read
    certifi's bundle alone, so every session failed at its check-in ("not one this device trusts")
    while ``fedfleet status`` with the same environment reached the server. Every request keeps
    the URL's path prefix (check-in, downloads, report)."""
    folder, ca = authority
    with ServerThread(tmp_path / "server.db") as server:
        with server.admin() as admin:
            deploy(admin, goal_count=1)
        proxy = PrefixProxy(server.url)
        with LoopbackApp(proxy, cert=issue(folder, ca, "localhost"), lifespan="off") as front:
            url = f"https://localhost:{front.port}/fl/"
            store = _store(tmp_path, digits)
            with FLRuntime("digits", url, store, cache_dir=tmp_path / "c0", retry=FAST) as stranger:
                with pytest.raises(ServerUnreachable, match="an authority not trusted here") as refused:
                    stranger.run_session()
            assert not refused.value.retryable and proxy.seen == []
            assert "tls=ClientTLS(ca_file=...)" in str(refused.value) and "$SSL_CERT_FILE" in str(refused.value)
            monkeypatch.setenv("SSL_CERT_FILE", str(folder / "ca.pem"))
            with FLRuntime("digits", url, store, cache_dir=tmp_path / "c1", retry=FAST) as runtime:
                result = runtime.run_session()
            assert result.outcome is Outcome.COMPLETED, result
            with AdminClient(url, admin_key=server.admin_key) as admin:
                assert admin.status("digits")["tasks"]
    assert len(proxy.seen) >= 5 and all(path.startswith("/fl/v1/") for path in proxy.seen), proxy.seen


@pytest.mark.parametrize(
    ("name", "days", "said"),
    [
        ("localhost", (-10, -1), "its certificate has expired"),
        ("other.example", (-1, 30), "its certificate is for another name than the URL's host"),
    ],
)
def test_a_refused_certificate_is_said_for_what_it_is_by_the_device_and_the_operators_client(
    tmp_path, authority, monkeypatch, name, days, said
):
    """Each refusal said "self-signed, expired or for another name" on a device, and "fedfleet
    server speaks plain HTTP: give http://..." in the operators' client: now each says which, at
    the first attempt, in one line."""
    folder, ca = authority
    monkeypatch.setenv("SSL_CERT_FILE", str(folder / "ca.pem"))
    proxy = PrefixProxy("http://127.0.0.1:9")
    with LoopbackApp(proxy, cert=issue(folder, ca, name, days=days), lifespan="off") as front:
        url = f"https://localhost:{front.port}/fl"
        with FLRuntime("digits", url, SQLiteExampleStore(tmp_path / "a.db"), retry=FAST) as runtime:
            with pytest.raises(ServerUnreachable, match=said) as refused:
                runtime.run_session()
        assert not refused.value.retryable and "\n" not in str(refused.value)
        with AdminClient(url, admin_key="k" * 32) as admin, pytest.raises(OperatorUnreachable, match=said) as cli:
            admin.status("digits")
        assert "plain HTTP" not in str(cli.value)
    assert proxy.seen == []


def test_a_rounds_listings_next_page_link_leads_to_the_older_rounds_behind_a_path_prefix(tmp_path):
    """The ``Link`` of a page with older rounds named the app's own path, ``/v1/populations/...``:
    a script that resolved it against the URL it asked (``https://host/fl/v1/...``) was sent to
    ``https://host/v1/...``, the proxy's 404. A reference relative to the request's URL keeps the
    prefix, and the query's ``task`` too."""
    with ServerThread(tmp_path / "server.db") as server:
        with server.admin() as admin:
            deploy(admin, "p", goal_count=1)
        store = server.service.store
        task = store.tasks("p")[0].id
        for number in range(1, 6):
            store.record_round(task, number, 1, "abandoned", {"selected": 0}, float(number), number + 0.5)
        proxy = PrefixProxy(server.url)
        with LoopbackApp(proxy, lifespan="off") as front:
            headers = {"Authorization": f"Bearer {server.admin_key}"}
            with httpx.Client(headers=headers, timeout=10) as http:
                page = http.get(f"{front.url}/fl/v1/populations/p/rounds", params={"task": "train", "last": 2})
                seen = [[r["round"] for r in page.json()["rounds"]]]
                while "next" in page.links:
                    page = http.get(page.url.join(page.links["next"]["url"]))  # as RFC 3986 resolves it
                    assert page.status_code == 200, page.text
                    seen.append([r["round"] for r in page.json()["rounds"]])
            assert seen == [[4, 5], [2, 3], [1]]
            with AdminClient(f"{front.url}/fl", admin_key=server.admin_key) as operator:
                assert [r["round"] for r in operator.rounds("p", last=1)] == [5]
    assert all(path.startswith("/fl/v1/") for path in proxy.seen), proxy.seen


@pytest.mark.parametrize("base", ["https://fl.example", "https://gateway.example/fl"])
def test_a_model_download_is_held_to_the_resource_bound_behind_a_path_prefix(base):
    """A plan or checkpoint may be up to ``MAX_RESOURCE_BYTES``; behind a proxy at a path prefix
    its download (``/fl/v1/resources/ID``) was held to the 64 MiB of any other answer, and a
    100 MiB model was refused unread on every device of that deployment."""
    from device_runtime import ProtocolError
    from device_runtime.protocol import MAX_ANSWER_BYTES, MAX_RESOURCE_BYTES, answer_bound

    bound = answer_bound(lambda: 0.0, 10.0)
    size = str(100 << 20)
    assert MAX_ANSWER_BYTES < int(size) < MAX_RESOURCE_BYTES
    bound(
        httpx.Response(200, headers={"content-length": size}, request=httpx.Request("GET", f"{base}/v1/resources/ab"))
    )
    with pytest.raises(ProtocolError, match="more than the"):
        bound(
            httpx.Response(
                200, headers={"content-length": size}, request=httpx.Request("GET", f"{base}/v1/populations")
            )
        )


def test_a_proxys_error_page_is_said_as_one_and_not_as_the_servers_answer(tmp_path, digits):
    """A URL without the proxy's path prefix reached the proxy's own 404 page, and a server down
    behind the proxy its 502 page: the device said the page's first 200 characters of HTML (or
    "server error 502" alone), the operators' client its 300; each now says in one line that the
    answer did not come from the FL server, the page's title, and what to check."""
    from device_runtime import ProtocolError
    from server_stub import AdminError

    with ServerThread(tmp_path / "server.db") as server:
        with server.admin() as admin:
            deploy(admin, goal_count=1)
        with LoopbackApp(PrefixProxy(server.url, bad_gateway="/report")) as front:
            store = _store(tmp_path, digits)
            with FLRuntime("digits", front.url, store, cache_dir=tmp_path / "c0", retry=FAST) as runtime:
                with pytest.raises(
                    ProtocolError, match="HTTP 404 came from something other than the FL server"
                ) as lost:
                    runtime.run_session()
            assert "'404 Not Found'" in str(lost.value) and "prefix" in str(lost.value) and "<" not in str(lost.value)
            with AdminClient(front.url, admin_key=server.admin_key) as admin, pytest.raises(AdminError) as refused:
                admin.status("digits")
            assert "'404 Not Found'" in str(refused.value) and "<" not in str(refused.value)
            with FLRuntime("digits", front.url + "/fl", store, cache_dir=tmp_path / "c1", retry=FAST) as runtime:
                with pytest.raises(ServerUnreachable, match="'502 Bad Gateway'") as down:
                    runtime.run_session()
            assert "down or restarting" in str(down.value) and "\n" not in str(down.value)


def _ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_server_on_the_ipv6_loopback_is_reached_at_its_bracketed_url(tmp_path):
    """``ServerThread(host="::1")`` gave ``http://::1:PORT``, which is no URL: its ``admin()`` and
    every device given its ``url`` were refused as such."""
    from device_runtime.protocol import ProtocolClient

    with ServerThread(tmp_path / "server.db", host="::1") as server:
        assert server.url == f"http://[::1]:{server.port}"
        with server.admin() as admin:
            admin.create_population("digits")
        client = ProtocolClient(server.url + "/", retry=FAST)
        try:
            assert client.eligibility_info("digits").task is None
        finally:
            client.close()


def test_the_environments_proxy_is_named_by_the_operators_client_and_not_taken_by_a_device(tmp_path, monkeypatch):
    """``$HTTP_PROXY`` naming a proxy that does not answer: the operators' client (httpx's, which
    follows it) said "no answer from the server ... check that fedfleet server runs there" for a
    server that ran there; it names the proxy now. A device's requests go straight to the server's
    URL whatever the environment names (its own sockets, bounded by its deadlines)."""
    from device_runtime.protocol import ProtocolClient

    for name in ("NO_PROXY", "no_proxy", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as closed:  # nothing listens there once it is closed
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with ServerThread(tmp_path / "server.db") as server:
        monkeypatch.setenv("HTTP_PROXY", dead)
        with server.admin() as admin, pytest.raises(OperatorUnreachable, match="through the proxy") as refused:
            admin.populations()
        assert f"{dead} ($HTTP_PROXY)" in str(refused.value) and "$NO_PROXY" in str(refused.value)
        client = ProtocolClient(server.url, retry=FAST)
        try:
            assert client.eligibility_info("digits").task is None
        finally:
            client.close()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        with server.admin() as admin:
            assert admin.populations() == []


def test_a_report_larger_than_a_proxys_body_limit_is_said_and_not_taken_for_the_servers_refusal(tmp_path, digits):
    """A proxy's 413 page for a report past its body limit (nginx's default is 1 MiB) ended the
    session ``REPORT_REJECTED`` with no code, as if the server had refused the update, and nothing
    said why; the server never saw it. The session now ends in ``ServerUnreachable`` saying so,
    not retryable: the same upload is refused until the proxy's limit changes."""
    with ServerThread(tmp_path / "server.db") as server:
        with server.admin() as admin:
            deploy(admin, goal_count=1)
        proxy = PrefixProxy(server.url, max_body=1024)  # a check-in's body passes; the update does not
        with LoopbackApp(proxy) as front:
            store = _store(tmp_path, digits)
            with FLRuntime("digits", front.url + "/fl", store, cache_dir=tmp_path / "c", retry=FAST) as runtime:
                with pytest.raises(ServerUnreachable, match="'413 Request Entity Too Large'") as refused:
                    runtime.run_session()
    assert not refused.value.retryable and "client_max_body_size" in str(refused.value)
    assert "/report" in str(refused.value) and "\n" not in str(refused.value)
    assert sum(path.endswith("/report") for path in proxy.seen) == 1
