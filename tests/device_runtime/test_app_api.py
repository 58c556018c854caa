"""The SDK as an app developer meets it: what the errors tell the app to do, how the objects it
holds print, and what a call made on an event loop says."""

from __future__ import annotations

import socket

import pytest

import device_runtime
from device_runtime import (
    AppDatabaseError,
    FLRuntime,
    NoExamples,
    ProtocolError,
    RetryPolicy,
    RuntimeSdkError,
    ServerUnreachable,
    SessionRejected,
)
from example_store import InMemoryExampleStore


def _closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_an_app_tells_a_failure_to_retry_later_from_one_to_fix_by_the_errors_retryable(server):
    """Catching ``RuntimeSdkError`` alone, an app could not tell a server that was down (try again
    later) from a plan this device can never run or a collection it never filled (retrying spends
    the battery for nothing) without matching class names or messages."""
    store = InMemoryExampleStore()
    failures: list[RuntimeSdkError] = []
    for url in (server.url, _closed_port_url()):  # no task deployed yet; nothing listening
        with FLRuntime("digits", url, store, retry=RetryPolicy(attempts=2, base_delay_s=0.01)) as runtime:
            with pytest.raises(RuntimeSdkError) as failed:
                runtime.run_session()
            failures.append(failed.value)
    scoped = FLRuntime("digits", server.url, {"app:/digits": store})
    with pytest.raises(RuntimeSdkError) as unregistered:
        scoped.store_for("app:/contacts")
    scoped.close()
    failures.append(unregistered.value)
    assert [(type(f), f.retryable) for f in failures] == [
        (SessionRejected, True),
        (ServerUnreachable, True),
        (NoExamples, False),
    ]


@pytest.mark.parametrize("status", [None, 400, 401, 403, 404, 408, 409, 426, 429, 500, 503])
def test_a_protocol_error_is_retryable_unless_the_server_refused_the_request_as_made(status):
    error = ProtocolError("said", status=status)
    assert error.retryable is (status is None or status >= 500 or status in (408, 429))


def test_every_error_an_app_catches_is_importable_from_the_package_and_says_whether_to_retry():
    """``AppDatabaseError`` (a full disk before an upload, a damaged app database) was named by the
    tutorial but importable only from ``device_runtime.opstats``."""
    errors = [
        getattr(device_runtime, name)
        for name in device_runtime.__all__
        if isinstance(getattr(device_runtime, name), type) and issubclass(getattr(device_runtime, name), Exception)
    ]
    assert AppDatabaseError in errors
    for error in errors:
        if issubclass(error, RuntimeSdkError):
            assert isinstance(error.retryable, bool), error


def test_what_an_app_holds_prints_what_it_is_and_a_session_result_fits_a_line(tmp_path, server, admin, digits):
    """The runtime, the scheduler, its worker and the opstats log printed as ``<... object at
    0x7f...>``, and a session's result as every event with its detail (a screen of text)."""
    from device_runtime import (
        OpStatsStore,
        ParticipationScheduler,
        StaticConditions,
        SystemClock,
        VirtualClock,
    )
    from device_runtime.conditions import DeviceState
    from tests.support import COLLECTION, deploy

    deploy(admin)
    store = InMemoryExampleStore()
    store.add(COLLECTION, [{"x": x, "y": y} for x, y in zip(digits.x_train[:40], digits.y_train[:40])])
    db = tmp_path / "app.db"
    opstats = OpStatsStore(db)
    with FLRuntime("digits", server.url.replace("http://", "http://user:secret@"), store) as other:
        assert repr(other) == f"FLRuntime('digits', {server.url.replace('http://', 'http://user:***@')!r}, {store!r})"
    runtime = FLRuntime("digits", server.url, {COLLECTION: store}, opstats=opstats)
    assert repr(runtime) == f"FLRuntime('digits', {server.url!r}, {{{COLLECTION!r}: {store!r}}})"
    result = runtime.run_session()
    said = repr(result)
    assert said.startswith("SessionResult(outcome=Outcome.COMPLETED, task='train', round=1, shape='-v[]+^', ")
    assert "num_examples=40" in said and "'loss': " in said and "Event(" not in said, said
    (summary,) = opstats.sessions()
    assert "Event(" not in repr(summary) and "shape='-v[]+^'" in repr(summary)
    assert repr(opstats) == f"OpStatsStore({str(db)!r})"
    state = DeviceState(idle=True, charging=True, battery_level=1.0, unmetered_network=True)
    scheduler = ParticipationScheduler(db, StaticConditions(state), app="mail")
    scheduler.register_runtime("digits", runtime)
    assert repr(scheduler) == f"ParticipationScheduler(app='mail', {str(db)!r}, runtimes=['digits'])"
    assert repr(scheduler.queue) == "WorkerQueue(SystemClock(), apps=['mail'], stopped, 0 runs in history)"
    scheduler.close()
    runtime.close()
    opstats.close()
    assert repr(runtime).endswith(", closed)") and repr(opstats).endswith(", closed)")
    assert repr(scheduler).endswith("runtimes=['digits'], closed)")
    assert repr(VirtualClock(5.0)) == "VirtualClock(5.0)" and repr(SystemClock()) == "SystemClock()"


@pytest.mark.parametrize("package", ["device_runtime", "example_store"])
def test_every_parameter_of_the_public_api_is_annotated(package):
    """A type checker and an IDE take an unannotated parameter as Any: ``build_mlp_plan``'s
    ``selector`` took the collection's URI string unsaid, and ``build_softmax_regression_plan``'s
    ``**kwargs`` any misspelt keyword, both failing only when the plan was built."""
    import importlib
    import inspect

    root = importlib.import_module(package)
    unannotated = []
    for name in root.__all__:
        exported = getattr(root, name)
        if inspect.isclass(exported):
            # the methods written here (a Protocol's __init__ is typing's, a dataclass's __eq__ generated)
            functions = [
                (f"{name}.{n}", f)
                for n, f in vars(exported).items()
                if inspect.isfunction(f) and (not n.startswith("__") or n == "__init__")
            ]
        else:
            functions = [(name, exported)] if inspect.isfunction(exported) else []
        for where, function in functions:
            if not function.__module__.startswith(package):
                continue
            parameters = list(inspect.signature(function).parameters.values())
            unannotated += [
                f"{where}({p.name})" for p in parameters[1 if "." in where else 0 :] if p.annotation is p.empty
            ]
    assert unannotated == []


def test_run_session_on_an_event_loop_says_to_run_it_in_a_thread(server):
    """Called from a coroutine, ``run_session`` blocked the loop for the whole session without a
    word (and hung until its timeouts where the server answered on that same loop)."""
    import asyncio
    import warnings

    runtime = FLRuntime("digits", server.url, InMemoryExampleStore())

    async def app() -> None:
        with pytest.warns(RuntimeWarning, match=r"await asyncio.to_thread\(runtime.run_session\)"):
            with pytest.raises(SessionRejected):  # no task yet: the call still runs
                runtime.run_session()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(SessionRejected):
                await asyncio.to_thread(runtime.run_session)

    asyncio.run(app())
    runtime.close()


def test_help_on_the_runtime_shows_no_object_addresses():
    """``help(FLRuntime)`` showed its environment's default as every field, a function as ``<function
    rss_mb at 0x7f...>``."""
    import pydoc

    from device_runtime import DEVICE_ENVIRONMENT, RuntimeEnvironment, VirtualClock

    assert " at 0x" not in pydoc.render_doc(FLRuntime, renderer=pydoc.plaintext)
    clock = VirtualClock()
    assert repr(DEVICE_ENVIRONMENT) == "RuntimeEnvironment()"
    assert repr(RuntimeEnvironment(clock=clock.now, secagg_poll_s=1.0)) == (
        "RuntimeEnvironment(clock=VirtualClock.now, secagg_poll_s=1.0)"
    )


def test_what_an_app_annotates_is_exported_and_says_what_it_holds():
    """``schedule()`` and ``jobs()`` gave a ``ScheduledJob`` an app could annotate only from
    ``device_runtime.scheduling``, and ``help()`` of a result or a state the app reads said only
    its fields (a dataclass's generated ``DeviceState(idle: bool, ...)``) or "An enumeration."."""
    import inspect

    from device_runtime import ParticipationScheduler

    assert inspect.signature(ParticipationScheduler.schedule).return_annotation == "ScheduledJob"
    for name in ("ScheduledJob", "JobRun", "RunOutcome", "SessionResult", "Outcome", "DeviceState", "Event"):
        assert name in device_runtime.__all__, name
        doc = inspect.getdoc(getattr(device_runtime, name)) or ""
        assert not doc.startswith((f"{name}(", "An enumeration")), f"{name}: {doc[:60]}"
