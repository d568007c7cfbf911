"""`PendingGroups`: what the trainer's consumer has read of each assigned partition, and what is resolved.

No Kafka here: the consumer feeds it records and tells it what the trainer did; it answers which
groups wait, what to commit (`position.py`), and clears the TQ rows of duplicates no one will read.

A record is unresolved while its group is held, ready, or yielded and not released, or while it
is a duplicate waiting for its original; the consumer's dead-letter outbox holds its own records.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from schemas.finalized import FinalizedGroup
from streams.tq import KVStore
from workers.trainer.errors import IllegalTransition
from workers.trainer.position import PartitionPosition

log = logging.getLogger("rlstream.trainer")

NEW, DUPLICATE, REREAD = "new", "duplicate", "reread"


class PendingState(enum.Enum):
    """Where a record read and not yet resolved stands. A resolved record leaves `PendingGroups`."""

    HELD = "held"  # the policy holds it: not usable at the trainer's version (yet)
    READY = "ready"  # usable now: `select` may hand it out
    YIELDED = "yielded"  # handed out to the trainer, not acked
    DUPLICATE = "duplicate"  # a second record of a group id: waits for its original, resolved with it

    @property
    def waiting(self) -> bool:
        """Held or ready: what backpressure counts and a version step decides again."""
        return self in (PendingState.HELD, PendingState.READY)


HELD, READY, YIELDED = PendingState.HELD, PendingState.READY, PendingState.YIELDED

# Every move a pending record may make, in one place. A decision taken again (a version step, a batch
# withdrawn or given back) makes a waiting or yielded record held or ready; only a ready one is handed
# out, never one handed out already; a duplicate is never decided, it leaves with its original.
_MOVES: dict[PendingState, frozenset[PendingState]] = {
    HELD: frozenset({HELD, READY}),
    READY: frozenset({HELD, READY, YIELDED}),
    YIELDED: frozenset({HELD, READY}),
    PendingState.DUPLICATE: frozenset(),
}


@dataclass
class Pending:
    """A record read and not resolved; its state changes only through `move`."""

    group: FinalizedGroup
    partition: int
    offset: int
    _state: PendingState
    arrival: int = 0  # read order across partitions, for policies that keep arrival order

    @property
    def state(self) -> PendingState:
        return self._state

    def move(self, to: PendingState) -> None:
        """Change state; `IllegalTransition` (a bug, never an expected failure) for a move `_MOVES` does not allow."""
        if to not in _MOVES[self._state]:
            raise IllegalTransition(
                f"group {self.group.group_id} at [{self.partition}]@{self.offset}: {self._state.value} -> {to.value}"
            )
        self._state = to


@dataclass
class _Seen:
    """Where a group id was first read, and whether that group is resolved (released, evicted, dropped)."""

    partition: int
    offset: int
    resolved: bool = False


class PendingGroups:
    """`clear(sample_ids, partition, offset)` disposes of rows no one will read, those of the resolved record
    at that position (`clears.py` says when); by default at once, from `train_partition`."""

    def __init__(
        self,
        store: KVStore,
        train_partition: str,
        max_seen_groups: int,
        clear: Callable[[list[str], int, int], None] | None = None,
    ):
        self._clear = clear if clear is not None else (lambda ids, _p, _o: store.clear(train_partition, ids))
        self._max_seen = max_seen_groups
        self.by_partition: dict[int, dict[int, Pending]] = {}  # partition -> offset -> pending
        self.positions: dict[int, PartitionPosition] = {}
        # Group ids already taken in, the oldest resolved forgotten first past max_seen_groups.
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._duplicates: dict[str, list[Pending]] = {}  # group id -> duplicates waiting for it
        self._arrivals = itertools.count()

    # ----- partitions ---------------------------------------------------------------------------

    def assign(self, partition: int, offset: int, ranges: Iterable[tuple[int, int]]) -> None:
        """From the partition's committed offset (< 0: none) and the resolved ranges its commit names."""
        self.positions[partition] = PartitionPosition.from_commit(offset, ranges)

    def restore(self, partition: int, offset: int, trained: list[tuple[int, int]]) -> None:
        """From a checkpoint: reading starts at `offset`, and records in `trained` were resolved before."""
        self.positions[partition] = PartitionPosition.from_state(offset, trained)

    def revoke(self, partition: int) -> None:
        for p in self.by_partition.pop(partition, {}).values():
            if p.state is PendingState.DUPLICATE:
                self._duplicates[p.group.group_id].remove(p)
                continue
            # A yielded group stays "seen": if its record is read again it must not be yielded twice.
            seen = self._seen.get(p.group.group_id)
            if p.state is not YIELDED and seen is not None and (seen.partition, seen.offset) == (p.partition, p.offset):
                del self._seen[p.group.group_id]
        self.positions.pop(partition, None)

    # ----- intake -------------------------------------------------------------------------------

    def read(self, partition: int, offset: int) -> bool:
        """Note the record at `offset` as read; True when it was resolved before a restart or rebalance."""
        return self.positions.setdefault(partition, PartitionPosition()).read(offset)

    def take(
        self, group: FinalizedGroup, partition: int, offset: int, *, resolved_before: bool
    ) -> tuple[str, Pending | None]:
        """Take in a decoded record: (NEW, its held Pending), (DUPLICATE, None) or (REREAD, None)."""
        if resolved_before:
            # Consumed before a restart or a rebalance, as the commit metadata says: its rows are gone on purpose.
            if group.group_id not in self._seen:
                self._remember(group.group_id, _Seen(partition, offset, resolved=True))
            return REREAD, None
        first = self._seen.get(group.group_id)
        if first is not None:
            self._duplicate(group, partition, offset, first)
            # The same record again, after a rebalance, is no duplicate.
            return (REREAD if (first.partition, first.offset) == (partition, offset) else DUPLICATE), None
        self._remember(group.group_id, _Seen(partition, offset))
        pending = Pending(group, partition, offset, HELD, next(self._arrivals))
        self.by_partition.setdefault(partition, {})[offset] = pending
        return NEW, pending

    def _remember(self, group_id: str, seen: _Seen) -> None:
        self._seen[group_id] = seen
        if len(self._seen) > self._max_seen:
            # The oldest resolved group goes: forgetting one still waiting would take its duplicate
            # in as new, and yield the group twice. Waiting groups are bounded by backpressure.
            for gid, old in self._seen.items():
                if old.resolved:
                    del self._seen[gid]
                    break

    def _duplicate(self, group: FinalizedGroup, partition: int, offset: int, first: _Seen) -> None:
        """A record of a group id already taken in: never yielded twice, and its rows never orphaned.

        Its sample ids are the original's (the reassembler's deterministic `{group_id}_g{i}`), so
        while the original waits (held, ready, or yielded and not released) clearing them would
        destroy rows not yet trained: the duplicate waits and is resolved with its original, which
        then clears whatever ids only the duplicate names. Once the original is released or evicted
        its rows are gone, so rows under the duplicate's ids were put again by whoever published the
        duplicate, and nothing will read them: they are cleared now.
        """
        if first.resolved:
            self.positions[partition].resolve(offset)
            self._clear(list(group.sample_ids), partition, offset)
            return
        pending = Pending(group, partition, offset, PendingState.DUPLICATE)
        self.by_partition.setdefault(partition, {})[offset] = pending
        self._duplicates.setdefault(group.group_id, []).append(pending)

    # ----- resolution ---------------------------------------------------------------------------

    def resolved(self, p: Pending) -> None:
        """The record of `p` needs nothing more: it no longer holds its partition's commit back."""
        if self.by_partition.get(p.partition, {}).pop(p.offset, None) is not None:
            self.positions[p.partition].resolve(p.offset)

    def remember_resolved(self, group_id: str, partition: int, offset: int) -> None:
        """A group resolved before this consumer started (its record is not read again): its duplicates are."""
        if group_id not in self._seen:
            self._remember(group_id, _Seen(partition, offset, resolved=True))

    def resolved_seen(self) -> list[tuple[str, int, int]]:
        """(group id, partition, offset) of the resolved groups remembered, oldest first: what a checkpoint
        keeps so that the trainer restored from it drops duplicates as this one would."""
        return [(gid, s.partition, s.offset) for gid, s in self._seen.items() if s.resolved]

    def forget_seen(self, partition: int, offsets: Iterable[int]) -> None:
        """Forget the groups whose records lie at these offsets, so reading them again is no re-read."""
        at = {(partition, o) for o in offsets}
        if at:
            for gid in [g for g, seen in self._seen.items() if (seen.partition, seen.offset) in at]:
                del self._seen[gid]

    def set_aside(self, p: Pending) -> None:
        """Stop tracking `p` without resolving its record (a dead letter now holds the commit back)."""
        self.by_partition.get(p.partition, {}).pop(p.offset, None)

    def resolve_offset(self, partition: int, offset: int) -> None:
        if partition in self.positions:
            self.positions[partition].resolve(offset)

    def group_resolved(self, group: FinalizedGroup) -> None:
        """The group was released, evicted or dropped: its waiting duplicates are resolved with it."""
        seen = self._seen.get(group.group_id)
        if seen is not None:
            seen.resolved = True
        for dup in self._duplicates.pop(group.group_id, []):
            extra = set(dup.group.sample_ids) - set(group.sample_ids)
            self.resolved(dup)
            if extra:
                self._clear(sorted(extra), dup.partition, dup.offset)

    def release(self, group: FinalizedGroup, partition: int, offset: int) -> None:
        """The trainer is done with a yielded group (its rows are cleared by the caller)."""
        pending = self.by_partition.get(partition, {}).get(offset)
        if pending is not None:
            self.resolved(pending)
        self.group_resolved(group)

    # ----- commits ------------------------------------------------------------------------------

    def commit_points(
        self,
        held_back: Callable[[int], list[int]],
        held: Callable[[int], list[int]] = lambda _p: [],
    ) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """(partition, offset, resolved ranges past it) to commit where it changed; `held_back(p)`: offsets
        unresolved elsewhere; `held(p)`: resolved offsets to name without passing them (rows still to clear)."""
        out = []
        for part, position in self.positions.items():
            point = position.commit_point([*self.by_partition.get(part, ()), *held_back(part)], held(part))
            if point is not None and position.committed != (point[0], tuple(point[1])):
                out.append((part, *point))
        return out

    def snapshot(self, held_back: Callable[[int], list[int]]) -> dict[int, tuple[int, list[tuple[int, int]]]]:
        """Per partition read or restored: its first unresolved offset and the resolved ranges past it."""
        out = {}
        for part, position in self.positions.items():
            cut = position.snapshot([*self.by_partition.get(part, ()), *held_back(part)])
            if cut is not None:
                out[part] = cut
        return out

    def committed(self, partition: int, offset: int, ranges: Iterable[tuple[int, int]]) -> None:
        if partition in self.positions:
            self.positions[partition].committed = (offset, tuple(ranges))

    def committed_offset(self, partition: int) -> int | None:
        """Where the partition's commit stands (as read at assignment or last committed; 0 when there was
        none, and reading began at the start); None if the partition is not assigned."""
        position = self.positions.get(partition)
        if position is None:
            return None
        if position.committed is not None:
            return position.committed[0]
        return position.start if position.start is not None else 0

    def named(self, partition: int, offset: int) -> bool:
        """Whether the partition's last commit passed or named the resolved record at `offset`."""
        position = self.positions.get(partition)
        return position is not None and position.names(offset)

    # ----- views --------------------------------------------------------------------------------

    def all_pending(self) -> Iterator[Pending]:
        for part in list(self.by_partition.values()):
            yield from list(part.values())
