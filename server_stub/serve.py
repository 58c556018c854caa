"""Run the FL server under uvicorn on a loopback port in a background thread (tests, demo)."""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

from device_runtime.protocol import ClientTLS

from .admin_auth import AdminKeys
from .admin_client import AdminClient
from .app import create_app
from .attestation import AttestationVerifier
from .errors import unreadable
from .http_guards import GuardedServer, HttpLimits
from .persistence import ServerStore
from .service import FLService


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class TlsSettingError(ValueError):
    """A TLS file of the server's (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``) it cannot
    use; the message names the option and what to give, in one line."""


def server_tls_context(
    cert_file: str | os.PathLike,
    key_file: str | os.PathLike | None = None,
    client_ca: str | os.PathLike | None = None,
) -> ssl.SSLContext:
    """The server's TLS context: its certificate chain (PEM, the certificate first) and key (in
    ``cert_file`` too when ``key_file`` is None). With ``client_ca`` (the PEM of the authorities
    that issue devices' and operators' certificates) a client's certificate is asked for and
    checked against them; one that gives none is refused by the HTTP server in words
    (``http_guards``), one that gives another authority's or an expired one fails its handshake.
    uvicorn built its context only as the server started, in its thread: a wrong file ended in a
    traceback after the server had said where it listens."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except OSError as exc:
        if isinstance(exc, ssl.SSLError):
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise TlsSettingError(
                    f"--tls-key {os.fspath(key_file or cert_file)} is not the key of the certificate in --tls-cert "
                    f"{os.fspath(cert_file)}; give the key that was made with it"
                ) from None
            which = f" or --tls-key {os.fspath(key_file)}" if key_file is not None else " (without --tls-key)"
            raise TlsSettingError(
                f"--tls-cert {os.fspath(cert_file)}{which} is not PEM that holds a certificate and its key "
                f"({exc.reason or exc}); give the server's certificate chain (PEM) and its unencrypted private key"
            ) from None
        named = key_file if key_file is not None and exc.filename == os.fspath(key_file) else cert_file
        option = "--tls-key" if named is key_file else "--tls-cert"
        raise TlsSettingError(f"{option} {os.fspath(named)}: {unreadable(exc)}") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ValueError) as exc:
            why = (
                unreadable(exc) if not isinstance(exc, ssl.SSLError) else f"not PEM certificates ({exc.reason or exc})"
            )
            raise TlsSettingError(
                f"--tls-client-ca {os.fspath(client_ca)}: {why}; give the PEM of the authority that issues clients' "
                "certificates"
            ) from None
        context.verify_mode = ssl.CERT_OPTIONAL  # refused in words when none is given (see the docstring)
    return context


def certificate_warning(cert_file: str | os.PathLike, now: datetime.datetime | None = None) -> str | None:
    """What is wrong with a server certificate that loads (expired, not valid yet), or None: every
    client refuses it, and the operator hears of it at the start rather than from each device."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except (OSError, ValueError):
        return None
    now = now or datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc < now:
        return f"the certificate of --tls-cert {os.fspath(cert_file)} expired on {cert.not_valid_after_utc:%Y-%m-%d}: every client refuses it; renew it"
    if cert.not_valid_before_utc > now:
        return f"the certificate of --tls-cert {os.fspath(cert_file)} is valid only from {cert.not_valid_before_utc:%Y-%m-%d}: clients refuse it until then (is this machine's clock right?)"
    return None


class ServerThread:
    """A real uvicorn server in this process; ``url`` is valid once ``start`` returns."""

    def __init__(
        self,
        db_path: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_level: str = "warning",
        verifier: AttestationVerifier | None = None,
        admin_key: str | None = None,
        busy_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        release_trust: frozenset[bytes] = frozenset(),
        http_limits: HttpLimits = HttpLimits(),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``admin_key``: the operator key the server accepts (a random one when not given;
        ``admin_key`` then tells it to the test or demo that started the server). ``clock`` and
        ``wall_clock`` go to ``FLService``: a test that drives ``clock`` by hand decides when a
        deadline passes, whatever the ticker and the machine's speed do. ``http_limits``: the
        timeouts and caps of ``fedfleet server`` (``http_guards``), its defaults unless given.
        ``tls``: serve HTTPS (``server_tls_context``), ``url`` then ``https://``."""
        self.db_path = Path(db_path)
        self.store = ServerStore(db_path, busy_timeout_s=busy_timeout_s)
        self.service = FLService(
            self.store, clock=clock, wall_clock=wall_clock, verifier=verifier, release_trust=release_trust
        )
        self.host = host
        self.port = port or 0
        if admin_key is None:
            keys, admin_key = AdminKeys.generate()
        else:
            keys = AdminKeys([admin_key])
        self.admin_key = admin_key
        self.tls = tls
        self._server = GuardedServer(
            create_app(self.service, admin_keys=keys),
            http_limits,
            tls=tls,
            host=host,
            port=self.port,
            log_level=log_level,
            access_log=False,
            lifespan="on",
        )
        self._thread = threading.Thread(target=self._server.run, name="fl-server", daemon=True)

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, an IPv6 address in brackets (``http://[::1]:PORT``): written bare, it
        was no URL, and ``admin()`` and every device given it were refused."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> ServerThread:
        self.port = self._server.listen()  # bound here: a port picked free stays ours
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the FL server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def admin(self, *, timeout_s: float = 30.0, tls: ClientTLS | None = None) -> AdminClient:
        """An operator client of this server, holding its admin key (and ``tls``, ``AdminClient``'s)."""
        return AdminClient(self.url, admin_key=self.admin_key, timeout_s=timeout_s, tls=tls)

    def stop(self) -> None:
        self._server.exit_soon()
        self._thread.join(timeout=10)
        self._server.close_listener()
        self.store.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
