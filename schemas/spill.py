"""A spill: the rows a trainer checkpoint keeps of TQ, so a whole-job restart can put them back.

TQ holds its rows in memory inside Ray and dies with the job; Kafka keeps the receipts and finalized
records that name them. A spill, written inside a trainer checkpoint, keeps the rows of rlstream's
partitions as they were at that checkpoint: a `SpillHeader` naming the checkpoint it belongs to
(`binding`), `SpillChunk`s of packed rows (the layout of `schemas/rowpack.py`, with their TQ tags),
and a `SpillEnd` counting them, so a cut-short file is told from a whole one. Each is one
MessagePack message with a schema version; `workers/trainer/spill.py` frames them in a file.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

# A chunk holds a few whole rows (a mixture-of-experts row can be megabytes): far above a Kafka message.
MAX_SPILL_MESSAGE_BYTES = 1 << 30


class SpillHeader(Message, frozen=True, tag="spill_header"):
    """What the spill is of: the checkpoint it was written for, and the TQ partitions it holds."""

    binding: str  # the checkpoint's own name for it (e.g. its consumer state's run and cut)
    partitions: tuple[str, ...]
    created_ms: int

    def _validate(self) -> None:
        non_empty("spill_header.binding", self.binding)
        for i, p in enumerate(self.partitions):
            non_empty(f"spill_header.partitions[{i}]", p)
        at_least("spill_header.created_ms", self.created_ms, 0)


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


class SpillEnd(Message, frozen=True, tag="spill_end"):
    """The last message of a whole spill: how many chunks and rows came before it."""

    chunks: int
    rows: int

    def _validate(self) -> None:
        at_least("spill_end.chunks", self.chunks, 0)
        at_least("spill_end.rows", self.rows, 0)
