"""Rebuilding a receipts partition's prompt-group bookkeeping from its state-topic changelog.

Pure: the caller reads the state partition (after any predecessor's transaction settled) and passes
its entries in log order; the latest entry per prompt group wins, as compaction would keep it.
Open groups are not rebuilt here: their receipts lie at or after the committed offset and are read
again, and only their first-seen time comes from the changelog. A tombstone means a predecessor
forgot that closed group (the partition's horizon covers it). Which part of the partition to read
is `workers.reassembler.changelog`'s business.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas.state import DEAD_LETTERED, OPEN, GroupState, PartitionProgress, StateEntry
from workers.reassembler.groups import PromptGroups

# Before `PartitionProgress` existed, progress was a GroupState under this id; a changelog written
# by that version keeps it until compaction, and ignoring it would re-emit already-emitted outputs.
LEGACY_PROGRESS_ID = "__progress__"


@dataclass(frozen=True)
class LogEntry:
    """One record of a state partition: its offset, key, and entry (None for a tombstone)."""

    offset: int
    key: bytes | None
    entry: StateEntry | None


@dataclass(frozen=True)
class Restored:
    """A partition's restored prompt groups, and the closed entries whose staging was never cleared."""

    groups: PromptGroups
    # Closed by a predecessor that died between its commit and its staging clear; in log order.
    staging_to_clear: tuple[GroupState, ...]
    # Closed groups forgotten for capacity while restoring, whose entries still need a tombstone.
    forgotten: tuple[str, ...] = ()


def restore_partition(
    partition: int, entries: Iterable[LogEntry | StateEntry], *, closed_capacity: int = 200_000
) -> Restored:
    """Apply a state partition's entries in log order (bare entries: offset unknown)."""
    groups = PromptGroups(partition, closed_capacity=closed_capacity)
    staging_to_clear: dict[str, GroupState] = {}
    for item in entries:
        record = item if isinstance(item, LogEntry) else LogEntry(-1, None, item)
        entry = record.entry
        if entry is None:
            if record.key is not None:
                gid = record.key.decode(errors="replace")
                groups.restore_forgotten(gid)
                staging_to_clear.pop(gid, None)
        elif isinstance(entry, PartitionProgress):
            # The highest rather than the last: the same while writers keep it monotonic, and a
            # step back would re-emit outputs that are already committed.
            groups.emitted_through = max(groups.emitted_through, entry.emitted_through)
            if entry.horizon_ms > 0:
                groups.raise_horizon(entry.horizon_ms)
        elif entry.group_id == LEGACY_PROGRESS_ID:
            groups.emitted_through = max(groups.emitted_through, entry.last_offset)
        else:
            _apply_group(groups, staging_to_clear, entry, record.offset)
    # A group forgotten for capacity and then seen again (a later entry of it) is remembered after all.
    forgotten = tuple(dict.fromkeys(g for g in groups.forgotten_in_restore if g not in groups.closed))
    groups.forgotten_in_restore = []
    return Restored(groups, tuple(staging_to_clear.values()), forgotten)


def _apply_group(groups: PromptGroups, staging_to_clear: dict[str, GroupState], entry: GroupState, offset: int) -> None:
    if entry.status == OPEN:
        groups.restore_open(entry.group_id, entry.first_seen_ms, offset)
        # A reopened (redriven) group re-staged its tensors: they are not the closed group's staging to clear.
        staging_to_clear.pop(entry.group_id, None)
        return
    groups.restore_closed(
        entry.group_id,
        entry.last_offset,
        dead_lettered=entry.outcome == DEAD_LETTERED,
        closed_ms=entry.closed_event_ms or entry.first_seen_ms,
        entry_offset=offset,
    )
    staging_to_clear.pop(entry.group_id, None)
    if entry.staging_to_clear:
        staging_to_clear[entry.group_id] = entry
