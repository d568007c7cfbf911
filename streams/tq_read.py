"""Reading TQ rows as their keys' own rows: the read, its check after the data arrives, and what a failed read means.

TQ finds rows by a metadata call to its controller (keys -> global indexes), then fetches them from
the storage units by index. It reuses a cleared row's index for the next row put, in any partition,
so what was read is checked after it arrives: by the key each packed row carries
(`schemas.rowpack`), or (rows of the previous per-field layout) by a lookup sent once the data is
in. `read` is one attempt; `unreadable` tells, after a read by a fresh lookup still failed, which
keys cannot be read as theirs now (gone or foreign at the index TQ still maps them to) from keys
whose rows only moved. `TQStore.get` (streams/tq.py) runs them on TQ's client loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from schemas.jagged import is_nested
from schemas.rowpack import PACKED_FIELD, unpack_rows


class _Stale(Exception):
    """The locations read from no longer hold the keys' rows: look the keys up again."""


class _NotReady(Exception):
    """Rows at these positions of a read are being cleared."""

    def __init__(self, positions: list[int]):
        super().__init__(positions)
        self.positions = positions


async def read(tq, client, partition: str, keys: list[str], select, located) -> TensorDict | list | bool | None:
    """The rows; None if some key is absent; the keys being cleared; False if the locations read
    went stale (look up again)."""
    meta = located
    if meta is None:
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if meta.size != len(keys):
            return None
    names = set(meta.field_names)
    try:
        if PACKED_FIELD not in names and (meta if select is None else meta.select_fields(list(select))).is_ready:
            return await _read_fields(client, partition, keys, meta, select)
        if names != {PACKED_FIELD} or not meta.is_ready:
            # TQ's batch metadata does not say which rows have which fields: rows of both
            # layouts (or rows lacking a selected field) are told apart key by key.
            return await _read_mixed(client, partition, keys, meta, select)
        data = await client.async_get_data(_fields(meta, [PACKED_FIELD]))
        rows = unpack_rows(partition, keys, data.get(PACKED_FIELD), select)
    except (tq.StorageKeyNotFoundError, _Stale):
        return False
    except _NotReady as exc:
        return [keys[i] for i in exc.positions]
    if rows.foreign:
        return False
    return TensorDict(rows.fields, batch_size=[len(keys)])


async def _read_fields(client, partition: str, keys: list[str], meta, select) -> TensorDict:
    """Rows of the previous layout (one TQ field per tensor field): read, then checked by a lookup."""
    data = await client.async_get_data(_fields(meta, select))
    fresh = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if fresh.size != len(keys) or fresh.global_indexes != meta.global_indexes:
        raise _Stale()
    return data


async def _read_mixed(client, partition: str, keys: list[str], meta, select) -> TensorDict:
    """Rows of both layouts in one get (written across an upgrade): each key read on its own."""
    parts = []
    for i, key in enumerate(keys):
        one = await client.async_kv_retrieve_meta(keys=[key], partition_id=partition, create=False)
        if one.size != 1:
            raise _Stale()
        if not one.is_ready:
            raise _NotReady([i])
        if PACKED_FIELD in one.field_names:
            data = await client.async_get_data(_fields(one, [PACKED_FIELD]))
            rows = unpack_rows(partition, [key], data.get(PACKED_FIELD), select)
            if rows.foreign:
                raise _Stale()
            parts.append(rows.fields)
        else:
            parts.append(dict((await _read_fields(client, partition, [key], one, select)).items()))
    return TensorDict(join_rows(parts), batch_size=[len(keys)])


async def unreadable(tq, client, partition: str, keys: list[str], select) -> list[str]:
    """The keys of a failed read that cannot be read as theirs now: absent, being cleared, or gone or
    foreign at the index TQ still maps them to. Found by halving the read, so one such row among
    many costs a few reads, not one per key; [] when the rows only moved (read them again)."""
    if len(keys) == 1:
        return await _unreadable_one(tq, client, partition, keys[0], select)
    out: list[str] = []
    for part in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):
        if not isinstance(await read(tq, client, partition, part, select, None), TensorDict):
            out += await unreadable(tq, client, partition, part, select)
    return out


async def _unreadable_one(tq, client, partition: str, key: str, select) -> list[str]:
    meta = await client.async_kv_retrieve_meta(keys=[key], partition_id=partition, create=False)
    if meta.size != 1:
        return [key]
    got = await read(tq, client, partition, [key], select, meta)
    if isinstance(got, TensorDict):
        return []
    if got is not False:
        return [key]  # absent or being cleared by now
    # Gone or foreign where it was read: broken if TQ still maps the key there, else it moved.
    try:
        held = await client.async_kv_retrieve_keys(global_indexes=list(meta.global_indexes), partition_id=partition)
    except RuntimeError:  # TQ's answer when the partition is gone: so is the key
        return [key]
    return [key] if list(held) == [key] else []


def join_rows(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Single-row fields of several reads as one batch: 0-dim rows stacked, others jagged (as TQ's get)."""
    out: dict[str, torch.Tensor] = {}
    for name in parts[0]:
        if any(name not in p for p in parts):
            raise ValueError(f"field {name!r} is not in every row read")
        rows = [r for p in parts for r in (p[name].unbind() if is_nested(p[name]) else p[name])]
        out[name] = (
            torch.stack(rows)
            if all(r.dim() == 0 for r in rows)
            else torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        )
    return out


def _fields(meta: Any, select: Sequence[str] | None) -> Any:
    """TQ metadata cut to the `select`ed fields (None: all), checked ready as TQ's own get does.

    A row not ready is one being cleared (TQ marks it before it deletes it): to the caller it is as
    good as gone, so `get` reports it missing, which every caller handles, rather than as an error.
    """
    if select is not None:
        meta = meta.select_fields(list(select))
    if not meta.is_ready:
        status = np.asarray(meta.production_status)
        ready = status.reshape(meta.size, -1).min(axis=1) == 1 if status.size else np.zeros(meta.size, bool)
        raise _NotReady([i for i, ok in enumerate(ready) if not ok] or list(range(meta.size)))
    return meta
