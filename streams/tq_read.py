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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from schemas.jagged import is_nested
from schemas.rowpack import PACKED_FIELD, unpack_rows
from streams.errors import RowsUnsettled


class _Stale(Exception):
    """The locations read from no longer hold the keys' rows: look the keys up again."""


class _NotReady(Exception):
    """Rows at these positions of a read are being cleared."""

    def __init__(self, positions: list[int]):
        super().__init__(positions)
        self.positions = positions


@dataclass(frozen=True)
class Read:
    """One read's outcome: the rows, or why not."""

    rows: TensorDict | None = None
    absent: bool = False  # a key TQ does not map (its lookup found fewer)
    clearing: tuple[int, ...] = ()  # positions of rows being cleared
    # Positions whose packed row names another key; every other row was read as its own.
    foreign: tuple[int, ...] = ()
    failed: bool = False  # storage gone at some index, or rows of the previous layout moved while read
    meta: Any = None  # the locations read from


async def read(tq, client, partition: str, keys: list[str], select, located) -> Read:
    """Read `keys`' rows at `located` (TQ metadata), or where a lookup finds them now (None)."""
    meta = located
    if meta is None:
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if meta.size != len(keys):
            return Read(absent=True)
    names = set(meta.field_names)
    try:
        if PACKED_FIELD not in names and (meta if select is None else meta.select_fields(list(select))).is_ready:
            return Read(await _read_fields(client, partition, keys, meta, select), meta=meta)
        if names != {PACKED_FIELD} or not meta.is_ready:
            # TQ's batch metadata does not say which rows have which fields: rows of both
            # layouts (or rows lacking a selected field) are told apart key by key.
            return Read(await _read_mixed(client, partition, keys, meta, select), meta=meta)
        # The rows hold the packed field alone: nothing to select, and TQ's select_fields would
        # deep-copy the metadata, every row's tags with it (8 ms for a staging read of 4,096 rows).
        data = await client.async_get_data(_fields(meta, None))
        rows = unpack_rows(partition, keys, data.get(PACKED_FIELD), select)
    except (tq.StorageKeyNotFoundError, _Stale):
        return Read(failed=True, meta=meta)
    except _NotReady as exc:
        return Read(clearing=tuple(exc.positions), meta=meta)
    if rows.foreign:
        foreign = set(rows.foreign)
        return Read(foreign=tuple(i for i, k in enumerate(keys) if k in foreign), meta=meta)
    return Read(TensorDict(rows.fields, batch_size=[len(keys)]), meta=meta)


async def _read_fields(client, partition: str, keys: list[str], meta, select) -> TensorDict:
    """Rows of the previous layout (one TQ field per tensor field): read, then checked by a lookup."""
    data = await client.async_get_data(_fields(meta, select))
    fresh = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if fresh.size != len(keys) or fresh.global_indexes != meta.global_indexes:
        raise _Stale()
    return data


async def _read_mixed(client, partition: str, keys: list[str], meta, select) -> TensorDict:
    """Rows of both layouts in one get (written across an upgrade), or some being cleared: each key
    looked up on its own, every one being cleared named at once (`_NotReady`), else each read.

    All at once, not the first: rows a stale clearing mark left (DESIGN "Zombies") stay not ready
    until their owner clears them, and a caller that reads again without the named ones a bounded
    number of times (the reassembler's fetch, three) would never get past more of them than that.
    Reading after every lookup is as safe as in between: each read is checked after it arrives.
    """
    looked_up = []
    for key in keys:
        one = await client.async_kv_retrieve_meta(keys=[key], partition_id=partition, create=False)
        if one.size != 1:
            raise _Stale()
        looked_up.append(one)
    if clearing := [i for i, one in enumerate(looked_up) if not one.is_ready]:
        raise _NotReady(clearing)
    parts = []
    for key, one in zip(keys, looked_up, strict=True):
        if PACKED_FIELD in one.field_names:
            data = await client.async_get_data(_fields(one, [PACKED_FIELD]))
            rows = unpack_rows(partition, [key], data.get(PACKED_FIELD), select)
            if rows.foreign:
                raise _Stale()
            parts.append(rows.fields)
        else:
            parts.append(dict((await _read_fields(client, partition, [key], one, select)).items()))
    return TensorDict(join_rows(parts), batch_size=[len(keys)])


def probes(n: int) -> int:
    """The reads one diagnosis of `n` rows may make: enough to find one broken row by halving, or a
    group's rows, with room to spare; past it, rows not yet read as their keys' count as broken."""
    return 2 * math.ceil(math.log2(max(n, 1))) + 8


async def unreadable(tq, client, partition: str, keys: list[str], select, failed: Read) -> list[str] | None:
    """After `failed`, a read by a lookup of its own: the keys that cannot be read as theirs now, gone
    or foreign at the index TQ still maps them to, or being cleared; [] when the rows only moved (read
    them again); None when a key is absent by now. `RowsUnsettled` if TQ's controller fails meanwhile:
    nothing is known missing then.

    Metadata before data: one lookup of every key, then only the suspects are read (the rows
    `failed` found foreign where they still are; else every row, by halving what fails), at the
    locations that lookup gave, at most `probes(n)` reads; then one reverse lookup tells a row broken
    (its index still holds its key) from one that moved (read again). Rows of rlstream's packed
    layout cost one request a read; rows of the previous layout, or of a batch TQ does not report as
    ready and of one layout, are looked up again at each read.
    """
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if meta.size != len(keys):
        return None
    names = set(meta.field_names)
    uniform = meta.is_ready and (names == {PACKED_FIELD} or PACKED_FIELD not in names)

    async def probe(positions: list[int]) -> Read:
        chunk = [keys[i] for i in positions]
        return await read(tq, client, partition, chunk, select, meta.select_samples(positions) if uniform else None)

    suspects, known_bad = list(range(len(keys))), False
    if failed.meta is not None and list(failed.meta.global_indexes) == list(meta.global_indexes):
        # Read from these very locations a moment ago: what it found there still tells.
        suspects = list(failed.foreign) or suspects
        known_bad = not failed.foreign and failed.failed
    broken = await _locate(probe, suspects, known_bad, probes(len(suspects)))
    if not broken:
        return []
    try:
        held = await client.async_kv_retrieve_keys(
            global_indexes=[meta.global_indexes[i] for i in broken], partition_id=partition
        )
    except RuntimeError as exc:
        # TQ wraps every controller failure so, the partition gone included; but the lookup just found
        # the keys, and a partition gone since is an absent key to the next read's lookup.
        raise RowsUnsettled(
            f"rows of {len(keys)} key(s) of TQ partition {partition!r} (first {keys[0]!r}) could not be checked "
            f"after a failed read: {exc}"
        ) from exc
    return [keys[i] for i, now in zip(broken, held, strict=True) if now == keys[i]]


async def _locate(probe, positions: list[int], known_bad: bool, budget: int) -> list[int]:
    """The positions among `positions` whose rows cannot be read as theirs (`known_bad`: some row of
    them is), in at most `budget` reads (`probe`); past it, every part not yet read whole counts.

    Group testing: a part that fails is halved. Parts of unknown state are read before parts known
    to fail are split further, so the budget goes first to clearing good rows (a few large reads)
    and what is left unresolved is rows near broken ones. A left half read whole means the failure
    is in the right half, which is then split without being read whole again.
    """
    # (part, its right sibling, known to fail if this part reads whole) waiting for a read; parts known to fail.
    unknown: list[tuple[list[int], list[int] | None]] = [] if known_bad else [(positions, None)]
    failing: list[list[int]] = [positions] if known_bad else []
    broken: list[int] = []
    while unknown or failing:
        if not unknown:
            part = failing.pop(0)
            if len(part) == 1:
                broken += part
            else:
                half = len(part) // 2
                unknown.append((part[:half], part[half:]))
            continue
        if budget <= 0:
            break
        budget -= 1
        part, sibling = unknown.pop(0)
        got = await probe(part)
        if got.rows is not None:
            if sibling is not None:
                failing.append(sibling)
            continue
        if sibling is not None:
            unknown.append((sibling, None))
        if got.foreign:  # the read named them: every other row was its own
            broken += [part[i] for i in got.foreign]
        elif got.clearing:
            found = {part[i] for i in got.clearing}
            broken += sorted(found)
            rest = [p for p in part if p not in found]
            if rest:
                unknown.append((rest, None))
        else:
            failing.append(part)
    # Past the budget: rows not read as their keys' count as broken (their reader hands them back).
    left = [p for part, sibling in unknown for p in part + (sibling or [])] + [p for part in failing for p in part]
    return sorted(broken + left)


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
