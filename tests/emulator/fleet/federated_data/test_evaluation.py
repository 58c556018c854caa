"""Per-client accuracy percentiles as LEAF computes them: numpy's percentiles over clients, the mean
weighted by test examples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.fleet.federated_data import FederatedDataError, client_accuracy_percentiles


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 50)), min_size=1, max_size=40))
def test_percentiles_are_numpys_over_clients_and_the_mean_is_weighted_by_examples(
    counts: list[tuple[int, int]],
) -> None:
    total = {f"c{i}": t for i, (_, t) in enumerate(counts)}
    correct = {f"c{i}": min(c, t) for i, (c, t) in enumerate(counts)}
    result = client_accuracy_percentiles(correct, total)
    acc = [correct[k] / total[k] for k in sorted(total)]
    assert (result.p10, result.p50, result.p90) == tuple(float(v) for v in np.percentile(acc, [10, 50, 90]))
    assert result.p10 <= result.p50 <= result.p90
    assert result.accuracy == pytest.approx(sum(correct.values()) / sum(total.values()))
    assert result.clients == len(counts)


def test_clients_without_test_examples_are_skipped_and_counted() -> None:
    result = client_accuracy_percentiles({"a": 1, "b": 0, "c": 2}, {"a": 2, "b": 0, "c": 2})
    assert result.clients == 2 and result.skipped == 1 and result.p90 == pytest.approx(0.95)


@pytest.mark.parametrize(
    ("correct", "total", "message"),
    [
        ({"a": 3}, {"a": 2}, "0 <= correct <= total"),
        ({"a": 1}, {"b": 1}, "same clients"),
        ({"a": 0}, {"a": 0}, "no client"),
    ],
)
def test_inconsistent_counts_are_refused(correct: dict[str, int], total: dict[str, int], message: str) -> None:
    with pytest.raises(FederatedDataError, match=message):
        client_accuracy_percentiles(correct, total)
