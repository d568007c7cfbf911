"""Entries of the compacted `reassembler.state` topic: `GroupState` per prompt group, `PartitionProgress` per partition.

Both live in the state partition of the receipts partition they describe; a reader tells them apart
by their `kind`, never by their key.
"""

from __future__ import annotations

import msgspec

from schemas.codec import Message, decode
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

OPEN = "open"
CLOSED = "closed"
FINALIZED = "finalized"
DEAD_LETTERED = "dead_lettered"
# Its staging rows were all gone from TQ (the job restarted): a `Regenerate` record was committed instead.
HANDED_BACK = "handed_back"
CLOSED_OUTCOMES = (FINALIZED, DEAD_LETTERED, HANDED_BACK)

# Compaction key of a partition's progress entry. 0xFF never occurs in UTF-8, so no prompt group's
# key (its id, UTF-8 encoded) can collide with it and be compacted away in its place.
PROGRESS_KEY = b"\xffpartition_progress"


class GroupState(Message, frozen=True, tag="group_state"):
    """Whether a prompt group is open or closed in its receipts partition, and the offsets it spans.

    A closed group says how it ended (`outcome` "finalized", "dead_lettered" or "handed_back"); an open one has
    no outcome yet.
    """

    group_id: str
    status: str
    partition: int
    first_offset: int
    last_offset: int
    first_seen_ms: int
    outcome: str | None = None
    finalized_at_ms: int = 0
    # The staged tensors of a closed group are cleared after its commit; a crash in between must
    # not leak them, so the closed entry names them and a successor that restores it with
    # `staging_cleared` still false clears them.
    staging_keys: tuple[str, ...] = ()
    staging_cleared: bool = False
    # Event time when a group closed (the newest receipt timestamp its partition had read): its age
    # for the horizon. 0 in entries written before it existed (first_seen_ms stands in).
    closed_event_ms: int = 0

    def _validate(self) -> None:
        non_empty("group_state.group_id", self.group_id)
        at_least("group_state.partition", self.partition, 0)
        at_least("group_state.first_offset", self.first_offset, 0)
        at_least("group_state.last_offset", self.last_offset, self.first_offset)
        at_least("group_state.first_seen_ms", self.first_seen_ms, 0)
        at_least("group_state.finalized_at_ms", self.finalized_at_ms, 0)
        at_least("group_state.closed_event_ms", self.closed_event_ms, 0)
        if self.status == OPEN:
            if self.outcome is not None:
                raise SchemaError("group_state.outcome", "must be None while the group is open")
            if self.staging_cleared:
                raise SchemaError("group_state.staging_cleared", "an open group's staging is still in use")
        elif self.status == CLOSED:
            if self.outcome not in CLOSED_OUTCOMES:
                raise SchemaError(
                    "group_state.outcome", f"a closed group needs an outcome of {CLOSED_OUTCOMES}, got {self.outcome!r}"
                )
        else:
            raise SchemaError("group_state.status", f"must be {OPEN!r} or {CLOSED!r}, got {self.status!r}")

    @property
    def staging_to_clear(self) -> tuple[str, ...]:
        """Staging keys a successor restoring this entry still has to clear."""
        return self.staging_keys if self.status == CLOSED and not self.staging_cleared else ()


class PartitionProgress(Message, frozen=True, tag="partition_progress"):
    """How far a receipts partition's outputs are committed, written with them in one transaction.

    Receipts at or below `emitted_through` had their dead letters and state entries committed; a
    successor that re-reads them (from the safe offset, which may lie further back) must not emit
    those again. Only the latest entry per partition survives compaction, so it never goes back.
    Every step that writes state for a partition writes this entry too, so the latest one is always
    near the end of the state partition, where a restore looks for it first.
    """

    partition: int
    emitted_through: int
    time_ms: int
    # Event time (receipt timestamps) below which a receipt of a group not remembered is late: the
    # newest first-seen time of any closed group forgotten so far. 0: nothing forgotten yet.
    horizon_ms: int = 0
    # State-partition offset from which a successor must read to restore this partition: no entry
    # it needs lies before it. 0 (as written before this field existed) reads the whole partition.
    restore_from: int = 0

    def _validate(self) -> None:
        at_least("partition_progress.partition", self.partition, 0)
        # -1: a step committed state for the partition before reading any receipt of it.
        at_least("partition_progress.emitted_through", self.emitted_through, -1)
        at_least("partition_progress.time_ms", self.time_ms, 0)
        at_least("partition_progress.horizon_ms", self.horizon_ms, 0)
        at_least("partition_progress.restore_from", self.restore_from, 0)


StateEntry = GroupState | PartitionProgress


class _Kind(msgspec.Struct):
    kind: str = ""


_ENTRY = msgspec.msgpack.Decoder(GroupState | PartitionProgress)
_KIND = msgspec.msgpack.Decoder(_Kind)


def decode_state_entry(data: bytes) -> StateEntry:
    """A state-topic value as whichever kind it is, validated; raises SchemaError only.

    One pass for both kinds: a restore decodes every entry since its restore point, and this is
    several times cheaper than sniffing the kind first. A failure is decoded again by its kind's
    own decoder, whose error names the field.
    """
    try:
        return _ENTRY.decode(data)
    except Exception:  # noqa: BLE001 - re-decoded below for a precise SchemaError
        pass
    try:
        kind = _KIND.decode(data).kind
    except Exception:  # noqa: BLE001
        kind = ""
    return decode(data, PartitionProgress if kind == PartitionProgress.kind() else GroupState)
