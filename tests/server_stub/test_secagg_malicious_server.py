"""Attacks of a malicious server on Secure Aggregation, against the real device runtime.

The server is the real ``FLService`` and ASGI app over real HTTP; each attack replaces only the
piece of the secure round it needs (the group's configuration, who is in the roster, the
survivor lists, the group assignment, the SecAgg+ graph). The devices are real ``FLRuntime``s
with attested keys and the authority's trust anchor; each attack must fail, and the devices must
say why they aborted: in their session result, in opstats, and to the server."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pytest

from device_runtime import DEFAULT_SECAGG_POLICY, Outcome, SecAggPolicy
from emulator import AttestationAuthority
from secagg import Round, SecAggClient, SecAggServer, harary_neighbours, parse_message
from secagg.messages import ConsistencyRequest, UnmaskRequest
from server_stub import AdminClient, FLService
from server_stub.secure_rounds import SecureRound
from tests.support import AttestedRuntimes, deploy_secure, on_secure_rounds

POLICY = DEFAULT_SECAGG_POLICY  # an attested cohort, ConsistencyCheck, committed groups


class Attack:
    """What a malicious server changes in a secure round (nothing, by default)."""

    authority: AttestationAuthority | None = None  # the one the devices trust: a server may own devices too

    def secure_round(self, secure: SecureRound) -> None:
        secure.__class__ = type("Malicious" + type(self).__name__, (type(secure),), self.overrides(secure))

    def overrides(self, secure: SecureRound) -> dict:
        return {}


def group_config(changed) -> dict:
    """``overrides`` of an attack whose groups run their aggregators on ``changed(config)``: the
    fields of the honest group configuration it replaces."""

    def _aggregator(self, config, n, graph_seed, verify_peer=None):  # a malicious server checks no key
        config = dataclasses.replace(config, **changed(config))
        return SecAggServer(config, range(1, n + 1), random_bytes=self.random_bytes, graph_seed=graph_seed)

    return {"_aggregator": _aggregator}


@dataclass
class Harness:
    """A test's population on the module's attested server (``service``), whose secure rounds the
    attack opens, and the test's attested devices."""

    admin: AdminClient
    population: str
    fleet: AttestedRuntimes
    service: FLService

    def run(self) -> list:
        return self.fleet.run()


@pytest.fixture
def harness(attested_server, attested_admin, authority, population, attested_runtimes, monkeypatch):
    """``make(attack, devices=5, min_group=5, policy=POLICY)``: deploys a secure task whose rounds
    ``attack`` changes, and ``devices`` attested runtimes under ``policy`` to run it."""

    def make(attack: Attack, devices: int = 5, *, min_group: int = 5, policy: SecAggPolicy = POLICY) -> Harness:
        attack.authority = authority
        on_secure_rounds(monkeypatch, attested_server, population, attack.secure_round)
        deploy_secure(
            attested_admin,
            population,
            goal_count=devices,
            secagg_min_group_size=min_group,
            secagg_round_timeout_s=4.0,
        )
        fleet = attested_runtimes(attested_server.url, population, devices, secagg_policy=policy)
        return Harness(attested_admin, population, fleet, attested_server.service)

    return make


def refusals(h: Harness, results: list) -> list[str]:
    """Each refusing device's reason, checked to be in its session result and its opstats."""
    reasons = []
    for i, res in enumerate(results):
        if res is None or res.rejection_code != "SECAGG_REFUSED":
            continue
        assert res.outcome is Outcome.REPORT_REJECTED
        (event,) = [e for e in res.events if e.detail.get("code") == "SECAGG_REFUSED"]
        stored = [
            e
            for s in h.fleet.opstats[i].sessions(h.population)
            for e in s.events
            if e.detail.get("code") == "SECAGG_REFUSED"
        ]
        assert [e.detail["reason"] for e in stored] == [event.detail["reason"]]
        reasons.append(event.detail["reason"])
    return reasons


def never_included(results: list) -> None:
    assert all(r is not None and r.outcome is not Outcome.COMPLETED for r in results)


# ------------------------------------------------------------------------------ the attacks


class LowThreshold(Attack):
    """The group's configuration asks for t = 2 (rebuild a device's key from 2 shares)."""

    def overrides(self, secure):
        return group_config(lambda config: {"threshold": 2, "allow_unsafe": True})


def test_a_threshold_too_low_makes_every_device_refuse(harness):
    h = harness(LowThreshold())
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    assert len(reasons) == 5
    assert all("privacy floor" in r and "threshold 2 is not above 2n/3" in r for r in reasons)
    (record,) = h.admin.rounds(h.population)
    assert record["status"] == "abandoned"


class Sybils(Attack):
    """Adds clients of the server's own to the group's roster: ``uncertified`` keys, or one
    certified device (the server's) in two seats."""

    def __init__(self, certified: bool, count: int = 2) -> None:
        self.certified = certified
        self.count = count

    def overrides(self, secure):
        attack = self

        class Careless(SecAggServer):  # takes any advertised keys, as the sybils need
            def _receive_keys(self, client_id, msg):
                return (msg.c_pk, msg.s_pk, msg.sig_pk, msg.key_sig, msg.credential)

            def close_round(self):  # the sybils' messages stay with the server
                out = super().close_round()
                return {u: out[u] for u in out if u <= len(self.cohort) - attack.count}

        def _aggregator(self, config, n, graph_seed, verify_peer=None):  # a malicious server checks no key
            ids = range(1, n + attack.count + 1)
            server = Careless(
                dataclasses.replace(config, allow_unsafe=True),
                ids,
                random_bytes=self.random_bytes,
                graph_seed=graph_seed,
            )
            if not attack.certified:
                signers = [None] * attack.count  # a fresh, uncertified key each
            else:
                own = attack.authority.new_device_attestor("emulated-phone", time.time()).secagg_signer()
                signers = [own] * attack.count  # the server's one certified device, twice
            for j, signer in enumerate(signers):
                sybil = SecAggClient(n + 1 + j, config, np.zeros(config.vector_length, np.int64), signer=signer)
                server.receive(n + 1 + j, sybil.start())
            return server

        return {"_aggregator": _aggregator}


@pytest.mark.parametrize("kind", ["uncertified", "one_device_twice"])
def test_a_sybil_roster_makes_every_device_refuse(harness, kind):
    h = harness(Sybils(certified=kind == "one_device_twice"))
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    assert len(reasons) == 5
    want = "is not certified by the trust anchor" if kind == "uncertified" else "one device twice"
    assert all(want in r for r in reasons), reasons


class SplitSurvivors(Attack):
    """Tells one device that another dropped (to get that one's key share from it) while the
    rest are told it survived (to get its self-mask shares), then hands the victim the others'
    ConsistencyCheck signatures."""

    def overrides(self, secure):
        class Splitting(SecAggServer):
            victim, claimed_dropped = 1, 2

            def close_round(self):
                out = dict(super().close_round())
                if self.round is Round.CONSISTENCY_CHECK and self.victim in out:
                    msg = parse_message(out[self.victim])
                    lie = msg.survivors[msg.survivors != self.claimed_dropped]
                    out[self.victim] = ConsistencyRequest(msg.session_tag, lie).to_bytes()
                elif self.round is Round.UNMASKING:
                    honest = parse_message(next(iter(out.values())))
                    lie = honest.survivors[honest.survivors != self.claimed_dropped]
                    sigs = honest.signatures[honest.signatures["id"] != self.claimed_dropped]
                    out[self.victim] = UnmaskRequest(honest.session_tag, lie, sigs).to_bytes()
                return out

            def _receive_signature(self, client_id, msg):
                return msg.signature if client_id == self.victim else super()._receive_signature(client_id, msg)

        def _aggregator(self, config, n, graph_seed, verify_peer=None):  # a malicious server checks no key
            return Splitting(config, range(1, n + 1), random_bytes=self.random_bytes, graph_seed=graph_seed)

        return {"_aggregator": _aggregator}


def test_split_survivor_lists_make_the_victim_refuse(harness):
    h = harness(SplitSurvivors(), devices=6)
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    # the victim finds the others' signatures are not over its list; they find the victim's is
    # not over theirs: nobody reveals a share, so neither the victim's key nor its mask leaks
    assert len(reasons) == 6 and all("consistency signature of client" in r and "does not verify" in r for r in reasons)
    assert sum("client 1 does not verify" in r for r in reasons) == 5


class ForgedGroups(Attack):
    """Puts two devices in each other's group (e.g. to fill a target's group with its own)."""

    def overrides(self, secure):
        def _partition(self, ordered_keys):
            groups = SecureRound._partition(self, ordered_keys)
            groups[0][0], groups[1][0] = groups[1][0], groups[0][0]
            return groups

        return {"_partition": _partition}


def test_a_forged_group_assignment_is_refused(harness):
    """The two devices the server moved refuse before they advertise a key; a device that saw a
    moved one in its roster (had it advertised) would refuse too (tests/secagg)."""
    h = harness(ForgedGroups(), devices=12)
    results = h.run()
    reasons = refusals(h, results)
    moved = [r for r in reasons if "another group or seat than the revealed seed gives" in r]
    assert len(moved) == 2
    assert all("not a member of the group the committed seed assigns" in r for r in reasons if r not in moved)
    for res in results:
        if res.rejection_code == "SECAGG_REFUSED" and any(
            "another group" in str(e.detail.get("reason", "")) for e in res.events
        ):
            assert res.outcome is not Outcome.COMPLETED


class ForgedGraph(Attack):
    """SecAgg+ with a graph the server drew itself instead of the one the seed gives."""

    def overrides(self, secure):
        class OwnGraph(SecAggServer):
            def _close_advertise(self):
                out = super()._close_advertise()  # rosters are built lazily, from the graph below
                self._neighbours = harary_neighbours(
                    sorted(self._keys), self.config.degree, np.random.default_rng(0).bytes
                )
                return out

        def _aggregator(self, config, n, graph_seed, verify_peer=None):  # a malicious server checks no key
            plus = dataclasses.replace(config, degree=4, threshold=4)
            return OwnGraph(plus, range(1, n + 1), random_bytes=self.random_bytes, graph_seed=graph_seed)

        return {"_aggregator": _aggregator}


def test_a_forged_secagg_plus_graph_is_refused(harness):
    # a floor that allows SecAgg+ at this size: few colluders assumed, weak bounds (a test fleet)
    policy = SecAggPolicy(require_attested_cohort=True, corrupt_fraction=0.02, dropout_rate=0.01, sigma=10, eta=5)
    h = harness(ForgedGraph(), devices=12, min_group=12, policy=policy)
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    assert reasons and any("neighbourhood the revealed seed and the advertised keys give" in r for r in reasons)


class SwappedSeed(Attack):
    """Reveals another seed than the one it committed to while the devices waited (one chosen
    after seeing who checked in)."""

    def overrides(self, secure):
        def form_groups(self, session_ids, now, report_deadlines, member_keys=None):
            self.seed = bytes(32)
            return SecureRound.form_groups(self, session_ids, now, report_deadlines, member_keys)

        return {"form_groups": form_groups}


def test_a_seed_that_does_not_open_the_commitment_is_refused(harness):
    h = harness(SwappedSeed())
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    assert len(reasons) == 5  # the commitment came with each device's check-in answer
    assert all("does not open the commitment the server showed before selection" in r for r in reasons)


class GarbledState(Attack):
    """Once a device is in its group, the server's answers to its polls are garbled."""

    def __init__(self, garble: dict) -> None:
        self.garble = garble

    def overrides(self, secure):
        original, garble = type(secure).status, self.garble

        def status(self, session_id):
            state = original(self, session_id)
            return {**state, **garble} if state.get("message") else state

        return {"status": status}


@pytest.mark.parametrize("garble", [{"seq": "7"}, {"seq": 2.5}, {"message": 12345}, {"message": "not base64!"}])
def test_garbled_secure_aggregation_state_is_refused_not_a_crash(harness, garble):
    h = harness(GarbledState(garble), devices=5)
    results = h.run()
    assert all(r is not None for r in results)  # every session ended in a result: none raised
    never_included(results)
    assert len(refusals(h, results)) == 5


class LongerVector(Attack):
    """The group's configuration names a vector 1,000 times longer than the plan's secure-sum
    outputs: each device found out at its masked input, after training for nothing, with a
    ``secagg`` error the runtime did not catch (and a length of 2^40 asked for that much mask)."""

    def overrides(self, secure):
        return group_config(lambda config: {"vector_length": config.vector_length * 1000})


def test_a_vector_length_not_the_plans_makes_every_device_refuse_before_training(harness):
    h = harness(LongerVector())
    results = h.run()
    never_included(results)
    reasons = refusals(h, results)
    assert len(reasons) == 5 and all("vector_length" in r and "secure-sum outputs" in r for r in reasons)
    assert all("training_started" not in [e.kind for e in r.events] for r in results)
