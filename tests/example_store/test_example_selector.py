"""ExampleSelector: validation and the JSON-safe dict form plans carry."""

from __future__ import annotations

import json

import pytest

from example_store import ExampleSelector, ExampleStoreError, InvalidArgumentError, RetentionPolicy


def test_the_largest_limit_an_sqlite_store_takes_selects_everything(tmp_path):
    from example_store import SQLiteExampleStore

    with SQLiteExampleStore(tmp_path / "examples.db") as store:
        store.add("app:/x", [{"v": 1.0}, {"v": 2.0}])
        assert store.count(ExampleSelector("app:/x", limit=2**63 - 1)) == 2


def test_defaults_and_round_trip_through_json():
    sel = ExampleSelector("app:/digits", start_time=10, end_time=20.5, limit=3, order="newest")
    assert sel.start_time == 10.0 and isinstance(sel.start_time, float)
    d = json.loads(json.dumps(sel.to_dict()))
    assert ExampleSelector.from_dict(d) == sel
    assert ExampleSelector.from_dict({"collection_uri": "app:/x"}) == ExampleSelector("app:/x")
    assert ExampleSelector("app:/x").order == "oldest"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"order": "random"},
        {"limit": -1},
        {"limit": 2.5},
        {"limit": True},
        {"start_time": "yesterday"},
        {"end_time": float("nan")},
        {"start_time": float("inf")},
        # past what a store's SQL takes (SQLite's OverflowError) and past a float (float()'s)
        {"limit": 2**63},
        {"end_time": -(10**400)},
    ],
)
def test_bad_values_raise_value_error_that_is_an_example_store_error(kwargs):
    with pytest.raises(ValueError) as info:
        ExampleSelector("app:/x", **kwargs)
    assert isinstance(info.value, ExampleStoreError)


@pytest.mark.parametrize("uri", ["", None, 3])
def test_bad_collection_uri(uri):
    with pytest.raises(InvalidArgumentError, match="collection_uri"):
        ExampleSelector(uri)


@pytest.mark.parametrize(
    "d, match",
    [
        ([1, 2], "JSON object"),
        ({}, "collection_uri"),
        ({"collection_uri": "app:/x", "limt": 3}, "limt"),
        ({"collection_uri": "app:/x", "limit": "3"}, "limit"),
        ({"collection_uri": "app:/x", "order": None}, "order"),
    ],
)
def test_from_dict_rejects_bad_input_with_example_store_error(d, match):
    with pytest.raises(ExampleStoreError, match=match):
        ExampleSelector.from_dict(d)


def test_selector_is_frozen_and_hashable():
    sel = ExampleSelector("app:/x", limit=1)
    with pytest.raises(AttributeError):
        sel.limit = 2  # type: ignore[misc]
    assert len({sel, ExampleSelector("app:/x", limit=1)}) == 1


@pytest.mark.parametrize(
    "kwargs", [{"ttl_seconds": -1}, {"ttl_seconds": float("inf")}, {"max_bytes": 1.5}, {"max_bytes": -3}]
)
def test_retention_policy_validates(kwargs):
    with pytest.raises(InvalidArgumentError):
        RetentionPolicy(**kwargs)


def test_resume_after_round_trips_and_is_omitted_when_unset():
    sel = ExampleSelector("app:/x", order="newest", resume_after="abc.def")
    d = json.loads(json.dumps(sel.to_dict()))
    assert d["resume_after"] == "abc.def"
    assert ExampleSelector.from_dict(d) == sel
    assert "resume_after" not in ExampleSelector("app:/x").to_dict()  # readable by older versions
    assert ExampleSelector("app:/x").resuming("t.u") == ExampleSelector("app:/x", resume_after="t.u")
    assert sel.resuming(None).resume_after is None


@pytest.mark.parametrize("token", ["", 3, b"abc", "x" * 5000])
def test_resume_after_must_be_a_token_string(token):
    with pytest.raises(InvalidArgumentError, match="resume_after"):
        ExampleSelector("app:/x", resume_after=token)
