"""The group coordinator (the classic protocol): members, generations, rebalances, static membership, offsets.

A rebalance is a round: every member rejoins, then the generation moves and the leader's assignor
hands out partitions. A member whose process is alive rejoins at once under cooperative-sticky (its
client's background thread does it, whatever the application is doing); under an eager strategy
it rejoins only after its application served the revocation of everything it held (at its next
poll). A round waits for every member; one that does not rejoin within the rebalance timeout (the
members' largest max.poll.interval.ms) is removed, and so is any member whose heartbeats stop for
its session timeout (a frozen or killed process, a static member closed). Under cooperative-sticky a
partition moving between members is first revoked by its owner (at its poll), whose rejoin then
starts the round that hands it to its new owner.

A static member (group.instance.id) does not leave when it closes; a consumer joining under its
instance id takes its member's place, generation and assignment at once with no rebalance, and the
member it replaced is fenced. Offsets: a commit is checked against the member and generation that
send it (KIP-447 for transactional ones); transactional offsets stay pending until their
transaction ends, and a read_committed `committed()` waits while any are pending.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import KafkaError

from tests.tools.sim.kafka.assignors import COOPERATIVE, TP, assign

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

EMPTY, PREPARING, STABLE = "Empty", "PreparingRebalance", "Stable"
# Kafka's offset.metadata.max.bytes default: metadata of this many characters or more is refused.
OFFSET_METADATA_MAX = 4096


class GroupRefused(Exception):
    """The coordinator refused a request with this Kafka error code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Unstable(Exception):
    """Offsets of an open transaction are pending for a partition asked about (read_committed)."""


class MemberClient(Protocol):
    """The consumer side of a member, which the coordinator tells what happened."""

    client_id: str  # its client.id, as DescribeGroups lists it
    process: str

    def alive(self) -> bool: ...

    def rebalance_started(self, generation: int) -> bool:
        """A round began: True if the member rejoins at once (with what it owns now)."""
        ...

    def synced(self, generation: int, added: set[TP], revoke: set[TP]) -> None: ...

    def fenced(self) -> None: ...

    def removed(self) -> None: ...


@dataclass
class Member:
    member_id: str
    instance_id: str | None
    client: MemberClient
    topics: tuple[str, ...]
    strategies: tuple[str, ...]
    session_timeout_ms: int
    rebalance_timeout_ms: int
    owned: set[TP] = field(default_factory=set)
    generation: int = -1
    rejoined: bool = False
    # When its heartbeats stopped (None while they flow).
    silent_since: float | None = None


@dataclass
class Group:
    group_id: str
    generation: int = 0
    state: str = EMPTY
    protocol: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    static: dict[str, str] = field(default_factory=dict)
    offsets: dict[TP, tuple[int, str | None]] = field(default_factory=dict)
    pending: dict[int, dict[TP, tuple[int, str | None]]] = field(default_factory=dict)
    round_serial: int = 0

    @property
    def cooperative(self) -> bool:
        return self.protocol == COOPERATIVE


class GroupCoordinator:
    def __init__(self, cluster: KafkaCluster):
        self.cluster = cluster
        self.groups: dict[str, Group] = {}
        self._ids = itertools.count(1)

    def group(self, group_id: str) -> Group:
        return self.groups.setdefault(group_id, Group(group_id))

    # ----- membership ------------------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        client: MemberClient,
        *,
        instance_id: str | None,
        topics: tuple[str, ...],
        strategies: tuple[str, ...],
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
    ) -> Member:
        g = self.group(group_id)
        if g.members and not set(strategies) & set(self._common_strategies(g)):
            raise GroupRefused(KafkaError.INCONSISTENT_GROUP_PROTOCOL)
        member_id = f"{instance_id or 'rdkafka'}-{next(self._ids):04d}"
        member = Member(member_id, instance_id, client, topics, strategies, session_timeout_ms, rebalance_timeout_ms)
        old_id = g.static.get(instance_id) if instance_id is not None else None
        if old_id is not None and old_id in g.members:
            # A static member's place taken over: same generation and assignment, no rebalance.
            old = g.members.pop(old_id)
            member.owned, member.generation, member.rejoined = set(old.owned), old.generation, old.rejoined
            g.members[member_id] = member
            g.static[instance_id] = member_id
            old.client.fenced()
            if g.state == STABLE:
                client.synced(member.generation, set(member.owned), set())
            else:
                # Mid-round: the new client's JoinGroup names no partition owned (it was told of none), so the
                # round's assignment is what it is given; inheriting the old one's would tell it nothing.
                member.owned = set()
                member.rejoined = True
                self._maybe_complete(g)
            return member
        g.members[member_id] = member
        if instance_id is not None:
            g.static[instance_id] = member_id
        if g.state == PREPARING:
            # A JoinGroup during a round is that round's join: the round waits for it no further.
            member.rejoined = True
        self._rebalance(g)
        return member

    def leave(self, group_id: str, member_id: str) -> None:
        g = self.group(group_id)
        member = g.members.pop(member_id, None)
        if member is None:
            return
        if member.instance_id is not None and g.static.get(member.instance_id) == member_id:
            del g.static[member.instance_id]
        self._rebalance(g)

    def rejoin(self, group_id: str, member_id: str, owned: set[TP]) -> bool:
        """A member rejoins the round with what it still owns; False if it is no longer a member."""
        g = self.group(group_id)
        member = g.members.get(member_id)
        if member is None:
            return False
        member.owned = set(owned)
        if g.state != PREPARING:
            self._rebalance(g)
        if g.members.get(member_id) is member:
            member.rejoined = True
            self._maybe_complete(g)
        return True

    def revoked(self, group_id: str, member_id: str, tps: set[TP]) -> None:
        """A cooperative member's application gave up `tps`: it rejoins, so they can move on."""
        g = self.group(group_id)
        member = g.members.get(member_id)
        if member is not None:
            member.owned -= tps
            self.rejoin(group_id, member_id, member.owned)

    def silent(self, group_id: str, member_id: str) -> None:
        """The member's heartbeats stopped (its process froze, died, or a static member closed)."""
        member = self.group(group_id).members.get(member_id)
        if member is not None and member.silent_since is None:
            member.silent_since = self.cluster.env.now()
            self._expire_later(group_id, member)

    def heard(self, group_id: str, member_id: str) -> bool:
        """The member heartbeats again; False if it was removed meanwhile."""
        member = self.group(group_id).members.get(member_id)
        if member is None:
            return False
        member.silent_since = None
        return True

    def coordinator_restarted(self) -> None:
        """After the broker came back: every silent member gets a whole session timeout from now."""
        now = self.cluster.env.now()
        for g in self.groups.values():
            for member in g.members.values():
                if member.silent_since is not None:
                    member.silent_since = now
                    self._expire_later(g.group_id, member)

    def _expire_later(self, group_id: str, member: Member) -> None:
        since = member.silent_since
        assert since is not None
        self.cluster.env.call_at(
            since + member.session_timeout_ms / 1000, lambda: self._expire(group_id, member, since)
        )

    def _expire(self, group_id: str, member: Member, since: float) -> None:
        with self.cluster.lock:
            g = self.group(group_id)
            if g.members.get(member.member_id) is not member or member.silent_since != since:
                return
            if not self.cluster.broker_up:
                return  # the coordinator restarts the session clock when it is back
            self._remove(g, member)

    def _remove(self, g: Group, member: Member) -> None:
        del g.members[member.member_id]
        if member.instance_id is not None and g.static.get(member.instance_id) == member.member_id:
            del g.static[member.instance_id]
        member.client.removed()
        self._rebalance(g)

    # ----- rounds ----------------------------------------------------------------------------------

    def _common_strategies(self, g: Group) -> list[str]:
        members = list(g.members.values())
        return [s for s in members[0].strategies if all(s in m.strategies for m in members)] if members else []

    def _rebalance(self, g: Group) -> None:
        if not g.members:
            g.state, g.protocol = EMPTY, None
            return
        if g.state != PREPARING:
            g.state = PREPARING
            g.round_serial += 1
            serial = g.round_serial
            timeout = max(m.rebalance_timeout_ms for m in g.members.values()) / 1000
            self.cluster.env.call_at(self.cluster.env.now() + timeout, lambda: self._round_timed_out(g, serial))
            for member in list(g.members.values()):
                member.rejoined = member.client.rebalance_started(g.generation)
        self._maybe_complete(g)

    def _round_timed_out(self, g: Group, serial: int) -> None:
        with self.cluster.lock:
            if g.state != PREPARING or g.round_serial != serial:
                return
            for member in [m for m in g.members.values() if not m.rejoined]:
                del g.members[member.member_id]
                if member.instance_id is not None and g.static.get(member.instance_id) == member.member_id:
                    del g.static[member.instance_id]
                member.client.removed()
            self._maybe_complete(g)

    def _maybe_complete(self, g: Group) -> None:
        if g.state != PREPARING or not all(m.rejoined for m in g.members.values()):
            return
        if not g.members:
            g.state, g.protocol = EMPTY, None
            return
        g.generation += 1
        g.protocol = self._common_strategies(g)[0]
        g.state = STABLE
        ids = sorted(g.members)
        target = assign(
            g.protocol,
            ids,
            {m: g.members[m].topics for m in ids},
            self.cluster.partition_counts(),
            {m: g.members[m].owned for m in ids},
        )
        owners = {tp: m for m in ids for tp in g.members[m].owned}
        for m in ids:
            member = g.members[m]
            member.generation = g.generation
            if g.cooperative:
                # A partition still owned by another member waits for its revocation and the next round.
                added = {tp for tp in target[m] - member.owned if owners.get(tp, m) == m}
                revoke = member.owned - target[m]
                member.owned |= added
            else:
                added, revoke = set(target[m]), set()
                member.owned = set(target[m])
            member.client.synced(g.generation, added, revoke)

    # ----- offsets ---------------------------------------------------------------------------------

    def _validate(
        self, g: Group, member_id: str, generation: int, instance_id: str | None, *, transactional: bool = False
    ) -> None:
        if generation < 0 and not g.members:
            return  # a standalone commit, allowed while the group has no members
        if generation < 0 and not member_id and instance_id is None:
            if transactional:
                return  # not checked at all: TxnOffsetCommit before KIP-447 carried no member
            raise GroupRefused(KafkaError.UNKNOWN_MEMBER_ID)
        if instance_id is not None and g.static.get(instance_id, member_id) != member_id:
            raise GroupRefused(KafkaError.FENCED_INSTANCE_ID)
        if member_id not in g.members:
            raise GroupRefused(KafkaError.UNKNOWN_MEMBER_ID)
        if generation != g.generation:
            raise GroupRefused(KafkaError.ILLEGAL_GENERATION)

    @staticmethod
    def _check_metadata(offsets: list[tuple[TP, int, str | None]]) -> None:
        for _, _, metadata in offsets:
            if metadata is not None and len(metadata) + 1 > OFFSET_METADATA_MAX:
                raise GroupRefused(KafkaError.OFFSET_METADATA_TOO_LARGE)

    def commit(self, group_id: str, member_id: str, generation: int, instance_id: str | None, offsets) -> None:
        g = self.group(group_id)
        self._validate(g, member_id, generation, instance_id)
        self._check_metadata(offsets)
        for tp, offset, metadata in offsets:
            g.offsets[tp] = (offset, metadata)

    def txn_commit(self, group_id: str, producer_id: int, md: Any, offsets) -> None:
        g = self.group(group_id)
        self._validate(g, md.member_id, md.generation, md.instance_id, transactional=True)
        self._check_metadata(offsets)
        pending = g.pending.setdefault(producer_id, {})
        for tp, offset, metadata in offsets:
            pending[tp] = (offset, metadata)

    def end_txn(self, group_id: str, producer_id: int, commit: bool) -> None:
        g = self.group(group_id)
        pending = g.pending.pop(producer_id, {})
        if commit:
            g.offsets.update(pending)

    def fetch(self, group_id: str, tps: list[TP], require_stable: bool) -> dict[TP, tuple[int, str | None]]:
        g = self.group(group_id)
        if require_stable and any(tp in p for p in g.pending.values() for tp in tps):
            raise Unstable(group_id)
        return {tp: g.offsets.get(tp, (-1001, None)) for tp in tps}

    def has_pending(self, group_id: str, tps: list[TP]) -> bool:
        g = self.group(group_id)
        return any(tp in p for p in g.pending.values() for tp in tps)

    def members_of(self, group_id: str) -> dict[str, set[TP]]:
        """Who holds what now, by member id (a test's view of the coordinator)."""
        return {m: set(member.owned) for m, member in self.group(group_id).members.items()}
