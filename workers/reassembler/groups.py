"""Prompt groups of one receipts partition: open ones, recently closed ones, and how far outputs were emitted.

Pure bookkeeping, no I/O: a partition task feeds it receipts in offset order and asks which groups are
ready, which offset is safe to commit, and whether a receipt's side effects were already emitted
before a restart. `workers.reassembler.restore` rebuilds it from the state topic.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from schemas.receipt import Receipt


class Added(enum.Enum):
    ADDED = "added"
    COMPLETED = "completed"
    DUPLICATE = "duplicate"
    INCONSISTENT = "inconsistent"
    LATE = "late"
    REPLAYED_CLOSED = "replayed_closed"


@dataclass
class OpenGroup:
    group_id: str
    partition: int
    group_size: int
    prompt_idx: int
    first_offset: int
    last_offset: int
    first_seen_ms: int
    receipts: dict[int, Receipt] = field(default_factory=dict)
    offsets: dict[int, int] = field(default_factory=dict)
    raw: dict[int, tuple[bytes | None, bytes]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.receipts) == self.group_size

    def by_index(self) -> list[Receipt | None]:
        return [self.receipts.get(i) for i in range(self.group_size)]

    def staging_keys(self) -> list[str]:
        return [c.staging_key for r in self.receipts.values() for c in r.manifest]


class PartitionGroups:
    """The prompt groups of one receipts partition (a "group" here is always a prompt group)."""

    def __init__(self, partition: int, *, closed_capacity: int = 200_000):
        self.partition = partition
        self.open: dict[str, OpenGroup] = {}
        # group_id -> last receipt offset, so a re-read or late receipt of a closed group is recognised.
        # Bounded, oldest forgotten first, so a long run's memory stays flat.
        self.closed: OrderedDict[str, int] = OrderedDict()
        # First-seen times of groups that were open before a restart, so their deadline does not
        # restart when their receipts are read again.
        self.restored_open_ms: dict[str, int] = {}
        # Closed groups that ended dead-lettered (a subset of `closed`): a redriven receipt may reopen them.
        self.dead_lettered: set[str] = set()
        # Receipts at or below this offset had their outputs committed before a restart.
        self.emitted_through = -1
        self._closed_capacity = closed_capacity

    def restore_open(self, group_id: str, first_seen_ms: int) -> None:
        """A group the state topic last saw open."""
        self.restored_open_ms[group_id] = first_seen_ms
        # OPEN after CLOSED happens only when redriven receipts reopened a dead-lettered group.
        self.reopen_dead_lettered(group_id)

    def restore_closed(self, group_id: str, last_offset: int, *, dead_lettered: bool) -> None:
        """A group the state topic last saw closed, with its last receipt's offset."""
        self.restored_open_ms.pop(group_id, None)
        self._remember_closed(group_id, last_offset)
        if dead_lettered:
            self.dead_lettered.add(group_id)
        else:
            self.dead_lettered.discard(group_id)

    def replaying(self, offset: int) -> bool:
        """True when this receipt's dead letters and state entries were already committed."""
        return offset <= self.emitted_through

    def add(
        self, receipt: Receipt, offset: int, timestamp_ms: int, raw: tuple[bytes | None, bytes] = (None, b"")
    ) -> tuple[Added, OpenGroup | None]:
        """Add a decoded receipt; `raw` (key, value) is kept so a failed group can be dead-lettered intact."""
        gid = receipt.group_id
        if gid in self.closed:
            return (Added.REPLAYED_CLOSED if offset <= self.closed[gid] else Added.LATE), None
        group = self.open.get(gid)
        if group is None:
            group = OpenGroup(
                gid,
                self.partition,
                receipt.group_size,
                receipt.prompt_idx,
                offset,
                offset,
                self.restored_open_ms.get(gid, timestamp_ms),
            )
            self.open[gid] = group
        elif receipt.group_size != group.group_size or receipt.prompt_idx != group.prompt_idx:
            return Added.INCONSISTENT, group
        elif receipt.rollout_index in group.receipts or any(
            r.rollout_id == receipt.rollout_id for r in group.receipts.values()
        ):
            return Added.DUPLICATE, group
        group.receipts[receipt.rollout_index] = receipt
        group.offsets[receipt.rollout_index] = offset
        group.raw[receipt.rollout_index] = raw
        group.last_offset = max(group.last_offset, offset)
        return (Added.COMPLETED if group.complete else Added.ADDED), group

    def close(self, group_id: str, *, dead_lettered: bool = False) -> OpenGroup:
        group = self.open.pop(group_id)
        self.restored_open_ms.pop(group_id, None)
        self._remember_closed(group_id, group.last_offset)
        if dead_lettered:
            self.dead_lettered.add(group_id)
        return group

    def reopen_dead_lettered(self, group_id: str) -> bool:
        """Forget that a dead-lettered group was closed, so its redriven receipts open it afresh.

        Only dead-lettered groups reopen: a finalized group's receipts stay late, whatever their headers.
        """
        if group_id not in self.dead_lettered:
            return False
        self.dead_lettered.discard(group_id)
        self.closed.pop(group_id, None)
        return True

    def _remember_closed(self, group_id: str, last_offset: int) -> None:
        self.closed[group_id] = last_offset
        self.closed.move_to_end(group_id)
        while len(self.closed) > self._closed_capacity:
            forgotten, _ = self.closed.popitem(last=False)
            self.dead_lettered.discard(forgotten)

    def due(self, clock_ms: int, timeout_ms: int) -> list[OpenGroup]:
        """Open groups whose first receipt is at least `timeout_ms` older than `clock_ms`."""
        return [g for g in self.open.values() if clock_ms - g.first_seen_ms >= timeout_ms]

    def safe_offset(self, position: int) -> int:
        """The offset to commit: never past the first receipt of a group still open here."""
        return min([position] + [g.first_offset for g in self.open.values()])
