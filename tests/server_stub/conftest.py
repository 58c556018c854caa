"""Fixtures of the secure-round tests over HTTP: one attestation authority, a server that trusts it
(one per test module) and a fresh population per test on it, and a factory of attested runtimes.

Sharing the server is safe because everything a test reads is per population (its rounds, model,
tasks and status), every device is new (its own key, so its own rate-limit bucket, and its own
nonces), and a test that changes the service does so through ``monkeypatch``, undone when it ends."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest

from emulator import AttestationAuthority
from server_stub import AdminClient, ServerThread
from tests.support import AttestedRuntimes, attested_server_thread


@pytest.fixture(scope="session")
def authority() -> AttestationAuthority:
    """The device makers' authority: every attested device and every server below trusts it."""
    return AttestationAuthority.generate()


@pytest.fixture(scope="module")
def attested_server(tmp_path_factory, authority) -> Iterator[ServerThread]:
    with attested_server_thread(tmp_path_factory.mktemp("attested") / "server.db", authority) as srv:
        yield srv


@pytest.fixture(scope="module")
def attested_admin(attested_server) -> Iterator[AdminClient]:
    with attested_server.admin() as client:
        yield client


@pytest.fixture
def population(request) -> str:
    """This test's population on the module's server, named after the test (a server's names are
    at most 128 of ``[A-Za-z0-9._-]``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[-128:]


@pytest.fixture
def attested_runtimes(tmp_path, digits, authority) -> Iterator[Callable[..., AttestedRuntimes]]:
    """``make(url, population, count, **options)``: attested runtimes of ``population``, closed at the test's end."""
    made: list[AttestedRuntimes] = []

    def make(url: str, population: str, count: int, **options) -> AttestedRuntimes:
        made.append(
            AttestedRuntimes(tmp_path / f"fleet{len(made)}", digits, authority, url, population, count, **options)
        )
        return made[-1]

    yield make
    for fleet in made:
        fleet.close()
