"""Keeping TQ's rows in a trainer checkpoint, and putting them back after a whole-job restart (issue 24).

`spill_rows` writes every row of rlstream's TQ partitions (train rows not yet trained, staged calls of
groups still open) to `rows.spill` in a checkpoint directory, as `schemas/spill.py` messages framed
by an 8-byte length; `read_spill` reads it back whole or refuses it (`SpillError`: missing, cut
short, undecodable, or written for another checkpoint), and `Spill.restore` puts chosen rows back
into a fresh TQ. Which rows to put back is `resume.py`'s business: only those whose records still
need them, so nothing trained before the checkpoint comes back.

A row cleared or replaced while the spill reads (the pipeline keeps running) is left out: a row not
spilled is a group handed back after a restart, never a wrong row. The spill costs one read of
every row TQ holds per checkpoint, bounded by what admission control lets run ahead of training.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from schemas.errors import SchemaError
from schemas.jagged import jagged_rows, make_jagged
from schemas.rowpack import pack_rows, unpack_rows
from schemas.spill import MAX_SPILL_MESSAGE_BYTES, SpillChunk, SpillEnd, SpillHeader
from streams.errors import MissingKeysError, RowsUnsettled
from streams.tq import STAGING, TRAIN, KVStore
from workers.trainer.errors import SpillError

SPILL_FILE = "rows.spill"
_LENGTH = struct.Struct(">Q")
# Reads of one row TQ cannot settle now before the spill leaves it out.
_UNSETTLED_TRIES = 3

log = logging.getLogger("rlstream.trainer")


@dataclass
class SpillSummary:
    """What a spill wrote: rows per partition, bytes, and rows gone before they could be read."""

    rows: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    gone: int = 0


def _write(f, msg) -> int:
    data = msg.to_bytes()
    f.write(_LENGTH.pack(len(data)))
    f.write(data)
    return len(data)


def _rows(store: KVStore, partition: str, keys: list[str]) -> Iterator[tuple[list[str], dict[str, torch.Tensor]]]:
    """The rows of `keys` still there, in as few gets as their field sets allow.

    Rows TQ cannot settle now (`RowsUnsettled`: moving under their keys while read, a controller
    failure while a read was checked) are read again one by one, each up to `_UNSETTLED_TRIES` times;
    one still unsettled then is left out, counted gone (the spill must end, and a group whose row it
    lacks is handed back after a restore, never trained from a row that was not its own).
    """
    try:
        yield keys, dict(store.get(partition, keys).items())
        return
    except MissingKeysError as exc:
        gone = set(exc.missing)
        rest = [k for k in keys if k not in gone]
    except (ValueError, RowsUnsettled):  # rows of different fields (or layouts), or moving: one by one
        rest = keys
    if len(rest) == len(keys) or len(rest) == 0:
        one_by_one = rest
    else:
        try:
            yield rest, dict(store.get(partition, rest).items())
            return
        except (MissingKeysError, ValueError, RowsUnsettled):
            one_by_one = rest
    for key in one_by_one:
        for attempt in range(_UNSETTLED_TRIES):
            try:
                yield [key], dict(store.get(partition, [key]).items())
            except (MissingKeysError, ValueError):
                break
            except RowsUnsettled as exc:
                if attempt + 1 == _UNSETTLED_TRIES:
                    log.warning("spill of %r: row %r left out, not settled in TQ: %s", partition, key, exc)
                continue
            break


def _chunk(partition: str, keys: list[str], tags: list[dict], fields: dict[str, torch.Tensor]) -> SpillChunk:
    rows = jagged_rows(pack_rows(partition, keys, fields))
    offsets = rows.offsets.tolist()[: len(keys) + 1]
    data = rows.values.numpy()[offsets[0] : offsets[-1]].tobytes()
    base = offsets[0]
    return SpillChunk(
        partition=partition, keys=tuple(keys), tags=tuple(tags), offsets=tuple(o - base for o in offsets), data=data
    )


def spill_rows(
    store: KVStore,
    directory: str | Path,
    *,
    binding: str,
    partitions: Sequence[str] = (TRAIN, STAGING),
    chunk_rows: int = 16,
) -> SpillSummary:
    """Write every row of `partitions` to `directory`/rows.spill (replaced whole once written and synced)."""
    path = Path(directory) / SPILL_FILE
    tmp = path.with_name(path.name + ".tmp")
    summary = SpillSummary()
    chunks = 0
    with open(tmp, "wb") as f:
        _write(f, SpillHeader(binding=binding, partitions=tuple(partitions), created_ms=int(time.time() * 1000)))
        for partition in partitions:
            listed = store.list(partition)
            keys = sorted(listed)
            summary.rows[partition] = 0
            for i in range(0, len(keys), chunk_rows):
                batch = keys[i : i + chunk_rows]
                for got, fields in _rows(store, partition, batch):
                    chunk = _chunk(partition, got, [dict(listed[k]) for k in got], fields)
                    summary.bytes += _write(f, chunk)
                    summary.rows[partition] += len(got)
                    chunks += 1
            summary.gone += len(keys) - summary.rows[partition]
        _write(f, SpillEnd(chunks=chunks, rows=sum(summary.rows.values())))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return summary


@dataclass(frozen=True)
class _Where:
    chunk: int
    row: int


class Spill:
    """A spill read back: which rows it holds, and `restore` to put chosen ones into TQ."""

    def __init__(self, header: SpillHeader, chunks: list[SpillChunk]):
        self.header = header
        self._chunks = chunks
        self._where: dict[tuple[str, str], _Where] = {}
        for c, chunk in enumerate(chunks):
            for r, key in enumerate(chunk.keys):
                self._where[(chunk.partition, key)] = _Where(c, r)

    def keys(self, partition: str) -> set[str]:
        """The keys of `partition` the spill holds (a new set each call)."""
        return {k for p, k in self._where if p == partition}

    def tags(self, partition: str, key: str) -> dict[str, Any] | None:
        where = self._where.get((partition, key))
        return None if where is None else dict(self._chunks[where.chunk].tags[where.row])

    def restore(self, store: KVStore, partition: str, keys: Sequence[str]) -> int:
        """Put the rows of `keys` (those the spill holds) back into `partition`; returns how many."""
        by_chunk: dict[int, list[int]] = {}
        for key in dict.fromkeys(keys):
            where = self._where.get((partition, key))
            if where is not None:
                by_chunk.setdefault(where.chunk, []).append(where.row)
        restored = 0
        for c, rows in sorted(by_chunk.items()):
            chunk = self._chunks[c]
            pieces = [chunk.data[chunk.offsets[r] : chunk.offsets[r + 1]] for r in rows]
            offsets = [0]
            for piece in pieces:
                offsets.append(offsets[-1] + len(piece))
            values = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
            packed = make_jagged(values, torch.tensor(offsets, dtype=torch.int64))
            keys_ = [chunk.keys[r] for r in rows]
            fields = unpack_rows(partition, keys_, packed).fields
            store.put(partition, keys_, TensorDict(fields, batch_size=[len(rows)]), [chunk.tags[r] for r in rows])
            restored += len(rows)
        return restored


def read_spill(directory: str | Path, *, binding: str) -> Spill:
    """The spill in `directory`, whole and written for `binding`; SpillError naming what is wrong otherwise."""
    path = Path(directory) / SPILL_FILE
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpillError(f"{path}: cannot read the spill ({exc.strerror or exc})") from None
    messages = []
    pos = 0
    while pos < len(raw):
        if pos + _LENGTH.size > len(raw):
            raise SpillError(f"{path}: cut short at byte {pos}")
        (n,) = _LENGTH.unpack_from(raw, pos)
        pos += _LENGTH.size
        if n > MAX_SPILL_MESSAGE_BYTES or pos + n > len(raw):
            raise SpillError(f"{path}: cut short at byte {pos} (a message of {n} bytes)")
        messages.append(raw[pos : pos + n])
        pos += n
    try:
        if not messages:
            raise SpillError(f"{path}: empty")
        header = SpillHeader.from_bytes(messages[0])
        chunks = [SpillChunk.from_bytes(m, max_bytes=MAX_SPILL_MESSAGE_BYTES) for m in messages[1:-1]]
        end = SpillEnd.from_bytes(messages[-1]) if len(messages) > 1 else None
    except SchemaError as exc:
        raise SpillError(f"{path}: {exc}") from None
    if end is None or end.chunks != len(chunks) or end.rows != sum(len(c.keys) for c in chunks):
        raise SpillError(f"{path}: cut short (its end record is missing or does not count what came before it)")
    if header.binding != binding:
        raise SpillError(f"{path}: written for checkpoint {header.binding!r}, not {binding!r}")
    return Spill(header, chunks)


__all__ = ["SPILL_FILE", "Spill", "SpillSummary", "read_spill", "spill_rows"]
