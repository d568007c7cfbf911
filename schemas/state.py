"""`GroupState`: one changelog entry of the compacted `reassembler.state` topic."""

from __future__ import annotations

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

OPEN = "open"
CLOSED = "closed"
FINALIZED = "finalized"
DEAD_LETTERED = "dead_lettered"


class GroupState(Message, frozen=True, tag="group_state"):
    """Whether a group is open or closed in its receipts partition, and the offsets it spans.

    A closed group says how it ended (`outcome` "finalized" or "dead_lettered"); an open one has
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
    # Staging keys of a closed group until they are cleared: a successor that restores a closed
    # entry with keys clears them, so a crash between commit and clear leaks nothing.
    staging_keys: tuple[str, ...] = ()

    def _validate(self) -> None:
        non_empty("group_state.group_id", self.group_id)
        at_least("group_state.partition", self.partition, 0)
        at_least("group_state.first_offset", self.first_offset, 0)
        at_least("group_state.last_offset", self.last_offset, self.first_offset)
        at_least("group_state.first_seen_ms", self.first_seen_ms, 0)
        at_least("group_state.finalized_at_ms", self.finalized_at_ms, 0)
        if self.status == OPEN:
            if self.outcome is not None:
                raise SchemaError("group_state.outcome", "must be None while the group is open")
        elif self.status == CLOSED:
            if self.outcome not in (FINALIZED, DEAD_LETTERED):
                raise SchemaError(
                    "group_state.outcome",
                    f"a closed group needs outcome {FINALIZED!r} or {DEAD_LETTERED!r}, got {self.outcome!r}",
                )
        else:
            raise SchemaError("group_state.status", f"must be {OPEN!r} or {CLOSED!r}, got {self.status!r}")
