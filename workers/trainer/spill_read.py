"""Reading a checkpoint's spill back, a message at a time: which rows it holds, and putting chosen ones into TQ.

`read_spill` opens `rows.spill` (`spill.py` wrote it) and reads only its index: the header, the end
record and the index messages of a format-2 spill, or, for a format-1 spill (issue 24, no index), one
pass over its messages keeping their keys and positions and dropping their rows. It refuses a spill
that is missing, cut short, undecodable, or written for another checkpoint (`SpillError`).
`Spill.restore` then reads only the messages holding the rows asked for, in file order, and puts
them back chunk by chunk: memory stays bounded by one chunk (64 MiB of rows) or by the largest row,
whatever the spill's size, where reading it whole held about three times the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import msgspec
import torch
from tensordict import TensorDict

from schemas import spill as fmt
from schemas.errors import SchemaError
from schemas.jagged import make_jagged
from schemas.rowpack import unpack_rows
from schemas.spill import FRAME, SpillChunk, SpillEnd, SpillHeader, SpillIndex, SpillRowPart
from streams.tq import KVStore
from workers.trainer.errors import SpillError
from workers.trainer.spill import SPILL_FILE


class _Kind(msgspec.Struct):
    kind: str = ""


_KIND = msgspec.msgpack.Decoder(_Kind)
# The tag of a row put back with none: a train row the spill caught mid-put and kept (its record may be
# committed). Untagged, it would read as the keys of a put given up after its index lookup, which the
# reassembler's sweep clears (`workers/reassembler/sweeper.py`).
RESTORED_TAG = "rlstream_restored"


def _tags(tags: dict) -> dict:
    return tags or {RESTORED_TAG: 1}


_BY_KIND = {cls.kind(): cls for cls in (SpillHeader, SpillChunk, SpillRowPart, SpillIndex, SpillEnd)}


class _File:
    """The spill file, read a framed message at a time."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = open(path, "rb")  # noqa: SIM115 - held by the Spill until closed
            self.size = os.fstat(self._f.fileno()).st_size
        except OSError as exc:
            raise SpillError(f"{path}: cannot read the spill ({exc.strerror or exc})") from None

    def raw(self, at: int) -> tuple[bytes, int]:
        """The message starting at `at`, and where the next one starts."""
        if at < 0 or at + FRAME.size > self.size:
            raise SpillError(f"{self.path}: cut short at byte {at}")
        self._f.seek(at)
        (n,) = FRAME.unpack(self._f.read(FRAME.size))
        if n > fmt.MAX_SPILL_MESSAGE_BYTES or at + FRAME.size + n > self.size:
            raise SpillError(f"{self.path}: cut short at byte {at + FRAME.size} (a message of {n} bytes)")
        return self._f.read(n), at + FRAME.size + n

    def message(self, at: int, *kinds: type):
        """The message at `at`, decoded as one of `kinds`; and where the next one starts."""
        data, after = self.raw(at)
        try:
            kind = _KIND.decode(data).kind
        except Exception:  # noqa: BLE001 - garbage in a file is reported, not raised as is
            kind = ""
        cls = _BY_KIND.get(kind)
        if cls not in kinds:
            names = " or ".join(k.kind() for k in kinds)
            raise SpillError(f"{self.path}: at byte {at}, expected {names}, found {kind or 'no message'!r}")
        try:
            return cls.from_bytes(data, max_bytes=fmt.MAX_SPILL_MESSAGE_BYTES), after
        except SchemaError as exc:
            raise SpillError(f"{self.path}: at byte {at}: {exc}") from None

    def last_position(self) -> int:
        """What a format-2 spill's last 8 bytes hold: the position of its end record."""
        if self.size < FRAME.size:
            raise SpillError(f"{self.path}: cut short at byte {self.size}")
        self._f.seek(self.size - FRAME.size)
        (at,) = FRAME.unpack(self._f.read(FRAME.size))
        return at

    def close(self) -> None:
        self._f.close()


class Spill:
    """A spill opened for reading: which rows it holds (`keys`), and `restore` to put chosen ones into TQ.

    Holds the file open and an index of (partition, key) -> position; `close` when done (or use `with`).
    """

    def __init__(self, file: _File, header: SpillHeader, where: dict[tuple[str, str], int]):
        self._file = file
        self.header = header
        self._where = where

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def __len__(self) -> int:
        return len(self._where)

    def keys(self, partition: str) -> set[str]:
        """The keys of `partition` the spill holds (a new set each call)."""
        return {k for p, k in self._where if p == partition}

    def holds(self, partition: str, key: str) -> bool:
        return (partition, key) in self._where

    def restore(self, store: KVStore, partition: str, keys: Iterable[str]) -> int:
        """Put the rows of `keys` (those the spill holds) back into `partition`; returns how many.

        Reads the messages holding them in file order, one at a time, one TQ put per chunk.
        """
        wanted: dict[int, set[str]] = {}
        for key in keys:
            at = self._where.get((partition, key))
            if at is not None:
                wanted.setdefault(at, set()).add(key)
        restored = 0
        for at in sorted(wanted):
            msg, after = self._file.message(at, SpillChunk, SpillRowPart)
            if isinstance(msg, SpillChunk):
                restored += _put_chunk(store, partition, msg, wanted[at])
            else:
                _put_row(store, partition, self._row(msg, after), msg.key, msg.tags)
                restored += 1
        return restored

    def _row(self, first: SpillRowPart, after: int) -> bytearray:
        """A row split into parts, put together from the parts that follow each other from `first`."""
        row = bytearray(first.size)
        row[: len(first.data)] = first.data
        filled = len(first.data)
        for i in range(1, first.parts):
            part, after = self._file.message(after, SpillRowPart)
            if (part.key, part.part, part.parts, part.size) != (first.key, i, first.parts, first.size):
                raise SpillError(f"{self._file.path}: row {first.key!r}: part {i} of {first.parts} is not next")
            row[filled : filled + len(part.data)] = part.data
            filled += len(part.data)
        if filled != first.size:
            raise SpillError(f"{self._file.path}: row {first.key!r}: {filled} of its {first.size} bytes")
        return row


def _put_chunk(store: KVStore, partition: str, chunk: SpillChunk, want: set[str]) -> int:
    rows = [r for r, key in enumerate(chunk.keys) if key in want]
    if not rows:
        return 0
    pieces = [chunk.data[chunk.offsets[r] : chunk.offsets[r + 1]] for r in rows]
    offsets = [0]
    for piece in pieces:
        offsets.append(offsets[-1] + len(piece))
    values = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
    keys = [chunk.keys[r] for r in rows]
    try:
        fields = unpack_rows(partition, keys, make_jagged(values, torch.tensor(offsets, dtype=torch.int64))).fields
    except ValueError:  # rows of different fields (a format-1 chunk can mix them): one put each
        for r, piece in zip(rows, pieces):
            _put_row(store, partition, bytearray(piece), chunk.keys[r], chunk.tags[r])
        return len(rows)
    store.put(partition, keys, TensorDict(fields, batch_size=[len(rows)]), [_tags(chunk.tags[r]) for r in rows])
    return len(rows)


def _put_row(store: KVStore, partition: str, row: bytearray, key: str, tags: dict) -> None:
    values = torch.frombuffer(row, dtype=torch.uint8)
    offsets = torch.tensor([0, len(row)], dtype=torch.int64)
    fields = unpack_rows(partition, [key], make_jagged(values, offsets)).fields
    store.put(partition, [key], TensorDict(fields, batch_size=[1]), [_tags(tags)])


def _index_v2(file: _File, header: SpillHeader) -> dict[tuple[str, str], int]:
    end_at = file.last_position()
    try:
        if not 0 < end_at < file.size - FRAME.size:
            raise SpillError(f"its last bytes name position {end_at}")
        end, after = file.message(end_at, SpillEnd)
        if after + FRAME.size != file.size:
            raise SpillError("its end record is not at its end")
    except SpillError as exc:
        raise SpillError(f"{file.path}: cut short (no end record: {exc})") from None
    where: dict[tuple[str, str], int] = {}
    at = end.index_at
    for _ in range(end.index_messages):
        index, at = file.message(at, SpillIndex)
        for key, p, pos in zip(index.keys, index.partition, index.at):
            if p >= len(header.partitions):
                raise SpillError(f"{file.path}: index names partition {p} of {len(header.partitions)}")
            where[(header.partitions[p], key)] = pos
    if len(where) != end.rows:
        raise SpillError(f"{file.path}: cut short (its index holds {len(where)} rows, its end record {end.rows})")
    return where


def _index_v1(file: _File, first: int) -> dict[tuple[str, str], int]:
    """A format-1 spill has no index: one pass over its chunks, keeping their keys, not their rows."""
    where: dict[tuple[str, str], int] = {}
    at, chunks = first, 0
    while True:
        if at >= file.size:
            raise SpillError(f"{file.path}: cut short (its end record is missing)")
        msg, after = file.message(at, SpillChunk, SpillEnd)
        if isinstance(msg, SpillEnd):
            if after != file.size or msg.chunks != chunks or msg.rows != len(where):
                raise SpillError(f"{file.path}: cut short (its end record does not count what came before it)")
            return where
        for key in msg.keys:
            where[(msg.partition, key)] = at
        chunks += 1
        at = after


def read_spill(directory: str | Path, *, binding: str) -> Spill:
    """The spill in `directory`, whole and written for `binding`; SpillError naming what is wrong otherwise.

    Reads its index only (a format-1 spill: one pass keeping keys); `Spill.restore` reads rows.
    """
    file = _File(Path(directory) / SPILL_FILE)
    try:
        if file.size == 0:
            raise SpillError(f"{file.path}: empty")
        header, after = file.message(0, SpillHeader)
        if header.binding != binding:
            raise SpillError(f"{file.path}: written for checkpoint {header.binding!r}, not {binding!r}")
        where = _index_v2(file, header) if header.format >= fmt.FORMAT_V2 else _index_v1(file, after)
    except BaseException:
        file.close()
        raise
    return Spill(file, header, where)


__all__ = ["Spill", "read_spill"]
