"""Malicious devices in a Secure Aggregation group, over real HTTP (uvicorn on loopback, SQLite,
real crypto): whatever one device sends, the server answers it with a 4xx and a stable code, never
a 5xx, and its group either sums the honest devices exactly or aborts; a device that advertises keys
its peers would refuse is refused by the server first, so that it cannot make its whole group abort."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_runtime import ProtocolError
from device_runtime.protocol import ProtocolClient
from device_runtime.secure_client import SecureOutcome
from device_runtime.secure_sum import SecureSumCodec
from secagg import Round, crypto, parse_message
from secagg.messages import AdvertiseKeys, MaskedInput
from secagg.transcript import key_signing_payload
from tests.support import attested_checkins, deploy_secure, run_secure_aggregations

K = 5  # groups of k + 1 = 6, threshold 5: one device refused leaves five to sum


def _stranger_signed(msg: AdvertiseKeys, client_id: int) -> AdvertiseKeys:
    """The same keys signed by a key made for the occasion: no member of the group holds it."""
    key = crypto.SigningKey(os.urandom)
    sig = crypto.sign(key, key_signing_payload(msg.session_tag, client_id, msg.c_pk, msg.s_pk))
    return AdvertiseKeys(msg.session_tag, msg.c_pk, msg.s_pk, key.public_key, sig, msg.credential)


#: how a device bends its AdvertiseKeys: a credential that certifies nothing, or a signing key
#: that is not the attested key the group was drawn with (its certificate then names another key)
BENDS = {
    "garbage credential": lambda msg, cid: AdvertiseKeys(
        msg.session_tag, msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, b"\x01" * 40
    ),
    "no credential": lambda msg, cid: AdvertiseKeys(msg.session_tag, msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, b""),
    "key of no member": _stranger_signed,
}


def _vectors(codec: SecureSumCodec, count: int, seed: int) -> list[np.ndarray]:
    """Encoded updates of ``count`` devices with 10 examples each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        update = {name: rng.uniform(-1, 1, codec.shapes[name]).astype(np.float32) for name in codec.names}
        update["num_examples"] = update["count"] = np.array(10, dtype=np.float32)
        for name in ("loss_sum", "correct"):  # sums of non-negative values, as every honest device's
            update[name] = np.abs(update[name])
        out.append(codec.encode(update))
    return out


class BentAdvertiser(ProtocolClient):
    """A device that advertises keys its peers must refuse (and otherwise follows the protocol)."""

    bend = staticmethod(BENDS["garbage credential"])
    refused: list[str]

    def secagg_send(self, session, message: bytes):  # noqa: ANN001, ANN201 - ProtocolClient's own
        msg = parse_message(message)
        if isinstance(msg, AdvertiseKeys):
            state = self.secagg_poll(session)
            message = self.bend(msg, int(state["client_id"])).to_bytes()
            try:
                return super().secagg_send(session, message)
            except ProtocolError as exc:
                self.refused = [str(exc)]
                raise
        return super().secagg_send(session, message)


@pytest.mark.parametrize("bend", sorted(BENDS))
def test_a_device_advertising_keys_its_peers_refuse_is_refused_and_its_group_commits(
    attested_server, attested_admin, authority, population, bend
):
    server, admin = attested_server, attested_admin
    # Rounds of 5 minutes, longer than the devices wait (30 s): the group must not wait for the
    # refused device, which will send nothing more.
    plan, w0 = deploy_secure(
        admin, population, goal_count=K + 1, min_fraction=0.5, secagg_round_timeout_s=300.0, report_timeout_s=1000.0
    )
    codec = SecureSumCodec(plan)
    vectors = _vectors(codec, K + 1, seed=3)
    bad = BentAdvertiser(server.url)
    bad.bend = staticmethod(BENDS[bend])
    clients = [bad] + [ProtocolClient(server.url) for _ in range(K)]
    results = run_secure_aggregations(
        attested_checkins(clients, authority, population), vectors, authority, deadline_s=30
    )
    assert "SECAGG_REJECTED" in bad.refused[0]
    outcomes = {i: r.outcome for i, r in results.items() if i > 0}
    assert outcomes == {i: SecureOutcome.INCLUDED for i in range(1, K + 1)}
    (record,) = admin.rounds(population)
    assert record["status"] == "committed"
    assert record["metrics"]["secagg"]["summed_devices"] == K
    model, _ = admin.model(population)
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in range(1, K + 1)], axis=0), K)
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6)


#: the messages of a device in a round with ConsistencyCheck, in the order it sends them
MESSAGES = ["AdvertiseKeys", "EncryptedShares", "ShareCheck", "MaskedInput", "ConsistencySignature", "UnmaskResponse"]


def _deviated(data: bytes, how: str, at: int) -> bytes:
    """``data`` bent ``how``: a byte flipped at ``at``, cut at ``at``, grown by ``at`` bytes, or
    replaced by as many bytes of garbage."""
    if how == "flip":
        i = at % len(data)
        return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]
    if how == "truncate":
        return data[: at % len(data)]
    if how == "extend":
        return data + bytes(at % 64 + 1)
    return np.random.default_rng(at).bytes(len(data))


class Deviant(ProtocolClient):
    """A device that bends its ``which``-th protocol message (``_deviated``); with ``also``, it sends
    the real message first and the bent one after it, for the same round. Records every status."""

    def __init__(self, url: str, which: int, how: str, at: int, also: bool) -> None:
        super().__init__(url)
        self.which, self.how, self.at, self.also = which, how, at, also
        self.statuses: list[int] = []
        self.sent = 0

    def secagg_send(self, session, message: bytes):  # noqa: ANN001, ANN201 - ProtocolClient's own
        n, self.sent = self.sent, self.sent + 1
        if n != self.which:
            return super().secagg_send(session, message)
        bent = _deviated(message, self.how, self.at)
        try:
            if self.also:
                answer = super().secagg_send(session, message)
                self.statuses.append(200)
                try:
                    super().secagg_send(session, bent)
                    self.statuses.append(200)
                except ProtocolError as exc:
                    self.statuses.append(exc.status or 0)
                return answer
            answer = super().secagg_send(session, bent)
            self.statuses.append(200)
            return answer
        except ProtocolError as exc:
            self.statuses.append(exc.status or 0)
            raise


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, len(MESSAGES) - 1),
    how=st.sampled_from(["flip", "truncate", "extend", "garbage"]),
    at=st.integers(0, 2**16),
    also=st.booleans(),
)
@example(which=1, how="flip", at=200, also=False)  # a flipped byte in a share pair: reported at ShareCheck
@example(which=3, how="extend", at=7, also=False)  # a masked input of the wrong length
@example(which=5, how="flip", at=40, also=True)  # another unmask response after its own
def test_one_deviant_device_gets_4xx_and_its_group_sums_exactly_or_aborts_on_record(
    attested_server, attested_admin, authority, population, which, how, at, also
):
    server, admin = attested_server, attested_admin
    population = f"{population[:100]}-{time.monotonic_ns()}"  # a population per example
    # a round timeout of 1 s: a deviant that goes silent holds its group that long
    plan, w0 = deploy_secure(
        admin, population, goal_count=K + 1, min_fraction=0.5, secagg_round_timeout_s=1.0, report_timeout_s=6.0
    )
    codec = SecureSumCodec(plan)
    vectors = _vectors(codec, K + 1, seed=at)
    deviant = Deviant(server.url, which, how, at, also)
    clients = [deviant] + [ProtocolClient(server.url) for _ in range(K)]
    results = run_secure_aggregations(
        attested_checkins(clients, authority, population), vectors, authority, deadline_s=20
    )
    assert all(s == 200 or 400 <= s < 500 for s in deviant.statuses), deviant.statuses
    honest = {i: results[i].outcome for i in range(1, K + 1)}
    (record,) = admin.rounds(population)
    if record["status"] == "abandoned":  # the group aborted: none of it is in a model
        assert SecureOutcome.INCLUDED not in honest.values()
        assert record["metrics"]["reported"] == 0
        return
    assert record["status"] == "committed"
    summed = [i for i, outcome in honest.items() if outcome is SecureOutcome.INCLUDED]
    extra = record["metrics"]["secagg"]["summed_devices"] - len(summed)
    assert extra in (0, 1)  # the deviant's masked input, when it was in
    summed += [0] * extra
    assert record["metrics"]["reported"] == len(summed)
    model, _ = admin.model(population)
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in summed], axis=0), len(summed))
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6)


class LateMasker(ProtocolClient):
    """A device that holds its masked input back until its group has moved past that round."""

    code: str | None = None

    def secagg_send(self, session, message: bytes):  # noqa: ANN001, ANN201 - ProtocolClient's own
        if isinstance(parse_message(message), MaskedInput):
            state = self.secagg_poll(session)
            while state["status"] == "active" and state["round"] == Round.MASKED_INPUT_COLLECTION.value:
                state = self.secagg_poll(session, after=state["seq"], wait_s=5.0)
            try:
                return super().secagg_send(session, message)
            except ProtocolError as exc:
                self.code = exc.code
                raise
        return super().secagg_send(session, message)


def test_a_masked_input_after_its_rounds_deadline_is_refused_and_not_summed(
    attested_server, attested_admin, authority, population
):
    server, admin = attested_server, attested_admin
    # masked inputs are due 2 s after the group forms: the report window less three round timeouts
    plan, w0 = deploy_secure(
        admin, population, goal_count=K + 1, min_fraction=0.5, secagg_round_timeout_s=1.0, report_timeout_s=5.0
    )
    codec = SecureSumCodec(plan)
    vectors = _vectors(codec, K + 1, seed=4)
    late = LateMasker(server.url)
    clients = [late] + [ProtocolClient(server.url) for _ in range(K)]
    results = run_secure_aggregations(
        attested_checkins(clients, authority, population), vectors, authority, deadline_s=20
    )
    # by the time it sends, its group may be done and its round with it
    assert late.code in ("SECAGG_ROUND_CLOSED", "SESSION_CLOSED") and results[0].outcome is SecureOutcome.EXCLUDED
    assert {results[i].outcome for i in range(1, K + 1)} == {SecureOutcome.INCLUDED}
    (record,) = admin.rounds(population)
    assert record["status"] == "committed" and record["metrics"]["reported"] == K
    model, _ = admin.model(population)
    total = codec.decode_sum(np.sum([vectors[i].astype(np.int64) for i in range(1, K + 1)], axis=0), K)
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + total[name] / total["num_examples"], rtol=1e-5, atol=1e-6)
