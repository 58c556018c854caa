"""The server serving HTTPS itself (``fedfleet server --tls-cert --tls-key``), and admitting only
clients with a certificate from the operator's authority (``--tls-client-ca``, mutual TLS): a real
uvicorn on loopback, certificates made with ``cryptography`` (``tests.tls``). Devices and operators
give theirs with ``ClientTLS``; every refusal is one line saying what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime import ClientTLS, FLRuntime, Outcome, ProtocolError, RetryPolicy, ServerUnreachable
from example_store import SQLiteExampleStore
from server_stub import AdminError, ServerThread
from server_stub import ServerUnreachable as OperatorUnreachable
from server_stub.serve import certificate_warning, server_tls_context
from tests.support import COLLECTION, deploy
from tests.tls import issue, make_authority

FAST = RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.002)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path | tuple[Path, Path]]:
    """The operator's authority, the server's certificate, and clients' certificates: good,
    expired, and one another authority issued."""
    folder, elsewhere = tmp_path_factory.mktemp("ca"), tmp_path_factory.mktemp("other-ca")
    ca, other = make_authority(folder), make_authority(elsewhere)
    return {
        "ca": folder / "ca.pem",
        "server": issue(folder, ca, "localhost"),
        "device": issue(folder, ca, "device", client=True),
        "expired": issue(folder, ca, "old-device", client=True, days=(-10, -1)),
        "stranger": issue(elsewhere, other, "stranger", client=True),
    }


def _one_line(exc: BaseException) -> str:
    said = str(exc)
    assert "\n" not in said and "Traceback" not in said, said
    return said


def test_a_server_with_a_client_authority_admits_only_clients_with_a_certificate_it_issued(
    tmp_path, digits, pki, monkeypatch, capsys
):
    """A device or operator without a certificate is answered 401 CLIENT_CERTIFICATE_REQUIRED
    saying what to give; one whose certificate is expired or another authority's is closed at the
    handshake, and the client says that is what such a close means; one with its certificate runs
    a session, and ``fedfleet status`` with ``--tls-cert`` reads the population."""
    from emulator.cli import commands as cli

    tls = server_tls_context(*pki["server"], client_ca=pki["ca"])
    store = SQLiteExampleStore(tmp_path / "app.db")
    store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:20], digits.y_train[:20])])
    device_tls = ClientTLS(*pki["device"], ca_file=pki["ca"])
    with ServerThread(tmp_path / "server.db", host="localhost", tls=tls) as server:
        assert server.url.startswith("https://localhost:")
        with server.admin(tls=device_tls) as admin:
            deploy(admin, goal_count=1)

        def session(tls: ClientTLS):
            with FLRuntime("digits", server.url, store, retry=FAST, tls=tls) as runtime:
                return runtime.run_session()

        assert session(device_tls).outcome is Outcome.COMPLETED
        with pytest.raises(ProtocolError) as none:
            session(ClientTLS(ca_file=pki["ca"]))
        assert (none.value.code, none.value.retryable) == ("CLIENT_CERTIFICATE_REQUIRED", False)
        assert "tls=ClientTLS(cert_file, key_file)" in _one_line(none.value)
        for refused in ("expired", "stranger"):
            with pytest.raises(ServerUnreachable) as closed:
                session(ClientTLS(*pki[refused], ca_file=pki["ca"]))
            assert "is this client's certificate valid now, and issued by an authority" in _one_line(closed.value)

        with server.admin(tls=ClientTLS(ca_file=pki["ca"])) as stranger, pytest.raises(AdminError) as unnamed:
            stranger.status("digits")
        assert unnamed.value.code == "CLIENT_CERTIFICATE_REQUIRED" and "--tls-cert FILE --tls-key FILE" in str(unnamed)

        monkeypatch.setenv("FEDFLEET_ADMIN_KEYS", server.admin_key)
        monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))
        status = ["status", "--server", server.url, "--population", "digits"]
        assert cli.main([*status, "--tls-cert", str(pki["device"][0]), "--tls-key", str(pki["device"][1])]) == 0
        assert capsys.readouterr().out.startswith("population digits")
        for given, code, said in [
            ([], 1, "(CLIENT_CERTIFICATE_REQUIRED); give the operator's certificate: fedfleet's --tls-cert FILE"),
            (["--tls-cert", str(pki["stranger"][0]), "--tls-key", str(pki["stranger"][1])], 2, "closed the connection"),
            (["--tls-key", str(pki["device"][1])], 2, "--tls-key is the key of --tls-cert"),
        ]:
            assert cli.main([*status, *given]) == code, given
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and said in err, (given, err)
    store.close()


def test_a_device_refuses_a_server_certificate_that_expired_and_the_server_says_so_at_its_start(tmp_path, pki):
    folder = tmp_path / "ca"
    folder.mkdir()
    ca = make_authority(folder)
    expired = issue(folder, ca, "localhost", days=(-10, -1))
    assert "expired on" in (certificate_warning(expired[0]) or "") and certificate_warning(pki["server"][0]) is None
    with ServerThread(tmp_path / "server.db", host="localhost", tls=server_tls_context(*expired)) as server:
        with FLRuntime(
            "digits",
            server.url,
            SQLiteExampleStore(tmp_path / "a.db"),
            retry=FAST,
            tls=ClientTLS(ca_file=folder / "ca.pem"),
        ) as runtime:
            with pytest.raises(ServerUnreachable, match="its certificate has expired") as refused:
                runtime.run_session()
        assert not refused.value.retryable and _one_line(refused.value)
        with server.admin(tls=ClientTLS(ca_file=folder / "ca.pem")) as admin:
            with pytest.raises(OperatorUnreachable, match="its certificate has expired"):
                admin.populations()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--tls-cert", "missing.pem"], "--tls-cert missing.pem: no such file"),
        (["--tls-cert", "{server}", "--tls-key", "{device_key}"], "is not the key of the certificate in --tls-cert"),
        (["--tls-cert", "{ca}"], "is not PEM that holds a certificate and its key"),
        (["--tls-key", "{server_key}"], "--tls-key applies to serving HTTPS: give the server's certificate"),
        (
            ["--tls-cert", "{server}", "--tls-key", "{server_key}", "--tls-client-ca", "{server_key}"],
            "not PEM certificates",
        ),
    ],
)
def test_the_command_refuses_tls_files_it_cannot_use_in_one_line_before_it_opens_its_database(
    tmp_path, pki, capsys, given, said
):
    from server_stub.cli import main

    names = {
        "server": pki["server"][0],
        "server_key": pki["server"][1],
        "device_key": pki["device"][1],
        "ca": pki["ca"],
    }
    argv = [g.format(**names) for g in given]
    assert main(["--db", str(tmp_path / "fl.db"), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "fl.db").exists()


def test_sockets_that_never_begin_their_tls_handshake_give_way_within_the_header_timeout(tmp_path, pki):
    """A connection counts against ``--max-connections`` from its accept, and over TLS reaches no
    protocol the cap could close until its handshake is done: four sockets that sent nothing held
    a server allowed four connections for asyncio's 60 s, every other client's handshake timed out."""
    import socket
    import ssl
    import time

    import httpx

    from server_stub import HttpLimits

    limits = HttpLimits(header_timeout_s=0.5, max_connections=4)
    with ServerThread(
        tmp_path / "s.db", host="localhost", tls=server_tls_context(*pki["server"]), http_limits=limits
    ) as s:
        silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        started = time.monotonic()
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        assert httpx.get(f"{s.url}/v1/health", verify=context, timeout=5).status_code == 200
        assert time.monotonic() - started < 3
        for sock in silent:
            sock.close()


def test_a_connection_refused_while_every_one_is_busy_is_closed_not_answered_in_plain_http(tmp_path, pki):
    """At the cap with every connection busy, a new one was written the 503 ``SERVER_BUSY`` answer in
    the clear, which a device over TLS read as a server that speaks no TLS (``https://`` to a plain
    HTTP server): final, not retried. Now it is closed alone, a lost connection the device retries."""
    import socket
    import ssl

    from device_runtime.protocol import ProtocolClient
    from server_stub import HttpLimits

    limits = HttpLimits(max_connections=1)
    with ServerThread(
        tmp_path / "s.db", host="localhost", tls=server_tls_context(*pki["server"]), http_limits=limits
    ) as s:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        busy = context.wrap_socket(socket.create_connection(("127.0.0.1", s.port)), server_hostname="localhost")
        # a request whose body is on its way: the one connection is busy with it
        busy.sendall(b"POST /v1/populations/p/checkin HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")
        client = ProtocolClient(s.url, retry=RetryPolicy(attempts=1), tls=ClientTLS(ca_file=pki["ca"]))
        with pytest.raises(ServerUnreachable) as lost:
            client.checkin("p", "1.31.1")
        assert lost.value.retryable and "does not speak TLS" not in str(lost.value), lost.value
        client.close()
        busy.close()
