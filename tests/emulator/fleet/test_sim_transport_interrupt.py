"""Ctrl-C in the simulated server's loop: the in-process app's loop is left mid-request, and
closing the caller ends what it left, so the command's one line is all that is said.

A module of its own: the app's loop runs on the test's thread, where no other caller's loop may
be running (``test_sim_transport``'s module fixture keeps one open)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import warnings

import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from emulator.fleet.sim_transport import AsgiCaller, WireRequest
from server_stub.app import _Uploads


def test_a_ctrl_c_in_the_apps_loop_ends_in_the_interrupt_alone(monkeypatch, caplog):
    """SIGINT delivered while the app reads a report's body, in the task the server's upload reader
    reads it in (where a Ctrl-C of ``fedfleet simulate`` landed): the call raises the interrupt, and
    closing the caller leaves no task pending, no coroutine unfinished or never started, and
    nothing for the loop to log (the command's one line is all that is said)."""
    uploads = _Uploads()

    async def report(request):
        return Response(await uploads.read("s", request, 1 << 20))

    inner = Starlette(routes=[Route("/report", report, methods=["POST"])])

    async def application(scope, receive, send):
        async def interrupted():
            message = await receive()
            signal.raise_signal(signal.SIGINT)
            return message

        await inner(scope, interrupted, send)

    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        caller = AsgiCaller(application)
        with pytest.raises(KeyboardInterrupt), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with caplog.at_level(logging.DEBUG, logger="asyncio"):
                try:
                    caller.call(WireRequest("POST", "/report", [(b"host", b"fl.sim")], b"r" * 100))
                finally:
                    caller.close()
                    left = asyncio.all_tasks(caller._loop)
                    del caller
                    gc.collect()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert left == set()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert [str(u.exc_value) for u in unraisable] == []
    assert [str(w.message) for w in caught] == []
