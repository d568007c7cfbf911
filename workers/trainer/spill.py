"""Keeping TQ's rows in a trainer checkpoint (issue 24), in messages a reader always accepts (issue 30).

`spill_rows` writes every row of rlstream's TQ partitions (train rows not yet trained, staged calls of
groups still open) to `rows.spill` in a checkpoint directory, as `schemas/spill.py` messages framed
by an 8-byte length: chunks of whole rows up to `chunk_bytes()` (64 MiB) of data, a row bigger than
that split into parts of that size, then an index of where each row lies, and the end record.
Memory stays bounded by a few chunks (a read from TQ of at most a chunk of rows, sized ahead by the
store's metadata, its packed copy and the chunk being filled), or by the largest row, read alone.
`spill_read.py` reads it back and puts chosen rows into TQ.

A row cleared or replaced while the spill reads (the pipeline keeps running), or a staged row still
being put (no tags yet), is left out: a row not spilled is a group handed back after a restart, never a
wrong row. The spill costs one read of
every row TQ holds per checkpoint, bounded by what admission control lets run ahead of training;
`checkpoint_dir.begin_checkpoint` writes it off the trainer's thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from schemas import spill as fmt
from schemas.jagged import jagged_rows
from schemas.rowpack import pack_rows
from schemas.spill import FRAME, SpillChunk, SpillEnd, SpillHeader, SpillIndex, SpillRowPart
from streams.errors import MissingKeysError, RowsUnsettled
from streams.tq import STAGING, TRAIN, KVStore

SPILL_FILE = "rows.spill"
# Keys whose sizes one metadata call looks up, ahead of the reads they size.
_SIZED = 4096
# Reads of one row TQ cannot settle now before the spill leaves it out.
_UNSETTLED_TRIES = 3

log = logging.getLogger("rlstream.trainer")


@dataclass
class SpillSummary:
    """What a spill wrote: rows per partition, bytes, and rows gone before they could be read."""

    rows: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    gone: int = 0
    messages: int = 0
    largest_message: int = 0


class _Writer:
    """Frames messages into the file, and notes where each row lies for the index."""

    def __init__(self, f, partitions: Sequence[str], limit: int):
        self._f = f
        self._limit = limit
        self.partition_no = {p: i for i, p in enumerate(partitions)}
        self.keys: list[str] = []
        self.parts_of: list[int] = []
        self.at: list[int] = []
        self.chunks = self.parts = 0
        self.summary = SpillSummary()

    def write(self, msg) -> int:
        """Frame `msg`; returns the file position it starts at."""
        data = msg.to_bytes()
        if len(data) > self._limit:  # never written: a reader would refuse the whole file for it
            raise ValueError(f"a spill message of {len(data)} bytes exceeds the {self._limit} bytes a reader accepts")
        at = self._f.tell()
        self._f.write(FRAME.pack(len(data)))
        self._f.write(data)
        self.summary.messages += 1
        self.summary.largest_message = max(self.summary.largest_message, len(data))
        return at

    def rows(self, partition: str, keys: list[str], tags: list[dict], data: bytes, offsets: list[int]) -> None:
        at = self.write(
            SpillChunk(partition=partition, keys=tuple(keys), tags=tuple(tags), offsets=tuple(offsets), data=data)
        )
        self.chunks += 1
        self._noted(partition, keys, at)

    def big_row(self, partition: str, key: str, tags: dict, data: memoryview, part_bytes: int) -> None:
        parts = -(-len(data) // part_bytes)
        first = None
        for i in range(parts):
            piece = bytes(data[i * part_bytes : (i + 1) * part_bytes])
            msg = SpillRowPart(partition=partition, key=key, tags=tags, part=i, parts=parts, size=len(data), data=piece)
            at = self.write(msg)
            first = at if first is None else first
        self.parts += parts
        self._noted(partition, [key], first)

    def _noted(self, partition: str, keys: list[str], at: int) -> None:
        self.keys.extend(keys)
        self.parts_of.extend([self.partition_no[partition]] * len(keys))
        self.at.extend([at] * len(keys))
        self.summary.rows[partition] = self.summary.rows.get(partition, 0) + len(keys)

    def finish(self) -> None:
        index_at = -1
        messages = 0
        for i in range(0, len(self.keys), fmt.INDEX_ENTRIES):
            s = slice(i, i + fmt.INDEX_ENTRIES)
            at = self.write(
                SpillIndex(keys=tuple(self.keys[s]), partition=tuple(self.parts_of[s]), at=tuple(self.at[s]))
            )
            index_at = at if index_at < 0 else index_at
            messages += 1
        rows = len(self.keys)
        end = SpillEnd(chunks=self.chunks, rows=rows, parts=self.parts, index_at=index_at, index_messages=messages)
        end_at = self.write(end)
        self._f.write(FRAME.pack(end_at))


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


def _tags_after_read(store: KVStore, partition: str, keys: list[str], listed: dict[str, dict]) -> dict[str, dict]:
    """The tags of rows just read, by key; a staged row without any is left out.

    The listing came before the reads, and TQ registers a put's keys (listed, no tags), writes their
    fields (a get finds them) and only then sets their tags: a row listed mid-put was listed with none,
    and its tags read after the row are the ones it was put with. A staged row still without tags is
    in the middle of its put, and no receipt can own it (`schemas.staged_rows.owned_by`): spilled so,
    it came back after a restart a row no group owned, and its group was dead-lettered (seen in the
    job-restart drill); left out, its group is handed back and generated again.
    """
    try:
        fresh = store.tags(partition, keys)
    except RowsUnsettled:  # the controller did not answer: the listing's tags, an untagged staged row out
        fresh = {}
    tags = {}
    for key in keys:
        tag = fresh.get(key) or listed.get(key) or {}
        if tag or partition != STAGING:
            tags[key] = dict(tag)
    return tags


def _packed(partition: str, keys: list[str], fields: dict[str, torch.Tensor]) -> tuple[memoryview, list[int]]:
    """The rows packed (`schemas/rowpack.py`): their bytes, and where each row starts and ends in them."""
    rows = jagged_rows(pack_rows(partition, keys, fields))
    offsets = rows.offsets.tolist()[: len(keys) + 1]
    return memoryview(rows.values.numpy()).cast("B"), offsets


def _batches(store: KVStore, partition: str, keys: list[str], per_chunk: int) -> Iterator[list[str]]:
    """`keys` in order, in reads of at most a chunk of row bytes by the store's sizes (metadata, looked
    up ahead), or of one row alone: one bigger than a chunk, or whose size the store cannot tell."""
    for i in range(0, len(keys), _SIZED):
        window = keys[i : i + _SIZED]
        sizes = store.row_bytes(partition, window)
        batch: list[str] = []
        nbytes = 0
        for key in window:
            size = sizes.get(key)
            if size is None or size > per_chunk:
                if batch:
                    yield batch
                    batch, nbytes = [], 0
                yield [key]
                continue
            if batch and (nbytes + size > per_chunk or len(batch) >= fmt.CHUNK_MAX_ROWS):
                yield batch
                batch, nbytes = [], 0
            batch.append(key)
            nbytes += size
        if batch:
            yield batch


def _spill_partition(w: _Writer, store: KVStore, partition: str, per_chunk: int) -> int:
    """Every row of `partition` into chunks (and parts); returns how many were listed."""
    listed = store.list(partition)
    keys = sorted(listed)
    pending: list[tuple[str, memoryview, dict]] = []
    pending_bytes = 0
    pending_kind: tuple = ()  # a chunk holds rows of one field set, as one get returns them

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            offsets = [0]
            for _, row, _ in pending:
                offsets.append(offsets[-1] + len(row))
            data = b"".join(row for _, row, _ in pending)
            w.rows(partition, [k for k, _, _ in pending], [t for _, _, t in pending], data, offsets)
            w.summary.bytes += len(data)
        pending, pending_bytes = [], 0

    for asked in _batches(store, partition, keys, per_chunk):
        for got, fields in _rows(store, partition, asked):
            kind = tuple(sorted((name, str(t.dtype)) for name, t in fields.items()))
            if kind != pending_kind:
                flush()
                pending_kind = kind
            values, offsets = _packed(partition, got, fields)
            tags = _tags_after_read(store, partition, got, listed)
            for r, key in enumerate(got):
                if key not in tags:
                    continue  # counted gone: listed, not spilled
                row = values[offsets[r] : offsets[r + 1]]
                if len(row) > per_chunk:
                    flush()
                    w.big_row(partition, key, tags[key], row, per_chunk)
                    w.summary.bytes += len(row)
                    continue
                if pending and (pending_bytes + len(row) > per_chunk or len(pending) >= fmt.CHUNK_MAX_ROWS):
                    flush()
                pending.append((key, row, tags[key]))
                pending_bytes += len(row)
    flush()
    return len(keys)


def spill_rows(
    store: KVStore,
    directory: str | Path,
    *,
    binding: str,
    partitions: Sequence[str] = (TRAIN, STAGING),
) -> SpillSummary:
    """Write every row of `partitions` to `directory`/rows.spill (replaced whole once written and synced)."""
    path = Path(directory) / SPILL_FILE
    tmp = path.with_name(path.name + ".tmp")
    limit = fmt.MAX_SPILL_MESSAGE_BYTES
    per_chunk = fmt.chunk_bytes(limit)
    with open(tmp, "wb") as f:
        w = _Writer(f, partitions, limit)
        header = SpillHeader(
            binding=binding, partitions=tuple(partitions), created_ms=int(time.time() * 1000), format=fmt.FORMAT_V2
        )
        w.write(header)
        for partition in partitions:
            w.summary.rows.setdefault(partition, 0)
            listed = _spill_partition(w, store, partition, per_chunk)
            w.summary.gone += listed - w.summary.rows[partition]
        w.finish()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return w.summary


__all__ = ["SPILL_FILE", "SpillSummary", "spill_rows"]
