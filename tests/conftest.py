"""Shared fixtures: a real uvicorn FL server on a loopback port, the digits data, small plans."""

from __future__ import annotations

import pytest

from emulator.datasets import load_digits_dataset
from server_stub import ServerThread


@pytest.fixture(scope="session")
def digits():
    return load_digits_dataset(seed=0)


@pytest.fixture
def server(tmp_path):
    with ServerThread(tmp_path / "server.db") as srv:
        yield srv


@pytest.fixture
def admin(server):
    with server.admin() as client:
        yield client
