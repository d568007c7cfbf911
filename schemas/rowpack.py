"""The packed row layout: all of a key's fields in one uint8 row, behind a header naming the key.

TQ's cost grows with the number of (row, field) items it moves, not with bytes (a frame, a pickled
header, a dict insert and per-row shapes at the controller for each). `pack_rows` turns N keys'
fields into N rows of ONE uint8 field, `PACKED_FIELD`; `unpack_rows` turns rows fetched back into
the fields, as views of the fetched buffer wherever the row shapes allow. Pure: no I/O.

A row (layout version 1), every offset relative to the row's start, little-endian:

    0   4 bytes  magic b"RLPK"
    4   u16      layout version (1)
    6   u16      0
    8   u32      H, the length of the msgpack header
    12  H bytes  msgpack [partition, key, [[name, dtype, shape, offset, nbytes], ...]]
    ...          each field's bytes at its offset, 8-aligned; the row is padded to a multiple of 8

The partition and key in the header are checked on every read: TQ reuses a cleared row's storage
index for the next row put (any key, any partition), so a fetch by a location looked up earlier
can return another key's row; `unpack_rows` names such rows instead of returning them. Rows are 8-byte
multiples so that, once TQ has concatenated them, every field starts aligned for its dtype and
1-D rows come back as jagged views of one buffer (no copy).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from schemas.errors import LayoutError
from schemas.jagged import is_nested, jagged_at, jagged_rows, make_jagged

LAYOUT_VERSION = 1
# The one TQ field of a packed row; a row with other fields is in the previous layout (one TQ
# field per tensor field), which readers still accept.
PACKED_FIELD = "rlstream_packed"
_MAGIC = b"RLPK"
_PREFIX = struct.Struct("<4sHHI")
_ALIGN = 8
_ZEROS = np.zeros(_ALIGN, dtype=np.uint8)
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}
_NAMES = {d: n for n, d in _DTYPES.items()}
_SIZES = {d: torch.empty(0, dtype=d).element_size() for d in _DTYPES.values()}
_HEADER = msgspec.msgpack.Encoder()
_READ = msgspec.msgpack.Decoder(tuple[str, str, list[tuple[str, str, list[int], int, int]]])


@dataclass(frozen=True)
class Unpacked:
    """What `unpack_rows` read: the fields by name, or the keys whose rows hold another key."""

    fields: dict[str, torch.Tensor]
    foreign: list[str]  # requested keys whose row names another key or partition (its index was reused)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor's (contiguous) storage as a numpy uint8 array, without a copy."""
    flat = t.contiguous().reshape(-1)
    return (flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)).numpy()


def _column_bytes(name: str, value: torch.Tensor, n: int) -> tuple[str, np.ndarray, list[int], list[int], list]:
    """A field's dtype name, its bytes, and each row's start, length (bytes) and shape."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"field {name!r} is a {type(value).__name__}, not a tensor")
    if value.dtype not in _NAMES:
        raise TypeError(f"field {name!r} has dtype {value.dtype}, which the packed layout does not carry")
    size = value.element_size()
    if is_nested(value):
        rows = jagged_rows(value)
        items = rows.item_lengths()
        starts = [s * rows.scale * size for s in rows.offsets.tolist()[:n]]
        per_token = rows.scale
        shapes = [[k // per_token, *rows.rest] for k in items] if rows.rest else [[k] for k in items]
        return _NAMES[value.dtype], _raw(rows.values), starts, [k * size for k in items], shapes
    if value.dim() == 0 or value.shape[0] != n:
        raise ValueError(f"field {name!r} has shape {tuple(value.shape)}, not [{n}, ...]")
    row = math.prod(value.shape[1:]) * size
    return _NAMES[value.dtype], _raw(value), list(range(0, n * row, row)), [row] * n, [list(value.shape[1:])] * n


def pack_rows(partition: str, keys: Sequence[str], fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The rows of `keys` in `partition` (row i of every field) as a jagged uint8 tensor [N, bytes].

    One numpy concatenate gathers every row's header and field bytes: a memcpy of the payload plus
    a few Python operations per (row, field), instead of a tensor op for each.
    """
    n = len(keys)
    columns = [(name, *_column_bytes(name, value, n)) for name, value in fields.items()]
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    for i, key in enumerate(keys):
        entries, offset = [], 0
        for name, dtype, _, _, nbytes, shapes in columns:
            entries.append((name, dtype, shapes[i], offset, nbytes[i]))
            offset = _align(offset + nbytes[i])
        header = _PREFIX.pack(_MAGIC, LAYOUT_VERSION, 0, 0) + _HEADER.encode((partition, key, entries))
        start = _align(len(header))
        pieces.append(np.frombuffer(header[:8] + struct.pack("<I", len(header) - _PREFIX.size) + header[12:], np.uint8))
        if start > len(header):
            pieces.append(_ZEROS[: start - len(header)])
        for _, _, raw, starts, nbytes, _ in columns:
            a, k = starts[i], nbytes[i]
            pieces.append(raw[a : a + k])
            if pad := _align(k) - k:
                pieces.append(_ZEROS[:pad])
        lengths.append(start + offset)
    values = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.empty(0, dtype=torch.uint8)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return make_jagged(values, offsets)


def unpack_rows(
    partition: str, keys: Sequence[str], packed: torch.Tensor, select: Sequence[str] | None = None
) -> Unpacked:
    """The fields of the packed rows `packed` (in the order of `keys`), cut to `select` (None: all).

    Rows of 0-dim values come back stacked, 1-D rows as a jagged view of `packed`'s buffer, rows
    of more dims as a jagged copy: what TQ's own get returns for the same fields. A row naming
    another key is reported in `foreign`, its fields are then not returned. A row of a layout
    this code cannot read raises `LayoutError`.
    """
    rows = jagged_rows(packed) if is_nested(packed) else None
    if rows is None or rows.scale != 1 or rows.values.dtype is not torch.uint8:
        raise LayoutError(partition, keys[0] if keys else "?", "?", "the packed field is not jagged uint8 rows")
    buf = rows.values.contiguous()
    if buf.storage_offset() % _ALIGN:
        buf = buf.clone()  # fields are 8-aligned relative to the buffer: its start must be too
    raw = buf.numpy()
    starts = rows.offsets.tolist()
    lengths = rows.item_lengths()
    if len(lengths) != len(keys):
        raise LayoutError(
            partition, keys[0] if keys else "?", LAYOUT_VERSION, f"{len(lengths)} rows for {len(keys)} keys"
        )
    layouts: list[list[tuple[str, str, list[int], int, int]]] = []
    foreign: list[str] = []
    for key, start, length in zip(keys, starts, lengths):
        layouts.append(_read_header(partition, key, raw, start, length, foreign))
    if foreign:
        return Unpacked({}, foreign)
    names = list(select) if select is not None else [e[0] for e in layouts[0]] if layouts else []
    by_name = [{e[0]: e for e in layout} for layout in layouts]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        placed = [row.get(name) for row in by_name]
        if None in placed:
            key = keys[placed.index(None)]
            raise ValueError(f"field {name!r} is not in row {key!r} of TQ partition {partition!r}")
        out[name] = _column(buf, placed)
    if select is None and any(len(row) != len(names) for row in by_name):
        raise ValueError(f"rows of TQ partition {partition!r} do not all have the fields {names}")
    return Unpacked(out, [])


def _read_header(partition: str, key: str, raw: np.ndarray, start: int, length: int, foreign: list[str]):
    if length < _PREFIX.size:
        raise LayoutError(partition, key, "?", f"a row of {length} bytes is shorter than the packed prefix")
    magic, version, _, size = _PREFIX.unpack_from(raw, start)
    if magic != _MAGIC:
        raise LayoutError(partition, key, "?", "the row does not start with the packed layout's magic")
    if version != LAYOUT_VERSION:
        raise LayoutError(partition, key, version, f"this code reads layout {LAYOUT_VERSION} only")
    body = start + _PREFIX.size
    try:
        stored_partition, stored, entries = _READ.decode(memoryview(raw)[body : body + size])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LayoutError(partition, key, version, f"its header does not decode ({exc})") from None
    if stored != key or stored_partition != partition:
        foreign.append(key)
        return []
    base = start + _align(_PREFIX.size + size)
    end = start + length
    placed = []
    for name, dtype, shape, offset, nbytes in entries:
        if dtype not in _DTYPES or base + offset + nbytes > end or offset % _ALIGN:
            raise LayoutError(partition, key, version, f"field {name!r} ({dtype}, {nbytes} bytes) lies outside the row")
        placed.append((name, dtype, shape, base + offset, nbytes))
    return placed


def _column(buf: torch.Tensor, placed: list[tuple[str, str, list[int], int, int]]) -> torch.Tensor:
    """One field of every row: stacked 0-dim values, a jagged view for 1-D rows, else a jagged copy."""
    name, dtype_name = placed[0][0], placed[0][1]
    if any(e[1] != dtype_name for e in placed):
        raise ValueError(f"rows of field {name!r} disagree on their dtype")
    dtype = _DTYPES[dtype_name]
    size = _SIZES[dtype]
    dims = {len(e[2]) for e in placed}
    typed = buf.view(dtype) if size == 1 else buf[: buf.numel() - buf.numel() % size].view(dtype)
    if dims == {1}:
        offsets = torch.tensor([e[3] // size for e in placed] + [typed.numel()], dtype=torch.int64)
        lengths = torch.tensor([e[4] // size for e in placed], dtype=torch.int64)
        return jagged_at(typed, offsets, lengths)
    if dims == {0}:
        return typed[torch.tensor([e[3] // size for e in placed], dtype=torch.int64)]
    rows = [typed[e[3] // size : (e[3] + e[4]) // size].view(e[2]) for e in placed]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
