"""A spill: the rows a trainer checkpoint keeps of TQ, so a whole-job restart can put them back.

TQ holds its rows in memory inside Ray and dies with the job; Kafka keeps the receipts and finalized
records that name them. A spill, written inside a trainer checkpoint, keeps the rows of rlstream's
partitions as they were at that checkpoint. Each record is one MessagePack message with a schema
version; `workers/trainer/spill.py` frames them in a file (an 8-byte length before each):

- a `SpillHeader` naming the checkpoint it belongs to (`binding`) and the file's `format`;
- `SpillChunk`s of whole packed rows (the layout of `schemas/rowpack.py`, with their TQ tags), each
  at most `chunk_bytes(...)` of row data, and for a row bigger than that, consecutive `SpillRowPart`s
  holding its bytes in order;
- (format 2) `SpillIndex` messages: every row's key and the file position of the message holding it
  (its chunk, or its first part), so a reader puts back chosen rows without reading the rest;
- a `SpillEnd` counting what came before it (and, format 2, where the index lies), so a cut-short
  file is told from a whole one; format 2 ends with an 8-byte position of the `SpillEnd` message.

Format 1 (before issue 30) had chunks of 16 rows whatever their size, no parts and no index: a chunk
of large rows (long-context mixture-of-experts rows reach 64 MiB each) could exceed the 1 GiB a
reader accepts. It is still read. Pure: no I/O.
"""

from __future__ import annotations

import struct
from typing import Any

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

# The largest message a reader accepts: a length prefix above it is corruption, not a row.
MAX_SPILL_MESSAGE_BYTES = 1 << 30
FORMAT_V1, FORMAT_V2 = 1, 2
# Before each message: its length; after a format-2 spill's end record: that record's position.
FRAME = struct.Struct(">Q")
# Rows per chunk at most, so a chunk of tiny rows keeps its keys and tags small too.
CHUNK_MAX_ROWS = 4096
# Index entries per SpillIndex message.
INDEX_ENTRIES = 65_536


def chunk_bytes(max_message_bytes: int = MAX_SPILL_MESSAGE_BYTES) -> int:
    """Row bytes per chunk, and per part of a row bigger than that: a sixteenth of the message limit
    (64 MiB at 1 GiB), leaving room for keys and tags, and bounding what a reader holds at once."""
    return max(1, max_message_bytes // 16)


class SpillHeader(Message, frozen=True, tag="spill_header"):
    """What the spill is of: the checkpoint it was written for, and the TQ partitions it holds."""

    binding: str  # the checkpoint's own name for it (e.g. its consumer state's run and cut)
    partitions: tuple[str, ...]
    created_ms: int
    format: int = FORMAT_V1  # absent in format-1 files

    def _validate(self) -> None:
        non_empty("spill_header.binding", self.binding)
        for i, p in enumerate(self.partitions):
            non_empty(f"spill_header.partitions[{i}]", p)
        at_least("spill_header.created_ms", self.created_ms, 0)
        if self.format not in (FORMAT_V1, FORMAT_V2):
            raise SchemaError("spill_header.format", f"unknown spill format {self.format} (this reader speaks 1 and 2)")


class SpillChunk(Message, frozen=True, tag="spill_chunk"):
    """Packed rows of one TQ partition: row i is `data[offsets[i]:offsets[i + 1]]`, key `keys[i]`, tags `tags[i]`."""

    partition: str
    keys: tuple[str, ...]
    tags: tuple[dict[str, Any], ...]
    offsets: tuple[int, ...]
    data: bytes

    def _validate(self) -> None:
        non_empty("spill_chunk.partition", self.partition)
        n = len(self.keys)
        if len(self.tags) != n:
            raise SchemaError("spill_chunk.tags", f"{len(self.tags)} tags for {n} keys")
        if len(self.offsets) != n + 1:
            raise SchemaError("spill_chunk.offsets", f"{len(self.offsets)} offsets for {n} rows (need {n + 1})")
        if self.offsets and (self.offsets[0] != 0 or self.offsets[-1] != len(self.data)):
            raise SchemaError("spill_chunk.offsets", f"must run from 0 to the data's {len(self.data)} bytes")
        for i in range(n):
            if self.offsets[i + 1] < self.offsets[i]:
                raise SchemaError(f"spill_chunk.offsets[{i + 1}]", "offsets must not decrease")
        for i, k in enumerate(self.keys):
            non_empty(f"spill_chunk.keys[{i}]", k)


class SpillRowPart(Message, frozen=True, tag="spill_row_part"):
    """Part `part` of `parts` of one packed row too big for a chunk; the parts follow each other in the file."""

    partition: str
    key: str
    tags: dict[str, Any]
    part: int
    parts: int
    size: int  # the whole row's bytes
    data: bytes

    def _validate(self) -> None:
        non_empty("spill_row_part.partition", self.partition)
        non_empty("spill_row_part.key", self.key)
        at_least("spill_row_part.parts", self.parts, 1)
        at_least("spill_row_part.part", self.part, 0)
        if self.part >= self.parts:
            raise SchemaError("spill_row_part.part", f"part {self.part} of {self.parts}")
        at_least("spill_row_part.size", self.size, len(self.data))


class SpillIndex(Message, frozen=True, tag="spill_index"):
    """Where rows lie: row i of this message is `keys[i]` of `header.partitions[partition[i]]`, held by the
    message that starts at byte `at[i]` of the file."""

    keys: tuple[str, ...]
    partition: tuple[int, ...]
    at: tuple[int, ...]

    def _validate(self) -> None:
        n = len(self.keys)
        if len(self.partition) != n or len(self.at) != n:
            raise SchemaError("spill_index", f"{n} keys, {len(self.partition)} partitions, {len(self.at)} positions")
        for i, (p, at) in enumerate(zip(self.partition, self.at)):
            if p < 0 or at < 0:
                raise SchemaError(f"spill_index.at[{i}]", "partition and position must be >= 0")


class SpillEnd(Message, frozen=True, tag="spill_end"):
    """The last message of a whole spill: how many chunks and rows came before it, and where its index lies."""

    chunks: int
    rows: int
    parts: int = 0  # SpillRowPart messages (format 2)
    index_at: int = -1  # file position of the first SpillIndex message (format 2; -1: none)
    index_messages: int = 0

    def _validate(self) -> None:
        at_least("spill_end.chunks", self.chunks, 0)
        at_least("spill_end.rows", self.rows, 0)
        at_least("spill_end.parts", self.parts, 0)
        at_least("spill_end.index_at", self.index_at, -1)
        at_least("spill_end.index_messages", self.index_messages, 0)


class ResolvedGroups(Message, frozen=True, tag="resolved_groups"):
    """Groups a trainer had resolved (trained, evicted, handed back) when its checkpoint was cut, and where
    their records lie: what a restored trainer drops duplicates against, as the one checkpointed did.

    A checkpoint's `rlstream-resolved` file is a run of these, the last one with `last` set.
    """

    binding: str  # the consumer state it was cut with, as a spill's
    group_ids: tuple[str, ...]
    partitions: tuple[int, ...]
    offsets: tuple[int, ...]
    last: bool = False

    def _validate(self) -> None:
        non_empty("resolved_groups.binding", self.binding)
        n = len(self.group_ids)
        if len(self.partitions) != n or len(self.offsets) != n:
            raise SchemaError(
                "resolved_groups", f"{n} group ids, {len(self.partitions)} partitions, {len(self.offsets)} offsets"
            )
        for i, gid in enumerate(self.group_ids):
            non_empty(f"resolved_groups.group_ids[{i}]", gid)
