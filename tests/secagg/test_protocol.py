"""End-to-end protocol properties: exact sums under drop-outs, abort exactly below threshold."""

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import ProtocolAborted, Round, SecAggConfig, run_protocol
from tests.secagg.secagg_helpers import make_inputs, seeded

MODULI = st.one_of(st.sampled_from([2**8, 2**16, 2**32, 2**40, 2**62]), st.integers(2, 2**62))
ROUNDS_PLAIN = [
    Round.ADVERTISE_KEYS,
    Round.SHARE_KEYS,
    Round.SHARE_CHECK,
    Round.MASKED_INPUT_COLLECTION,
    Round.UNMASKING,
]
ROUNDS_CC = [
    Round.ADVERTISE_KEYS,
    Round.SHARE_KEYS,
    Round.SHARE_CHECK,
    Round.MASKED_INPUT_COLLECTION,
    Round.CONSISTENCY_CHECK,
    Round.UNMASKING,
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_complete_graph_sum_is_exact_or_aborts_below_threshold(data):
    n = data.draw(st.integers(3, 12), label="n")
    t = data.draw(st.integers(2, n), label="t")
    length = data.draw(st.integers(1, 40), label="length")
    modulus = data.draw(MODULI, label="R")
    cc = data.draw(st.booleans(), label="consistency_check")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    cfg = SecAggConfig(length, modulus, t, session_label=b"prop", consistency_check=cc, allow_unsafe=True)
    inputs = make_inputs(n, length, modulus, seed, first_id=data.draw(st.integers(1, 1000), label="first id"))
    rounds = ROUNDS_CC if cc else ROUNDS_PLAIN
    alive = set(inputs)
    drops: dict[Round, set[int]] = {}
    expect_abort_at = None
    answered = 0
    u3 = None
    for r in rounds:
        d = data.draw(st.sets(st.sampled_from(sorted(inputs))), label=f"drop at {r.value}") & alive
        drops[r] = d
        alive -= d
        if r is Round.MASKED_INPUT_COLLECTION:
            u3 = set(alive)
        if expect_abort_at is None and len(alive) < t:
            expect_abort_at, answered = r, len(alive)
    res = run_protocol(cfg, inputs, drops=drops, random_bytes=seeded(seed))
    assert res.rejected == []
    if expect_abort_at is None:
        assert res.completed, res.abort_reason
        assert res.server.summed_clients == u3
        want = np.zeros(length, dtype=object)
        for u in u3:
            want = want + inputs[u].astype(object)
        assert res.result.dtype == np.uint64
        assert [int(v) for v in res.result] == [int(v) % modulus for v in want]
        # every client that reached Unmasking completed; none aborted
        assert all(not c.aborted for c in res.clients.values())
    else:
        assert not res.completed
        assert res.server.round is Round.ABORTED
        assert res.abort_reason == f"{expect_abort_at.value}: only {answered} clients answered, threshold is {t}"
        assert all(not c.aborted for c in res.clients.values())  # the server stopped first
        with pytest.raises(ProtocolAborted):
            res.server.result()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_secagg_plus_sum_is_exact_or_aborts_for_the_reason_the_drop_outs_imply(data):
    n = data.draw(st.integers(6, 30), label="n")
    k = data.draw(st.sampled_from([d for d in (2, 4, 6, 8) if d < n - 1]), label="degree")
    t = data.draw(st.integers(2, k + 1), label="t")
    length = data.draw(st.integers(1, 20), label="length")
    modulus = data.draw(MODULI, label="R")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    cfg = SecAggConfig(length, modulus, t, session_label=b"plus", degree=k, allow_unsafe=True)
    inputs = make_inputs(n, length, modulus, seed)
    drops = {r: data.draw(st.sets(st.sampled_from(sorted(inputs)), max_size=2), label=r.value) for r in ROUNDS_PLAIN}
    res = run_protocol(cfg, inputs, drops=drops, random_bytes=seeded(seed))
    holders = {u: frozenset(res.server.neighbours(u)) | {u} for u in inputs}  # the server's random graph
    want = secagg_plus_outcome(set(inputs), drops, t, k, holders)
    assert res.abort_reason == want.server_reason
    assert {u: c.abort_reason for u, c in res.clients.items() if c.aborted} == want.client_reasons
    if want.server_reason is None:
        assert res.completed and res.server.summed_clients == want.u3
        total = sum((inputs[u].astype(object) for u in want.u3), np.zeros(length, dtype=object))
        assert [int(v) for v in res.result] == [int(v) % modulus for v in total]
    else:
        assert not res.completed and res.server.round is Round.ABORTED
        with pytest.raises(ProtocolAborted) as aborted:
            res.server.result()
        assert aborted.value.reason == want.server_reason
    if not any(drops.values()):
        assert res.completed


@dataclass
class Expected:
    u3: set[int]
    server_reason: str | None
    client_reasons: dict[int, str]


def secagg_plus_outcome(
    ids: set[int], drops: dict[Round, set[int]], t: int, degree: int, holders: dict[int, frozenset[int]]
) -> Expected:
    """How an honest SecAgg+ run must end, from the drop-outs and the masking graph alone
    (``holders[u]``: u and its neighbours, who hold u's shares). The server aborts the first
    round fewer than t clients answer, at ShareCheck when fewer than t clients are left to mask
    after it left out every sender with fewer than t answering holders (repeated until none is
    left), or in Unmasking when fewer than t holders of some needed secret answered (self-masks b
    of U3 first, then keys s_sk of dropped clients with a neighbour in U3, each by client id). A
    client aborts when fewer than t of its neighbourhood shared keys with it, are in its masking
    set, or are on its survivor list; a client dropped in round r still handles the message that
    opened round r (it goes silent when it should answer)."""
    out = Expected(set(), None, {})

    def threshold(r: Round, answered: set[int]) -> bool:
        if len(answered) < t:
            out.server_reason = f"{r.value}: only {len(answered)} clients answered, threshold is {t}"
        return out.server_reason is None

    u1 = ids - drops[Round.ADVERTISE_KEYS]
    if not threshold(Round.ADVERTISE_KEYS, u1):
        return out
    u2 = u1 - drops[Round.SHARE_KEYS]  # every roster (a neighbourhood, >= t clients) is accepted
    if not threshold(Round.SHARE_KEYS, u2):
        return out
    for u in u2:
        if len(holders[u] & u2) < t:
            out.client_reasons[u] = f"{len(holders[u] & u2)} clients shared keys < threshold {t}"
    checked = u2 - out.client_reasons.keys() - drops[Round.SHARE_CHECK]
    if not threshold(Round.SHARE_CHECK, checked):
        return out
    excluded: set[int] = set()
    while more := {v for v in u2 - excluded if len(holders[v] & (checked - excluded)) < t}:
        excluded |= more
    maskers = checked - excluded
    if len(maskers) < t:
        out.server_reason = (
            f"ShareCheck: only {len(maskers)} clients left to mask after leaving out "
            f"{sorted(excluded)}, threshold is {t}"
        )
        return out
    u2 = u2 - excluded
    for u in maskers:
        if len(holders[u] & u2) < t:
            out.client_reasons[u] = f"{len(holders[u] & u2)} clients in the masking set < threshold {t}"
    u3 = out.u3 = maskers - drops[Round.MASKED_INPUT_COLLECTION] - out.client_reasons.keys()
    if not threshold(Round.MASKED_INPUT_COLLECTION, u3):
        return out
    complete = len(u1) <= degree + 1  # then everyone is told all of U3
    for u in u3:
        listed = u3 if complete else holders[u] & u3
        if len(listed) < t:
            out.client_reasons[u] = f"{len(listed)} survivors < threshold {t}"
    u5 = u3 - drops[Round.UNMASKING] - out.client_reasons.keys()
    if not threshold(Round.UNMASKING, u5):
        return out
    needed = [("self-mask b", u) for u in sorted(u3)]
    needed += [("key s_sk", u) for u in sorted(u2 - u3) if holders[u] & u3]
    for what, u in needed:
        if len(holders[u] & u5) < t:
            out.server_reason = (
                f"Unmasking: only {len(holders[u] & u5)} good shares of the {what} of client {u}, threshold is {t}"
            )
            return out
    return out


def test_secagg_plus_masks_only_between_neighbours():
    cfg = SecAggConfig(8, 2**20, 4, degree=4, allow_unsafe=True)
    inputs = make_inputs(20, 8, 2**20, 1)
    res = run_protocol(cfg, inputs, random_bytes=seeded(1))
    assert res.completed
    for u in inputs:
        nb = res.server.neighbours(u)
        assert len(nb) == 4
        assert set(res.clients[u]._peers) == set(nb) | {u}


def test_config_for_cohort_picks_graph_by_size():
    assert SecAggConfig.for_cohort(100, 10).degree is None
    big = SecAggConfig.for_cohort(10_000, 10)
    assert big.degree is not None and big.degree < 250 and big.modulus >= 10_000 * 2**16


def test_quantized_float_sum_end_to_end():
    from secagg import Quantizer

    q = Quantizer(12, 2.0)
    n, length = 8, 30
    cfg = SecAggConfig.for_cohort(n, length, bitwidth=12)
    rng = np.random.default_rng(0)
    xs = {u: rng.uniform(-2, 2, length) for u in range(1, n + 1)}
    res = run_protocol(cfg, {u: q.quantize(x) for u, x in xs.items()}, drops={Round.MASKED_INPUT_COLLECTION: {3}})
    got = q.dequantize_sum(res.result, len(res.server.summed_clients))
    want = sum(x for u, x in xs.items() if u != 3)
    assert np.allclose(got, want, atol=(n - 1) / q.scale)


def test_input_can_be_set_after_key_exchange_and_is_required():
    from secagg import OutOfOrder
    from tests.secagg.secagg_helpers import Harness

    cfg = SecAggConfig(5, 2**10, 2, allow_unsafe=True)
    inputs = make_inputs(3, 5, 2**10, 4)
    h = Harness(cfg, {u: None for u in inputs})
    h.run_to(Round.MASKED_INPUT_COLLECTION)
    h.clients[1].set_input(inputs[1])
    h.clients[2].set_input(inputs[2])
    h.client_step()
    assert isinstance(h.clients[3].error, OutOfOrder) and "input" in h.clients[3].abort_reason
    h.server_step()
    h.client_step()
    h.server_step()
    assert [int(v) for v in h.server.result()] == [int(a + b) % 2**10 for a, b in zip(inputs[1], inputs[2])]
    with pytest.raises(OutOfOrder):
        h.clients[1].set_input(inputs[1])
