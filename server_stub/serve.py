"""Run the FL server under uvicorn on a loopback port in a background thread (tests, demo)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .admin_auth import AdminKeys
from .admin_client import AdminClient
from .app import create_app
from .attestation import AttestationVerifier
from .http_guards import GuardedServer, HttpLimits
from .persistence import ServerStore
from .service import FLService


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
    ) -> None:
        """``admin_key``: the operator key the server accepts (a random one when not given;
        ``admin_key`` then tells it to the test or demo that started the server). ``clock`` and
        ``wall_clock`` go to ``FLService``: a test that drives ``clock`` by hand decides when a
        deadline passes, whatever the ticker and the machine's speed do. ``http_limits``: the
        timeouts and caps of ``fedfleet server`` (``http_guards``), its defaults unless given."""
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
        self._server = GuardedServer(
            create_app(self.service, admin_keys=keys),
            http_limits,
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
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> ServerThread:
        self.port = self._server.listen()  # bound here: a port picked free stays ours
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the FL server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def admin(self, *, timeout_s: float = 30.0) -> AdminClient:
        """An operator client of this server, holding its admin key."""
        return AdminClient(self.url, admin_key=self.admin_key, timeout_s=timeout_s)

    def stop(self) -> None:
        self._server.exit_soon()
        self._thread.join(timeout=10)
        self._server.close_listener()
        self.store.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
