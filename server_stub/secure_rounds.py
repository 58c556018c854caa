"""Secure Aggregation inside an FL round: groups of at least k selected devices, one SecAgg
server instance (Aggregator) per group, mailboxes the devices poll over HTTP, per-round
deadlines; the Master Aggregator adds the groups' sums. Driven with ``now``; no I/O here.

The server only ever holds masked inputs and each group's sum: never one device's update."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from device_runtime.secure_sum import SecureSumCodec, config_to_json
from secagg import Round, SecAggConfig, SecAggError, SecAggServer


@dataclass
class _Member:
    client_id: int
    seq: int = 0
    message: bytes | None = None


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
    closes: int = 0
    gone: set[int] = field(default_factory=set)
    by_client: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_client = {m.client_id: sid for sid, m in self.members.items()}

    @property
    def terminal(self) -> bool:
        return self.server.round.terminal

    def receive(self, session_id: str, data: bytes, now: float) -> None:
        self.server.receive(self.members[session_id].client_id, data)
        self._close_if_complete(now)

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
        if self.server.round is Round.MASKED_INPUT_COLLECTION:
            due = self.masked_input_deadline  # the devices train during this round
        else:
            due = self.round_started_at + self.round_timeout_s
        if now >= due:
            self.close(now)

    def close(self, now: float) -> None:
        self.closes += 1
        outgoing = self.server.close_round()
        for client_id, data in outgoing.items():
            member = self.members[self.by_client[client_id]]
            member.seq += 1
            member.message = data
        self.round_started_at = now

    def status(self, session_id: str) -> dict:
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
        if self.server.round is Round.COMPLETED:
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
    """``min_group_size`` is k: no Aggregator sums fewer devices than that."""

    min_group_size: int = 5
    round_timeout_s: float = 5.0
    secagg_plus: bool | None = None


class SecureRound:
    """The secure part of one FL round."""

    def __init__(
        self,
        codec: SecureSumCodec,
        settings: SecureSettings,
        label: str,
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.codec = codec
        self.settings = settings
        self.label = label
        self.random_bytes = random_bytes
        self.groups: list[SecureGroup] = []
        self.by_session: dict[str, SecureGroup] = {}
        self.formed = False

    def form_groups(self, session_ids: list[str], now: float, report_deadlines: Mapping[str, float]) -> list[list[str]]:
        """Split the devices into as many groups of at least k as possible; returns the groups.
        With fewer than k devices no group forms (and the round cannot commit securely).

        The devices train while their group waits for masked inputs: that round lasts until one
        round timeout before the earliest member's report deadline, leaving time for Unmasking."""
        self.formed = True
        k = self.settings.min_group_size
        count = len(session_ids) // k
        if count == 0:
            return []
        parts = [list(p) for p in np.array_split(np.array(session_ids, dtype=object), count)]
        for index, members in enumerate(parts):
            n = len(members)
            config = SecAggConfig.for_cohort(
                n,
                self.codec.vector_length,
                bitwidth=self.codec.bitwidth,
                session_label=f"{self.label}/group-{index}".encode(),
                secagg_plus=self.settings.secagg_plus,
            )
            server = SecAggServer(config, range(1, n + 1), random_bytes=self.random_bytes)
            group = SecureGroup(
                index,
                server,
                {sid: _Member(client_id=i + 1) for i, sid in enumerate(members)},
                self.settings.round_timeout_s,
                now,
                min(report_deadlines[sid] for sid in members) - self.settings.round_timeout_s,
            )
            self.groups.append(group)
            for sid in members:
                self.by_session[sid] = group
        return parts

    @property
    def version(self) -> int:
        """Changes whenever some device's view (``status``) may have changed."""
        return int(self.formed) + sum(g.closes for g in self.groups)

    def status(self, session_id: str) -> dict:
        group = self.by_session.get(session_id)
        if group is None:
            return {"status": "waiting" if not self.formed else "excluded"}
        return group.status(session_id)

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

    def stats(self) -> dict:
        """Groups formed, completed and aborted (a group still running counts as neither)."""
        rounds = [g.server.round for g in self.groups]
        return {
            "groups": len(rounds),
            "completed": sum(r is Round.COMPLETED for r in rounds),
            "aborted": sum(r is Round.ABORTED for r in rounds),
            "summed_devices": sum(len(g.server.summed_clients) for g in self.groups if g.server.round is Round.COMPLETED),
        }

    def group_sum(self, group: SecureGroup) -> tuple[dict[str, np.ndarray], list[str]]:
        """The group's sum as float tensors, and the sessions it includes."""
        total = group.server.result()
        summed = group.summed_sessions()
        return self.codec.decode_sum(total, len(summed)), summed


__all__ = ["SecureGroup", "SecureRound", "SecureSettings"]
