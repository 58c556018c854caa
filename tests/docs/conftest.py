"""The docs tests' fork server, one per test session (tests/docs/forkserver.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.forkserver import ForkServer


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer]:
    """Started on first use, stopped (and waited for, with all it forked) at the session's end."""
    folder = Path(tempfile.mkdtemp(prefix="ffdocs-"))  # short: a socket's path is at most 107 bytes
    server = ForkServer(folder)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
