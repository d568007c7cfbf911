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


class Intake(enum.Enum):
    ADDED = "added"
    COMPLETED = "completed"
    DUPLICATE = "duplicate"
    INCONSISTENT = "inconsistent"
    LATE = "late"
    REREAD_CLOSED = "reread_closed"


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
    # Event time (ms) of each receipt, which its dead letter keeps for a redrive.
    event_ms: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.receipts) == self.group_size

    def by_index(self) -> list[Receipt | None]:
        return [self.receipts.get(i) for i in range(self.group_size)]

    def staging_keys(self) -> list[str]:
        return [c.staging_key for r in self.receipts.values() for c in r.manifest]


@dataclass(frozen=True)
class ClosedGroup:
    """What is remembered of a closed group: enough to recognise its late receipts, and where its entry lies."""

    last_offset: int
    # Event time when it closed: the newest receipt timestamp its partition had read by then.
    closed_ms: int
    # State-partition offset of its latest entry; -1 until the step that wrote it has committed.
    entry_offset: int = -1


class PromptGroups:
    """The prompt groups of one receipts partition (a "group" here is always a prompt group).

    Closed groups are remembered for a retention period of event time after they close, at most
    `closed_capacity` of them; forgetting one raises the partition's `horizon_ms` to its closing
    time. A receipt of a group neither open nor remembered whose event time is at or below the
    horizon is late: it was produced before a forgotten group closed, so it may be one of that
    group's, and reopening the group would finalize it twice.
    """

    def __init__(self, partition: int, *, closed_capacity: int = 200_000):
        self.partition = partition
        self.open: dict[str, OpenGroup] = {}
        # In close order, oldest first: forgetting takes from the front.
        self.closed: OrderedDict[str, ClosedGroup] = OrderedDict()
        # First-seen times of groups that were open before a restart, so their deadline does not
        # restart when their receipts are read again.
        self.restored_open_ms: dict[str, int] = {}
        # State-partition offsets of open groups' OPEN entries (a restore must read from there).
        self.open_entries: dict[str, int] = {}
        # Closed groups that ended dead-lettered (a subset of `closed`): a redriven receipt may reopen them.
        self.dead_lettered: set[str] = set()
        # Receipts at or below this offset had their outputs committed before a restart.
        self.emitted_through = -1
        # None until a closed group is forgotten.
        self.horizon_ms: int | None = None
        self._closed_capacity = closed_capacity
        # Closed groups forgotten for capacity while the changelog was applied: their entries still
        # stand in the state topic, so the first commit after the restore tombstones them.
        self.forgotten_in_restore: list[str] = []

    def restore_open(self, group_id: str, first_seen_ms: int, entry_offset: int = -1) -> None:
        """A group the state topic last saw open."""
        self.restored_open_ms[group_id] = first_seen_ms
        if entry_offset >= 0:
            self.open_entries[group_id] = entry_offset
        # OPEN after CLOSED happens only when redriven receipts reopened a dead-lettered group.
        self.reopen_dead_lettered(group_id)

    def restore_closed(
        self, group_id: str, last_offset: int, *, dead_lettered: bool, closed_ms: int = 0, entry_offset: int = -1
    ) -> None:
        """A group the state topic last saw closed, with its last receipt's offset."""
        self.restored_open_ms.pop(group_id, None)
        self.open_entries.pop(group_id, None)
        earlier = self.closed.get(group_id)
        if earlier is not None and earlier.entry_offset >= 0:
            # A later entry of the same closing (its staging cleared): the group keeps its place
            # and the offset of its closing entry, from which a restore reads both.
            self.closed[group_id] = ClosedGroup(last_offset, closed_ms, earlier.entry_offset)
        else:
            self._remember_closed(group_id, ClosedGroup(last_offset, closed_ms, entry_offset))
        if dead_lettered:
            self.dead_lettered.add(group_id)
        else:
            self.dead_lettered.discard(group_id)
        self.forgotten_in_restore.extend(self._enforce_capacity())

    def restore_forgotten(self, group_id: str) -> None:
        """A tombstone: a predecessor forgot this closed group (the horizon covers it)."""
        self.closed.pop(group_id, None)
        self.dead_lettered.discard(group_id)

    def rereading(self, offset: int) -> bool:
        """True when this receipt's dead letters and state entries were already committed."""
        return offset <= self.emitted_through

    def add(
        self,
        receipt: Receipt,
        offset: int,
        timestamp_ms: int,
        raw: tuple[bytes | None, bytes] = (None, b""),
        *,
        event_ms: int | None = None,
        reopened: bool = False,
    ) -> tuple[Intake, OpenGroup | None]:
        """Add a decoded receipt; `raw` (key, value) is kept so a failed group can be dead-lettered intact.

        `timestamp_ms` starts a new group's deadline; `event_ms` (default the same) is compared with
        the horizon: a redriven receipt starts its deadline now but keeps its original event time.
        `reopened`: the group is a remembered dead-lettered one its redriven receipts just reopened,
        whatever the horizon says.
        """
        gid = receipt.group_id
        if gid in self.closed:
            return (Intake.REREAD_CLOSED if offset <= self.closed[gid].last_offset else Intake.LATE), None
        group = self.open.get(gid)
        if group is None:
            known = reopened or gid in self.restored_open_ms
            if not known and self.rereading(offset):
                # Read before the restart, yet its group is neither open nor remembered: the group
                # was forgotten. Decided by offset, not by the clock: a receipt's timestamp is
                # clamped to the reading worker's clock, which is later now than when first read.
                return Intake.LATE, None
            # At the horizon too: a forgotten group's own first receipt carries exactly that time.
            horizon = self.horizon_ms
            if not known and horizon is not None and (timestamp_ms if event_ms is None else event_ms) <= horizon:
                return Intake.LATE, None
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
            return Intake.INCONSISTENT, group
        elif receipt.rollout_index in group.receipts or any(
            r.rollout_id == receipt.rollout_id for r in group.receipts.values()
        ):
            return Intake.DUPLICATE, group
        group.receipts[receipt.rollout_index] = receipt
        group.offsets[receipt.rollout_index] = offset
        group.raw[receipt.rollout_index] = raw
        group.event_ms[receipt.rollout_index] = timestamp_ms if event_ms is None else event_ms
        group.last_offset = max(group.last_offset, offset)
        return (Intake.COMPLETED if group.complete else Intake.ADDED), group

    def close(self, group_id: str, *, dead_lettered: bool = False, closed_ms: int = 0) -> OpenGroup:
        """Close an open group at event time `closed_ms` (its partition's newest receipt timestamp read)."""
        group = self.open.pop(group_id)
        self.restored_open_ms.pop(group_id, None)
        self.open_entries.pop(group_id, None)
        newest = max(group.event_ms.values(), default=group.first_seen_ms)
        self._remember_closed(group_id, ClosedGroup(group.last_offset, max(closed_ms, newest, group.first_seen_ms)))
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

    def _remember_closed(self, group_id: str, entry: ClosedGroup) -> None:
        self.closed[group_id] = entry
        self.closed.move_to_end(group_id)

    def _enforce_capacity(self) -> list[str]:
        forgotten = []
        while len(self.closed) > self._closed_capacity:
            forgotten.append(self._forget_oldest())
        return forgotten

    def _forget_oldest(self) -> str:
        gid, entry = self.closed.popitem(last=False)
        self.dead_lettered.discard(gid)
        self.raise_horizon(entry.closed_ms)
        return gid

    def raise_horizon(self, horizon_ms: int) -> None:
        self.horizon_ms = horizon_ms if self.horizon_ms is None else max(self.horizon_ms, horizon_ms)

    def forget(self, event_ms: int, retention_ms: int) -> list[str]:
        """Forget closed groups that closed more than `retention_ms` before event time `event_ms`, or past the capacity.

        Event time (the newest receipt timestamp read), never wall time: a worker behind a backlog,
        or paused, must not age groups by a clock the receipts it has yet to read do not follow.
        Returns the forgotten ids, for tombstones.
        """
        forgotten = []
        while self.closed:
            entry = next(iter(self.closed.values()))
            over = len(self.closed) > self._closed_capacity
            if not over and entry.closed_ms >= event_ms - retention_ms:
                break
            forgotten.append(self._forget_oldest())
        return forgotten

    def entries_written(self, offsets: dict[str, int], opened: set[str]) -> None:
        """The state-partition offsets a committed step wrote its entries at (first per group)."""
        for gid, offset in offsets.items():
            if gid in opened and gid in self.open:
                self.open_entries[gid] = offset
            elif gid in self.closed and self.closed[gid].entry_offset < 0:
                # The closing entry's offset; a later cleared entry of the group lies after it.
                self.closed[gid] = ClosedGroup(self.closed[gid].last_offset, self.closed[gid].closed_ms, offset)

    def restore_from(self, next_offset: int) -> int:
        """The state offset a successor must read from: the oldest entry still needed, else `next_offset`."""
        candidates = [next_offset, *self.open_entries.values()]
        for entry in self.closed.values():
            # Remembered groups are in the log order of their closing entries, so the first holds the
            # oldest; one whose entry is not committed yet lies past next_offset anyway.
            if entry.entry_offset >= 0:
                candidates.append(entry.entry_offset)
            break
        return max(0, min(candidates))

    def due(self, clock_ms: int, timeout_ms: int) -> list[OpenGroup]:
        """Open groups whose first receipt is at least `timeout_ms` older than `clock_ms`."""
        return [g for g in self.open.values() if clock_ms - g.first_seen_ms >= timeout_ms]

    def safe_offset(self, position: int) -> int:
        """The offset to commit: never past the first receipt of a group still open here."""
        return min([position] + [g.first_offset for g in self.open.values()])
