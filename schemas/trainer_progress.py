"""`TrainerProgress`: the resolved records past a trainer's committed offset, when commit metadata cannot hold them.

A trainer's commit names the records past its offset that are resolved already (trained, evicted,
dead-lettered), so a successor reading them again knows their rows are gone on purpose. Commit
metadata holds about 870 alternating ranges; past that, the ranges travel as `TrainerProgress`
chunks on `<prefix>.trainer.progress`, acknowledged before the commit, whose metadata then names
only their `token` and count (`workers/trainer/position.py`, `workers/trainer/progress.py`). A
chunk holds at most `MAX_CHUNK_RANGES` ranges, so one fits a Kafka message whatever the offsets:
the resolved set survives at any size, in as many chunks as it needs.

Ranges are encoded as commit metadata encodes them, as integers: `(gap, length)` pairs, each gap
counted from the end of the previous range (the first from `base`), a range covering offsets
`first .. first + length`. Chunk 0's `base` is the committed offset; a later chunk's is the last
offset of the chunk before, so each chunk is validated alone and the chunks join in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

# Ranges per chunk: 2 integers of at most 9 bytes each in msgpack, about 590 KB at worst, under the
# 1 MiB a message may take (`schemas.codec.MAX_MESSAGE_BYTES`, and Kafka's default).
MAX_CHUNK_RANGES = 32_768

Range = tuple[int, int]  # first and last offset, inclusive


class TrainerProgress(Message, frozen=True, tag="trainer_progress"):
    """Chunk `chunk` of `chunks` of the resolved ranges past `offset`, committed by `consumer_group` on
    `topic`[`partition`] with metadata naming `token`.

    A reader takes an entry only for a commit naming its token, at or past its offset (a later commit of
    the same resolved set names it again; the ranges below that commit's offset are then passed): an
    entry written for a commit that then failed, or by a trainer that had lost the partition, names
    another token.
    """

    consumer_group: str
    topic: str
    partition: int
    offset: int
    token: str
    chunk: int
    chunks: int
    base: int
    ranges: tuple[int, ...]
    time_ms: int

    def _validate(self) -> None:
        non_empty("trainer_progress.consumer_group", self.consumer_group)
        non_empty("trainer_progress.topic", self.topic)
        non_empty("trainer_progress.token", self.token)
        at_least("trainer_progress.partition", self.partition, 0)
        at_least("trainer_progress.offset", self.offset, 0)
        at_least("trainer_progress.chunks", self.chunks, 1)
        at_least("trainer_progress.chunk", self.chunk, 0)
        if self.chunk >= self.chunks:
            raise SchemaError("trainer_progress.chunk", f"must be below chunks ({self.chunks}), got {self.chunk}")
        if self.chunk == 0 and self.base != self.offset:
            raise SchemaError("trainer_progress.base", f"chunk 0 counts from the offset {self.offset}, got {self.base}")
        at_least("trainer_progress.base", self.base, self.offset)
        at_least("trainer_progress.time_ms", self.time_ms, 0)
        if len(self.ranges) % 2:
            raise SchemaError("trainer_progress.ranges", "must hold (gap, length) pairs: an even number of integers")
        if len(self.ranges) > 2 * MAX_CHUNK_RANGES:
            raise SchemaError("trainer_progress.ranges", f"holds more than {MAX_CHUNK_RANGES} ranges")
        for i, value in enumerate(self.ranges):
            # Only the first range of the first chunk may start at the committed offset itself; each
            # later one starts past the end of the one before.
            low = 0 if i % 2 or (i == 0 and self.chunk == 0) else 1
            if value < low:
                raise SchemaError(f"trainer_progress.ranges[{i}]", f"must be >= {low}, got {value}")

    def decoded(self) -> list[Range]:
        """This chunk's ranges as (first, last) offsets."""
        out, prev = [], self.base
        for gap, length in zip(self.ranges[::2], self.ranges[1::2], strict=True):
            first = prev + gap
            out.append((first, first + length))
            prev = first + length
        return out


def progress_chunks(
    consumer_group: str,
    topic: str,
    partition: int,
    offset: int,
    token: str,
    ranges: Sequence[Range],
    time_ms: int,
    chunk_ranges: int = MAX_CHUNK_RANGES,
) -> list[TrainerProgress]:
    """The chunks carrying `ranges` (sorted, disjoint, at or past `offset`) for a commit at `offset` naming `token`."""
    if not 1 <= chunk_ranges <= MAX_CHUNK_RANGES:
        raise ValueError(f"chunk_ranges must be in 1..{MAX_CHUNK_RANGES}, got {chunk_ranges}")
    pieces = [ranges[i : i + chunk_ranges] for i in range(0, len(ranges), chunk_ranges)] or [[]]
    out, base = [], offset
    for i, piece in enumerate(pieces):
        flat: list[int] = []
        prev = base
        for first, last in piece:
            flat += [first - prev, last - first]
            prev = last
        out.append(
            TrainerProgress(
                consumer_group=consumer_group,
                topic=topic,
                partition=partition,
                offset=offset,
                token=token,
                chunk=i,
                chunks=len(pieces),
                base=base,
                ranges=tuple(flat),
                time_ms=time_ms,
            )
        )
        base = prev
    return out


def join_chunks(chunks: Sequence[TrainerProgress], offset: int, token: str, count: int) -> list[Range]:
    """The ranges of a commit at `offset` naming `token` in `count` chunks; SchemaError if they are not all
    there, or do not join up (another commit's, or a chunk lost)."""
    by_index = {c.chunk: c for c in chunks if c.token == token}
    for i in range(count):
        c = by_index.get(i)
        if c is None:
            raise SchemaError("trainer_progress.chunk", f"chunk {i} of {count} of token {token!r} is missing")
        if (c.offset, c.chunks) != (offset, count):
            raise SchemaError(
                "trainer_progress.offset",
                f"chunk {i} of token {token!r} is of a commit at {c.offset} in {c.chunks} chunks,"
                f" the commit is at {offset} in {count}",
            )
    out: list[Range] = []
    for i in range(count):
        c = by_index[i]
        end = out[-1][1] if out else offset
        if c.base != end:
            raise SchemaError("trainer_progress.base", f"chunk {i} of token {token!r} starts at {c.base}, not {end}")
        out += c.decoded()
    return out
