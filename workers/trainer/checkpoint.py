"""Resuming with the model: the consumer's state inside a trainer checkpoint.

A trainer that restores its weights from checkpoint C must see again every group it trained after
C, and none it trained before. So, with `ConsumerConfig.checkpointed`, acking a group resolves its
record but neither clears its rows nor commits its offset: `state_dict()` cuts what has been acked
so far, the trainer saves that dict inside its checkpoint, and once the checkpoint is safely
written it calls `checkpoint_durable(state)`, which commits the cut's offsets and clears the rows
acked up to that cut (in the order `clears.py` gives). After a crash, `load_state_dict(state)` of
the last durable checkpoint makes the consumer start each partition where the state says, knowing
which later records were already trained: groups acked after the checkpoint are read again, and
their rows are still there.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec

from schemas.errors import InvalidArgument

STATE_VERSION = 1


class PartitionMark(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One partition at the cut: its first record not yet trained, and later records trained already."""

    offset: int
    # Inclusive offset ranges at or past `offset` of records resolved already (trained, evicted,
    # dead-lettered, duplicates).
    trained: list[tuple[int, int]] = []

    def resolves(self, offset: int) -> bool:
        """Whether the record at `offset` was resolved at the cut (before the mark, or in a trained range)."""
        if offset < self.offset:
            return True
        i = bisect.bisect_right(self.trained, (offset, float("inf"))) - 1
        return i >= 0 and self.trained[i][0] <= offset <= self.trained[i][1]


def resolved_at_cut(
    groups: Iterable[tuple[str, int, int]], marks: Mapping[int, PartitionMark]
) -> Iterator[tuple[str, int, int]]:
    """The (group id, partition, offset) of `groups` whose record the cut counts resolved.

    A consumer remembers a group resolved as soon as it is done with it, but a group handed back or
    dead-lettered holds its record back in the cut until its notice is acknowledged; named resolved in
    a checkpoint, the restored consumer would take its record for one read again and drop it, the
    notice lost. Groups of partitions the cut does not name are kept: a revoked partition's notices
    and their groups are forgotten when it goes, so what the consumer remembers there was done.
    """
    for gid, part, offset in groups:
        mark = marks.get(part)
        if mark is None or mark.resolves(offset):
            yield gid, part, offset


class ConsumerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What `ExperienceConsumer.state_dict()` returns, as plain builtins (torch.save, JSON, msgpack)."""

    schema_version: int
    topic: str
    consumer_group: str
    version: int
    cut: int  # acks up to this sequence number are covered by the checkpoint
    partitions: dict[int, PartitionMark]
    run: str = ""  # the consumer instance that cut it; its cut numbers mean nothing to another
    # (group id, partition, offset) of groups resolved before the cut, whose later duplicates the restored
    # consumer drops: `checkpoint_dir.load_state` fills it from the checkpoint's resolved file (issue 30);
    # `state_dict` leaves it empty, so the state stays small.
    resolved: list[tuple[str, int, int]] = []


def encode_state(state: ConsumerState) -> dict[str, Any]:
    return msgspec.to_builtins(state)


def decode_state(data: Any, *, topic: str, consumer_group: str) -> ConsumerState:
    """Validate a state dict from a checkpoint; errors name the field path and what was wrong."""
    got = data.get("schema_version") if isinstance(data, dict) else None
    if got != STATE_VERSION:  # before the fields: a newer state's are not ours to judge
        raise InvalidArgument(f"trainer consumer state: schema_version {got!r}, expected {STATE_VERSION}")
    try:
        state = msgspec.convert(data, ConsumerState, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"trainer consumer state: {exc}") from None
    if (state.topic, state.consumer_group) != (topic, consumer_group):
        raise InvalidArgument(
            f"trainer consumer state is of topic {state.topic!r}, consumer group {state.consumer_group!r};"
            f" this consumer reads {topic!r} as {consumer_group!r}"
        )
    for part, mark in state.partitions.items():
        where = f"trainer consumer state: partitions.{part}"
        if part < 0 or mark.offset < 0:
            raise InvalidArgument(f"{where}: partition and offset must be >= 0")
        prev = mark.offset - 1
        for first, last in mark.trained:
            # PartitionPosition bisects them and the commit metadata counts gaps from one to the next.
            if first <= prev or last < first:
                raise InvalidArgument(f"{where}.trained: ranges must be sorted, disjoint and at or past the offset")
            prev = last
    return state
