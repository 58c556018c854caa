"""An app's settings are checked when the runtime is made: a population name the server would
refuse (it is a path segment of every request: '../x' reaches another path) and a server URL
without an http(s) scheme (it failed only after every retry, as an unreachable server) are an
``InvalidSetting`` saying what is allowed, before the runtime makes anything."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import FLRuntime, InvalidSetting, RuntimeSdkError
from device_runtime.protocol import SERVER_URL_RULE
from device_runtime.wire import NAME_RULE
from example_store import SQLiteExampleStore
from server_stub.schemas import CreatePopulation

URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = SQLiteExampleStore(tmp_path_factory.mktemp("settings") / "app.db")
    yield store
    store.close()


def server_takes(name: str) -> bool:
    try:
        CreatePopulation(name=name)
    except ValueError:
        return False
    return True


@settings(deadline=None)  # a runtime's httpx client takes a while to make on a loaded machine
@given(name=st.text(alphabet="a.Z9-_/\\ %:", max_size=130) | st.sampled_from(["../x", "..", ".", "a/b", "x" * 129]))
def test_the_runtime_takes_exactly_the_population_names_the_server_takes(store, tmp_path_factory, name):
    cache = tmp_path_factory.mktemp("cache") / "plans"
    try:
        FLRuntime(name, URL, store, cache_dir=cache).close()
        taken = True
    except InvalidSetting as exc:
        assert isinstance(exc, RuntimeSdkError) and isinstance(exc, ValueError)
        assert str(exc) == f"population {name!r} refused: {NAME_RULE}"
        assert not cache.exists()
        taken = False
    assert taken == server_takes(name)


@pytest.mark.parametrize(
    "url",
    [
        "127.0.0.1:8000",
        "localhost:8000",
        "fl.example.com",
        "ftp://fl.example.com",
        "file:///tmp/x",
        "http://",
        "https:///v1",
        "http://fl.example.com:99999",
        "http://fl.example.com:port",
        "http://fl.example.com/?population=x",
        "http://fl.example.com/#top",
        "http://fl.example.com/a b",
        "http://fl.example.com/\n",
        "",
    ],
)
def test_a_server_url_without_an_http_scheme_and_host_is_refused_naming_the_rule(store, tmp_path, url):
    with pytest.raises(InvalidSetting) as refused:
        FLRuntime("digits", url, store, cache_dir=tmp_path / "plans")
    assert str(refused.value).startswith(f"{url!r} is not a server URL: {SERVER_URL_RULE}")
    assert not (tmp_path / "plans").exists()


def test_a_bare_host_and_port_is_refused_with_the_url_to_give(store, tmp_path):
    with pytest.raises(InvalidSetting, match=r", e\.g\. http://127\.0\.0\.1:8000$"):
        FLRuntime("digits", "127.0.0.1:8000", store, cache_dir=tmp_path / "plans")


@pytest.mark.parametrize(
    "url", [URL, "https://fl.example.com", "https://fl.example.com/", "http://[::1]:8000/fl/", "HTTP://Fl.Example.com"]
)
def test_an_http_or_https_server_url_is_taken_without_its_trailing_slash(store, tmp_path, url):
    with FLRuntime("digits", url, store, cache_dir=tmp_path / "plans") as runtime:
        assert runtime.client.server_url == url.rstrip("/")


@pytest.mark.parametrize("stores", ["app.db", None, {"": "app.db"}, {1: None}, [1, 2]])
def test_an_example_store_that_is_not_one_is_refused_saying_what_to_give(tmp_path, stores):
    with pytest.raises(InvalidSetting, match=r"^example_stores must be an example store \(SQLiteExampleStore"):
        FLRuntime("digits", URL, stores, cache_dir=tmp_path / "plans")
    assert not (tmp_path / "plans").exists()


def test_a_closed_runtime_refuses_a_session_saying_to_make_a_new_one(store, tmp_path):
    runtime = FLRuntime("digits", URL, store, cache_dir=tmp_path / "plans")
    runtime.close()
    with pytest.raises(InvalidSetting, match="this runtime of population 'digits' is closed; make a new FLRuntime"):
        runtime.run_session()
