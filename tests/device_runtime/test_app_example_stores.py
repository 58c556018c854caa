"""The runtime works with any ExampleStore through the interface alone: the package's in-memory
store, and an app's own store written here over a Python list with only the abstract methods."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from device_runtime import FLRuntime, Outcome, RetryPolicy
from example_store import (
    Example,
    ExampleIterator,
    ExampleSelector,
    ExampleStore,
    InMemoryExampleStore,
    ResumptionNotSupportedError,
    UnknownCollectionError,
)
from tests.support import COLLECTION, deploy, digits_plan

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
N = 30


class ListIterator(ExampleIterator):
    """Only the abstract methods: no resumption tokens, no batching (the interface batches)."""

    def __init__(self, examples: list[Example]) -> None:
        self._examples: list[Example] | None = examples
        self._next = 0

    def __next__(self) -> Example:
        if self._examples is None or self._next == len(self._examples):
            self.close()
            raise StopIteration
        self._next += 1
        return self._examples[self._next - 1]

    def close(self) -> None:
        self._examples = None


class ListExampleStore(ExampleStore):
    """An app's own store: one collection of (timestamp, example) pairs in a list."""

    def __init__(self, collection_uri: str, examples: list[tuple[float, Example]]) -> None:
        self.collection_uri = collection_uri
        self.examples = sorted(examples, key=lambda te: te[0])  # stable: ties keep insertion order

    def _select(self, selector: ExampleSelector) -> list[Example]:
        if selector.collection_uri != self.collection_uri:
            raise UnknownCollectionError(
                f"this app keeps only {self.collection_uri!r}, not {selector.collection_uri!r}"
            )
        if selector.resume_after is not None:
            raise ResumptionNotSupportedError("this app's store reads from the start only")
        chosen = [
            ex
            for ts, ex in self.examples
            if (selector.start_time is None or ts >= selector.start_time)
            and (selector.end_time is None or ts < selector.end_time)
        ]
        if selector.order == "newest":
            chosen.reverse()
        return chosen[: selector.limit]

    def query(self, selector: ExampleSelector) -> ExampleIterator:
        return ListIterator(self._select(selector))

    def count(self, selector: ExampleSelector) -> int:
        return len(self._select(selector))


def _examples(digits) -> list[Example]:
    return [{"x": digits.x_train[i], "y": digits.y_train[i]} for i in range(N)]


def _check_committed(admin, weights: dict) -> None:
    rounds = admin.rounds("digits")
    assert [r["status"] for r in rounds] == ["committed"]
    assert rounds[0]["metrics"]["num_examples"] == N
    model, number = admin.model("digits")
    assert number == 1  # the model the committed round produced
    assert any(not np.allclose(model[name], weights[name]) for name in weights)


def test_runtime_trains_against_the_in_memory_store(server, admin, digits):
    _plan, weights = deploy(admin, goal_count=1, over_selection=1.0)
    store = InMemoryExampleStore()
    store.add(COLLECTION, _examples(digits))
    with FLRuntime("digits", server.url, store, retry=FAST) as runtime:
        result = runtime.run_session()
    assert result.outcome is Outcome.COMPLETED and result.shape == "-v[]+^" and result.num_examples == N
    _check_committed(admin, weights)


def test_runtime_trains_against_an_apps_own_store(server, admin, digits):
    _plan, weights = deploy(admin, goal_count=1, over_selection=1.0)
    store = ListExampleStore(COLLECTION, [(float(i), ex) for i, ex in enumerate(_examples(digits))])
    with FLRuntime("digits", server.url, {"app:/": store}, retry=FAST) as runtime:
        result = runtime.run_session()
    assert result.outcome is Outcome.COMPLETED and result.shape == "-v[]+^" and result.num_examples == N
    _check_committed(admin, weights)


def test_a_resuming_plan_on_a_store_without_tokens_still_trains(server, admin, digits, caplog):
    """The store cannot resume: the session completes, a warning says so, and nothing is saved."""
    plan = digits_plan(selector=ExampleSelector(COLLECTION, limit=10), resume_examples=True)
    deploy(admin, plan=plan, goal_count=1, over_selection=1.0)
    store = ListExampleStore(COLLECTION, [(float(i), ex) for i, ex in enumerate(_examples(digits))])
    with FLRuntime("digits", server.url, store, retry=FAST) as runtime:
        with caplog.at_level(logging.WARNING, logger="device_runtime.reading"):
            results = [runtime.run_session(), runtime.run_session()]
        assert runtime.resumption_tokens.resumption_token("digits", "train", COLLECTION) is None
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 2
    assert [r.num_examples for r in results] == [10, 10]
    assert any("cannot" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_the_list_store_honours_the_selector(order):
    store = ListExampleStore(COLLECTION, [(float(i), {"i": np.int64(i)}) for i in range(6)])
    selector = ExampleSelector(COLLECTION, start_time=1.0, end_time=5.0, limit=3, order=order)
    got = [int(ex["i"]) for ex in store.query(selector)]
    assert got == ([1, 2, 3] if order == "oldest" else [4, 3, 2]) and store.count(selector) == 3
    batches = list(store.query_batches(selector, 2))  # the interface's default batching
    assert [len(b["i"]) for b in batches] == [2, 1]
