"""A server started in an app's process leaves the app's logging as it was: its handlers open and
attached."""

from __future__ import annotations

import logging

import httpx

from server_stub import ServerThread


class _Recording(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.closed = False
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True
        super().close()


def test_starting_a_server_closes_none_of_the_apps_log_handlers(tmp_path):
    handler = _Recording()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with ServerThread(tmp_path / "server.db") as server:
            assert httpx.get(f"{server.url}/v1/health", timeout=10).status_code == 200
        logging.getLogger("an.app").warning("a record of the app's")
        assert not handler.closed and handler in root.handlers
        assert [r.getMessage() for r in handler.records if r.name == "an.app"] == ["a record of the app's"]
    finally:
        root.removeHandler(handler)
