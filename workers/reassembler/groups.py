"""In-memory state of one receipts partition: open groups, recently closed groups, and replay progress.

Pure bookkeeping, no I/O: the worker feeds it receipts in offset order and asks which groups are
ready, which offsets are safe to commit, and whether a receipt's side effects were already emitted
before a restart.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from schemas.receipt import Receipt
from schemas.state import CLOSED, DEAD_LETTERED, OPEN, GroupState

# Key of the per-partition progress entry in the state topic (see PartitionGroups.progress_entry).
PROGRESS_KEY = "__progress__"


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
    """Groups of one receipts partition, restored from the state topic and rebuilt from re-read receipts."""

    def __init__(self, partition: int, *, closed_capacity: int = 200_000):
        self.partition = partition
        self.open: dict[str, OpenGroup] = {}
        # group_id -> last receipt offset; bounded, oldest forgotten first.
        self.closed: OrderedDict[str, int] = OrderedDict()
        self.restored_open_ms: dict[str, int] = {}
        # Closed groups whose staging keys a predecessor may not have cleared: gid -> (keys, outcome).
        self.pending_clear: dict[str, tuple[tuple[str, ...], str]] = {}
        # Closed groups that ended dead-lettered (a subset of `closed`): a redriven receipt may reopen them.
        self.dead_lettered: set[str] = set()
        # Receipts at or below this offset had their outputs committed before a restart.
        self.emitted_through = -1
        self._closed_capacity = closed_capacity

    def restore(self, entry: GroupState) -> None:
        """Apply one state-topic entry (latest per key wins, so call in log order)."""
        if entry.group_id == PROGRESS_KEY:
            self.emitted_through = max(self.emitted_through, entry.last_offset)
        elif entry.status == OPEN:
            self.restored_open_ms[entry.group_id] = entry.first_seen_ms
            # OPEN after CLOSED happens only when redriven receipts reopened a dead-lettered group,
            # whose (re-staged) tensors must then not be cleared as the closed group's leftovers.
            self.reopen_dead_lettered(entry.group_id)
            self.pending_clear.pop(entry.group_id, None)
        elif entry.status == CLOSED:
            self.restored_open_ms.pop(entry.group_id, None)
            self._remember_closed(entry.group_id, entry.last_offset)
            if entry.outcome == DEAD_LETTERED:
                self.dead_lettered.add(entry.group_id)
            else:
                self.dead_lettered.discard(entry.group_id)
            if entry.staging_keys:
                self.pending_clear[entry.group_id] = (tuple(entry.staging_keys), entry.outcome or "")
            else:
                self.pending_clear.pop(entry.group_id, None)

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

    def due(self, now_ms: int, timeout_ms: int) -> list[OpenGroup]:
        return [g for g in self.open.values() if now_ms - g.first_seen_ms >= timeout_ms]

    def safe_offset(self, position: int) -> int:
        """The offset to commit: never past the first receipt of a group still open here."""
        return min([position] + [g.first_offset for g in self.open.values()])

    def progress_entry(self, position: int, now_ms: int) -> GroupState:
        """State entry recording that outputs for receipts below `position` are committed."""
        # Never below what was already recorded: compaction keeps only the latest entry per key.
        return GroupState(
            group_id=PROGRESS_KEY,
            status=OPEN,
            partition=self.partition,
            first_offset=0,
            last_offset=max(position - 1, self.emitted_through, 0),
            first_seen_ms=now_ms,
        )
