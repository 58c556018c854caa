"""Secure Aggregation inside an FL round: groups of at least k selected devices, one SecAgg
server instance (Aggregator) per group, mailboxes the devices poll over HTTP, per-round
deadlines; the Master Aggregator adds the groups' sums. Driven with ``now``; no I/O here.

The server only ever holds masked inputs and each group's sum: never one device's update. A sum
outside the round's bounds (``influence.check_group_sum``), or one that completes after its round
closed, is dropped: its devices are told why, and the round's statistics list it.

Nobody picks a group alone: when the round opens the server draws a seed and shows every waiting
device its commitment H(seed); when selection ends it reveals the seed, and the groups follow
from it mixed with every selected device's key (its attested device key's hash, or its session's
when the server does not attest), by ``secagg.assign_groups``. Each group's SecAgg+ graph seed is
derived from the round's seed, and every group's configuration asks for ConsistencyCheck (a
task setting, on by default) and for at least k inputs in any sum it releases.

What this does not stop: the server knows its seed before the devices advertise keys, so with
devices of its own it can try rosters (each try reshuffles every group and graph) until one suits
it; each try succeeds only with the probability the parameters bound (2^-sigma per neighbourhood
for SecAgg+), so m tries cost log2(m) bits of that margin.

In a distributed-DP round (``ddp_rounds``) the groups' secure sums are of the devices' noised
encodings, modulo ``2^bitwidth``; the round's parameters are fixed once the groups are formed and
sent with each group's configuration, and a completed group's sum is decoded with them."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from device_runtime.attestation import device_key_hash
from device_runtime.ddp import DDPError, DDPParams
from device_runtime.dp_policy import bound_label, releasable_minimum, rotation_seed, round_answer
from device_runtime.secure_client import session_member_key
from device_runtime.secure_sum import SecureSumCodec, config_to_json
from secagg import (
    DuplicateMessage,
    OutOfOrder,
    PeerVerifier,
    Round,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    UnexpectedClient,
    assign_groups,
    group_seed,
    seed_commitment,
)

from .ddp_rounds import DistributedDP, decode_group
from .rounds import RoundConfig

#: Why a completed group's sum, counted in its round, went unused: the round was abandoned all the same.
ROUND_ABANDONED = "its round was abandoned: the sum went unused"


@dataclass
class _Member:
    client_id: int
    seq: int = 0
    message: bytes | None = None
    taken: set[bytes] = field(default_factory=set)  # SHA-256 of each message the group took from it


@dataclass
class SecureGroup:
    """One Aggregator: a SecAgg instance over some of the round's devices."""

    index: int
    server: SecAggServer
    members: dict[str, _Member]
    round_timeout_s: float
    round_started_at: float
    masked_input_deadline: float
    harvested: bool = False
    dropped: str | None = None  # why its completed sum was left out of the round (out of bounds, came too late)
    aborted_in: str | None = None  # the protocol round it aborted in (too few answers, a refused message)
    ended_at: float | None = None  # when it completed or aborted: its last message, or the due time that closed it
    closes: int = 0
    gone: set[int] = field(default_factory=set)
    by_client: dict[int, str] = field(default_factory=dict)
    assignment: dict = field(default_factory=dict)  # what a device needs to recompute its group

    def __post_init__(self) -> None:
        self.by_client = {m.client_id: sid for sid, m in self.members.items()}

    @property
    def terminal(self) -> bool:
        return self.server.round.terminal

    def receive(self, session_id: str, data: bytes, now: float) -> None:
        """Hand the member's message to the protocol. A message the group already took from it is
        taken again, changing nothing: a device whose answer was lost sends it again, and must not
        be told it was refused (or that its group moved on) when its keys or masked input are in.
        A member whose message the protocol refuses (malformed, badly signed, keys its peers would
        refuse) is, like one that left, not waited for: an honest device ends its part on the
        refusal, and a malicious one must not hold its group to the round's deadline."""
        member = self.members[session_id]
        digest = hashlib.sha256(data).digest()
        if digest in member.taken:
            return
        before = self.server.round
        try:
            self.server.receive(member.client_id, data)
        except (DuplicateMessage, OutOfOrder, UnexpectedClient):
            raise  # not this message's content: another one taken, or a round that moved on
        except SecAggError:
            self.gone.add(member.client_id)
            self._close_if_complete(now)
            raise
        finally:
            self._note_abort(before)
        member.taken.add(digest)
        self._close_if_complete(now)

    def _note_abort(self, before: Round) -> None:
        if self.server.round is Round.ABORTED and self.aborted_in is None:
            self.aborted_in = before.value

    def leave(self, session_id: str, now: float) -> None:
        """A device that told the server it stopped: the round need not wait for it. (If its
        masked input is already in, the protocol still recovers it through its peers' shares.)"""
        self.gone.add(self.members[session_id].client_id)
        self._close_if_complete(now)

    def _close_if_complete(self, now: float) -> None:
        server = self.server
        if not server.round.terminal and server.expected_clients - self.gone <= server.responded:
            self.close(now)

    def tick(self, now: float) -> None:
        if self.terminal:
            return
        current = self.server.round
        due = self.round_started_at + self.round_timeout_s
        if current is Round.MASKED_INPUT_COLLECTION:
            due = self.masked_input_deadline  # the devices train during this round
        elif current in (Round.CONSISTENCY_CHECK, Round.UNMASKING):
            # by its place after the masked inputs' deadline too: the server's tick comes a little
            # after each due time, and the delays must not add up past the devices' deadlines
            place = 2 if current is Round.UNMASKING and self.server.config.consistency_check else 1
            due = min(due, self.masked_input_deadline + place * self.round_timeout_s)
        if now >= due:
            self.close(now, due)

    def close(self, now: float, due: float | None = None) -> None:
        """Close the protocol round at ``now``, the next one timed from then; ``due``: when it was
        due, the moment the group ends if this close ends it (a tick long after it counts then)."""
        self.closes += 1
        before = self.server.round
        outgoing = self.server.close_round()
        self._note_abort(before)
        if self.terminal:
            self.ended_at = now if due is None else min(now, due)
        for client_id, data in outgoing.items():
            member = self.members[self.by_client[client_id]]
            member.seq += 1
            member.message = data
        self.round_started_at = now

    def status(self, session_id: str, ddp: dict | None = None) -> dict:
        member = self.members[session_id]
        out: dict = {
            "status": "active",
            "group": self.index,
            "client_id": member.client_id,
            "config": config_to_json(self.server.config),
            "round": self.server.round.value,
            "seq": member.seq,
            "message": base64.b64encode(member.message).decode() if member.message else None,
        }
        if ddp is not None:
            out["ddp"] = ddp
        if self.server.round is Round.ADVERTISE_KEYS:
            out["assignment"] = self.assignment
            out["group_size"] = len(self.members)
        if self.dropped is not None:
            out["status"] = "aborted"
            out["reason"] = f"the server left the group's sum out of the round: {self.dropped}"
        elif self.server.round is Round.COMPLETED:
            out["status"] = "completed"
            out["included"] = member.client_id in self.server.summed_clients
        elif self.server.round is Round.ABORTED:
            out["status"] = "aborted"
            out["reason"] = self.server.abort_reason
        return out

    def summed_sessions(self) -> list[str]:
        return [self.by_client[c] for c in sorted(self.server.summed_clients)]


@dataclass(frozen=True)
class SecureSettings:
    """``min_group_size`` is k: no Aggregator sums fewer devices than that. Groups are formed of at
    least ``min_group_size + spare`` devices when there are enough (``secagg.assign_groups``): the
    spare ones may drop out (``for_config`` sizes them to the task's ``secagg_target_group_size``)."""

    min_group_size: int = 5
    round_timeout_s: float = 5.0
    secagg_plus: bool | None = None
    consistency_check: bool = True
    spare: int = 1

    @classmethod
    def for_config(cls, config: RoundConfig) -> SecureSettings:
        """A task's settings: its k, round timeout and ConsistencyCheck, and groups of
        ``secagg_target_group_size`` (at least k + 1). Without ConsistencyCheck every group takes
        the complete graph: devices refuse a SecAgg+ group without it under any policy
        (``SecAggPolicy.violation``), and groups of some 370 devices or more were SecAgg+."""
        k = config.secagg_min_group_size
        return cls(
            k,
            config.secagg_round_timeout_s,
            secagg_plus=None if config.secagg_consistency_check else False,
            consistency_check=config.secagg_consistency_check,
            spare=max(1, config.secagg_target_group_size - k),
        )

    @property
    def finalization_s(self) -> float:
        """How long the protocol's rounds after MaskedInputCollection may take before the devices'
        deadlines close the round: a round timeout each for ConsistencyCheck (when on) and
        Unmasking, and one more for the server to count the last answers."""
        return (3 if self.consistency_check else 2) * self.round_timeout_s


class SecureRound:
    """The secure part of one FL round."""

    def __init__(
        self,
        codec: SecureSumCodec,
        settings: SecureSettings,
        label: str,
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        ddp: DistributedDP | None = None,
        certifies: PeerVerifier | None = None,
    ) -> None:
        """``ddp``: the task's distributed-DP settings, when its devices add the noise.
        ``certifies(public_key, credential)``: whether the attestation authority certified the key
        (on a server that attests its devices). Each group's Aggregator then takes at
        AdvertiseKeys only keys signed by an attested key of one of its members, with its
        certificate: the keys every honest member checks its roster for, so that one device
        advertising others (its certificate left out, a key of its own) is refused alone instead of
        making every peer refuse the roster and the group abort."""
        self.codec = codec
        self.certifies = certifies
        self.ddp = ddp
        self.ddp_params: DDPParams | None = None  # once the groups are formed
        self.ddp_error: str | None = None
        self._ddp_wire: dict | None = None
        self.settings = settings
        self.label = label
        self.random_bytes = random_bytes
        self.groups: list[SecureGroup] = []
        self.by_session: dict[str, SecureGroup] = {}
        self.formed = False
        self.seed = random_bytes(32)
        self.commitment = seed_commitment(self.seed)
        self.rotation_seed = rotation_seed(self.commitment)

    def form_groups(
        self,
        session_ids: list[str],
        now: float,
        report_deadlines: Mapping[str, float],
        member_keys: Mapping[str, bytes] | None = None,
    ) -> list[list[str]]:
        """Split the devices into as many groups of at least k as possible; returns the groups.
        With fewer than k devices no group forms (and the round cannot commit securely).

        ``member_keys``: each session's device key hash (attested devices); others use
        ``session_member_key``. The devices train while their group waits for masked inputs:
        that round lasts until ``finalization_s`` before the earliest member's deadline (the
        round's ``RoundCore.finalization_s`` past its report window), leaving time for the rounds
        after it (ConsistencyCheck and Unmasking), so that a group that waits for its slowest
        device still completes before its devices' deadlines close the round."""
        self.formed = True
        k = self.settings.min_group_size
        keys = {sid: (member_keys or {}).get(sid) or session_member_key(sid) for sid in session_ids}
        by_key = {key: sid for sid, key in keys.items()}
        ordered = sorted(by_key)
        parts = [[by_key[key] for key in group] for group in self._partition(ordered)]
        reveal = {
            "seed": base64.b64encode(self.seed).decode(),
            "members": [base64.b64encode(key).decode() for key in ordered],
            "min_group_size": k,
            "spare": self.settings.spare,
        }
        ddp = self.ddp
        configs = []
        for index, members in enumerate(parts):
            config = SecAggConfig.for_cohort(
                len(members),
                self.codec.vector_length if ddp is None else ddp.padded_dim,
                bitwidth=self.codec.bitwidth if ddp is None else 1,  # distributed DP: 2^dp.bitwidth, below
                session_label=f"{self.label}/group-{index}".encode(),
                secagg_plus=self.settings.secagg_plus,
                consistency_check=self.settings.consistency_check,
                min_summed=k,
                graph_commitment=seed_commitment(group_seed(self.seed, index)),
            )
            configs.append(config if ddp is None else dataclasses.replace(config, modulus=1 << ddp.bitwidth))
        if ddp is not None and parts:
            try:  # the fewest devices any group may release, and the largest group
                self.ddp_params = ddp.calibrate(min(map(releasable_minimum, configs)), max(map(len, parts)))
            except DDPError as exc:  # a deploy refuses what cannot fit; a task stored earlier may not
                self.ddp_error = str(exc)
                return []
            answer = round_answer(self.ddp_params, self.rotation_seed)  # every member's session commits to it
            configs = [dataclasses.replace(c, session_label=bound_label(c.session_label, answer)) for c in configs]
        for index, (members, config) in enumerate(zip(parts, configs)):
            n = len(members)
            graph_seed = group_seed(self.seed, index)
            server = self._aggregator(config, n, graph_seed, self._member_check([keys[sid] for sid in members]))
            group = SecureGroup(
                index,
                server,
                {sid: _Member(client_id=i + 1) for i, sid in enumerate(members)},
                self.settings.round_timeout_s,
                now,
                min(report_deadlines[sid] for sid in members) - self.settings.finalization_s,
                assignment={**reveal, "group": index},
            )
            self.groups.append(group)
            for sid in members:
                self.by_session[sid] = group
        return parts

    @property
    def commitment_b64(self) -> str:
        return base64.b64encode(self.commitment).decode()

    def _partition(self, ordered_keys: list[bytes]) -> list[list[bytes]]:
        """The groups, as every device recomputes them from the revealed seed."""
        return assign_groups(self.seed, ordered_keys, self.settings.min_group_size, self.settings.spare)

    def _aggregator(
        self, config: SecAggConfig, n: int, graph_seed: bytes, verify_peer: PeerVerifier | None = None
    ) -> SecAggServer:
        return SecAggServer(
            config, range(1, n + 1), random_bytes=self.random_bytes, graph_seed=graph_seed, verify_peer=verify_peer
        )

    def _member_check(self, member_keys: list[bytes]) -> PeerVerifier | None:
        """What a group's members check of each roster entry (``secure_client``: its key names a
        member, and the authority certified it), when this server attests its devices."""
        certifies = self.certifies
        if certifies is None:
            return None
        members = frozenset(member_keys)
        return lambda public_key, credential: (
            device_key_hash(public_key) in members and certifies(public_key, credential)
        )

    @property
    def version(self) -> int:
        """Changes whenever some device's view (``status``) may have changed."""
        return int(self.formed) + sum(g.closes + (g.dropped is not None) for g in self.groups)

    def status(self, session_id: str) -> dict:
        group = self.by_session.get(session_id)
        if group is None:
            if not self.formed:
                return {"status": "waiting", "commitment": self.commitment_b64}
            return {"status": "excluded"}
        return group.status(session_id, self.ddp_answer())

    def ddp_answer(self) -> dict | None:
        """The round's distributed-DP parameters as the devices receive them (``ddp`` of the state)."""
        if self.ddp_params is None:
            return None
        if self._ddp_wire is None:  # every poll of every member sends it: built once
            self._ddp_wire = round_answer(self.ddp_params, self.rotation_seed)
        return self._ddp_wire

    def receive(self, session_id: str, data: bytes, now: float) -> None:
        """Raises KeyError for a device in no group, SecAggError for a refused message."""
        self.by_session[session_id].receive(session_id, data, now)

    def leave(self, session_id: str, now: float) -> None:
        group = self.by_session.get(session_id)
        if group is not None:
            group.leave(session_id, now)

    def tick(self, now: float) -> list[SecureGroup]:
        """Advance deadlines; returns the groups that finished and were not harvested yet."""
        done = []
        for group in self.groups:
            group.tick(now)
            if group.terminal and not group.harvested:
                group.harvested = True
                done.append(group)
        return done

    def stats(self, committed: bool = True) -> dict:
        """Groups formed, completed (their sums used: none when the round was not ``committed``)
        and aborted (a group still running counts as neither), with the protocol round each
        aborted in (``aborted_in``: counts by round name), and the groups whose sums were dropped,
        with why (out of bounds, the round closed before them, or the round was abandoned after
        them: ``ROUND_ABANDONED``): ``summed_devices`` are the devices the round counted as reported."""
        counted = [g for g in self.groups if g.server.round is Round.COMPLETED and g.dropped is None]
        aborted = [g for g in self.groups if g.server.round is Round.ABORTED]
        dropped = [(g.index, g.dropped) for g in self.groups if g.dropped is not None]
        if not committed:
            dropped = sorted(dropped + [(g.index, ROUND_ABANDONED) for g in counted])
        return {
            "groups": len(self.groups),
            "completed": len(counted) if committed else 0,
            "aborted": len(aborted),
            "aborted_in": dict(sorted(Counter(g.aborted_in or "unknown" for g in aborted).items())),
            "summed_devices": sum(len(g.server.summed_clients) for g in counted),
            "dropped": [{"group": index, "reason": reason} for index, reason in dropped],
            **({"ddp": dict(round_answer(self.ddp_params, self.rotation_seed))} if self.ddp_params is not None else {}),
            **({"ddp_error": self.ddp_error} if self.ddp_error is not None else {}),
        }

    def summed_sessions(self) -> list[str]:
        """The sessions whose inputs the sums of the round's counted groups hold (see ``stats``)."""
        counted = [g for g in self.groups if g.server.round is Round.COMPLETED and g.dropped is None]
        return [sid for g in counted for sid in g.summed_sessions()]

    def drop(self, group: SecureGroup, reason: str) -> None:
        """Leave a completed group's sum out of the round; its devices are told why."""
        group.dropped = reason

    def group_sum(self, group: SecureGroup) -> tuple[dict[str, np.ndarray], list[str]]:
        """The group's sum as float tensors, and the sessions it includes."""
        total = group.server.result()
        summed = group.summed_sessions()
        if self.ddp is not None and self.ddp_params is not None:
            flat = decode_group(total, self.ddp_params, self.rotation_seed, len(summed))
            return self.ddp.group_total(flat, len(summed)), summed
        return self.codec.decode_sum(total, len(summed)), summed


__all__ = ["SecureGroup", "SecureRound", "SecureSettings"]
