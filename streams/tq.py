"""The small KV client over TransferQueue that the workers use for the staging and train partitions.

`KVStore` is the narrow interface the workers use; `TQStore` implements it over TQ's KV API (unit
tests of pure logic use a dict-backed store of the same interface, in tests/unit). Starting or
attaching to Ray and TQ is `streams.tq_setup`, whose names are re-exported here.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDict

from schemas.jagged import is_nested
from schemas.rowpack import PACKED_FIELD, pack_rows, unpack_rows
from streams.errors import MissingKeysError, TQError, TQTimeout
from streams.tq_setup import (
    CLUSTER,
    SINGLE_NODE,
    TQConfig,
    TQProfile,
    TQSession,
    bound_tq_calls,
    init_tq,
    nodes_offering,
    ray_address,
    start_tq_metrics,
)

__all__ = [
    "CLUSTER",
    "SINGLE_NODE",
    "STAGING",
    "TRAIN",
    "KVStore",
    "TQConfig",
    "TQProfile",
    "TQSession",
    "TQStore",
    "bound_tq_calls",
    "init_tq",
    "join_rows",
    "nodes_offering",
    "ray_address",
    "start_tq_metrics",
    "with_call_deadline",
]

# Prefixed, so rlstream's rows never share a partition with a framework's own "train" (verl's, ...).
STAGING = "rlstream.staging"
TRAIN = "rlstream.train"


class KVStore(Protocol):
    def put(
        self, partition: str, keys: Sequence[str], fields: TensorDict, tags: Sequence[Mapping[str, Any]]
    ) -> None: ...

    def get(self, partition: str, keys: Sequence[str], select: Sequence[str] | None = None) -> TensorDict: ...

    def present(self, partition: str, keys: Sequence[str]) -> set[str]: ...

    def list(self, partition: str) -> dict[str, dict[str, Any]]: ...

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The tags each present key was put with; absent keys are left out."""
        ...

    def clear(self, partition: str, keys: Sequence[str]) -> None: ...


def with_call_deadline(store: KVStore, deadline_s: float) -> KVStore:
    """`store` with every TQ call it makes given up after `deadline_s` (`TQTimeout`), or `store` itself
    when it does not call TQ (an in-memory store of tests).

    TQ waits for its controller with no timeout at all, and for a storage unit up to 3 x 200 s: a
    worker that must know a put landed in time (a reassembler's lease) cannot rely on either. The
    call is cancelled where it waits, so it sends no later request; what it sent already, TQ may
    still apply afterwards (see `TQStore`).
    """
    if deadline_s <= 0:
        raise ValueError(f"a TQ call deadline must be positive, got {deadline_s}")
    if not isinstance(store, TQStore):
        return store
    bounded = copy.copy(store)
    bounded._deadline_s = deadline_s
    bounded._located, bounded._lock = OrderedDict(), threading.Lock()
    return bounded


# Row lookups `TQStore.tags` keeps for a `get` of the same keys; a trainer has a batch or two in flight.
_LOCATED_BATCHES = 32
# Reads of one get before giving up on rows that keep moving under their keys (cleared and put again).
_READS = 3


class _Stale(Exception):
    """The locations read from no longer hold the keys' rows: look the keys up again."""


class _NotReady(Exception):
    """Rows at these positions of a read are being cleared."""

    def __init__(self, positions: list[int]):
        super().__init__(positions)
        self.positions = positions


class TQStore:
    """KVStore over TQ's module-level KV API (the process must have called `init_tq`).

    Rows of the `packed` partitions (rlstream's own, by default) are stored in the packed layout of
    `schemas.rowpack`: one TQ field per key holding all of its fields and its key, so TQ moves one
    item per row instead of one per (row, field), and every row read is checked to be the key's.
    Other partitions (a framework's own, verl's) keep one TQ field per tensor field, as put; rows
    of a packed partition written in that previous layout are still read.

    TQ finds rows by a metadata call to its controller (keys -> storage locations), then fetches
    them from the storage units. `tags` keeps the locations of the keys it found all present, so a
    `get` of exactly those keys (a trainer's select, then materialize) fetches without a lookup.
    TQ reuses a cleared row's location for the next row put, so what was read is checked after it
    arrives: by the key each packed row carries, or (previous layout) by a lookup sent once the
    data is in. Never before or alongside: a row cleared and replaced between that check and the
    read would be returned as the key's.

    Every call runs as one coroutine on TQ's client loop; with a deadline (`with_call_deadline`)
    it is cancelled there when the deadline passes, at whatever request it waits on (the
    controller's, a storage unit's), and `TQTimeout` is raised. Cancelling withdraws nothing already
    sent: TQ 0.1.11 has no request deadline a controller or storage unit would check, so a put
    given up on can still write its rows at the indexes the controller gave it, and mark them
    ready, when a stalled unit or controller gets to the request.
    """

    def __init__(self, packed: Iterable[str] = (STAGING, TRAIN), *, tq: Any = None) -> None:
        # `tq`: the `transfer_queue` module to call (None: the installed one). A stand-in (the explorer's
        # model of TQ 0.1.11, tests/tools/sim/tq) has the same KV API and client, and names its storage
        # units' timeout error `StorageUnitTimeout`. An argument only: no setting reaches it.
        if tq is None:
            import transfer_queue as tq
            from transfer_queue.storage.managers.simple_storage_manager import StorageUnitTimeout
        else:
            StorageUnitTimeout = tq.StorageUnitTimeout  # noqa: N806 - the class, as TQ names it

        self._tq = tq
        self._unit_timeout = StorageUnitTimeout
        self._packed = frozenset(packed)
        self._located: OrderedDict[tuple[str, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._deadline_s: float | None = None

    def _call(self, what: str, coro) -> Any:
        """Run `coro` on TQ's client loop, within the deadline if there is one."""
        client = self._tq.get_client()
        if self._deadline_s is not None:
            coro = _within(coro, self._deadline_s, what)
        try:
            return client._run_coroutine(coro)
        except self._unit_timeout as exc:
            # After TQ's own attempts, each on a new connection: the unit may still serve the request.
            raise TQTimeout(f"TQ {what}: {exc}") from exc

    def put(self, partition: str, keys: Sequence[str], fields: TensorDict, tags: Sequence[Mapping[str, Any]]) -> None:
        if not keys:
            return
        keys = list(keys)
        if partition in self._packed:
            fields = TensorDict({PACKED_FIELD: pack_rows(partition, keys, fields)}, batch_size=[len(keys)])
        tags = [dict(t) for t in tags]
        put = self._tq.async_kv_batch_put(keys=keys, partition_id=partition, fields=fields, tags=tags)
        self._call(f"put of {len(keys)} key(s) to {partition!r}", put)

    def get(self, partition: str, keys: Sequence[str], select: Sequence[str] | None = None) -> TensorDict:
        """Rows in the order of `keys`; raises MissingKeysError naming absent keys instead of returning fewer rows."""
        keys = list(keys)
        if not keys:
            raise ValueError("get needs at least one key")
        client = self._tq.get_client()
        with self._lock:
            located = self._located.get((partition, tuple(keys)))
        for _ in range(_READS):
            # The lookup (if any), the read and its check in one coroutine on TQ's loop: one thread hop.
            read = self._read(client, partition, keys, select, located)
            data = self._call(f"get of {len(keys)} key(s) from {partition!r}", read)
            if isinstance(data, TensorDict):
                return data
            if isinstance(data, list):
                raise MissingKeysError(partition, data)
            if located is not None:
                self._forget(partition, keys)
                located = None
            if data is None:
                raise MissingKeysError(partition, self._missing(partition, keys))
        raise TQError(
            f"rows of {len(keys)} key(s) of TQ partition {partition!r} (first {keys[0]!r}) kept moving "
            f"while read {_READS} times: cleared and put again by another client"
        )

    async def _read(self, client, partition: str, keys: list[str], select, located) -> TensorDict | list | bool | None:
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
                return await self._read_fields(client, partition, keys, meta, select)
            if names != {PACKED_FIELD} or not meta.is_ready:
                # TQ's batch metadata does not say which rows have which fields: rows of both
                # layouts (or rows lacking a selected field) are told apart key by key.
                return await self._read_mixed(client, partition, keys, meta, select)
            data = await client.async_get_data(_fields(meta, [PACKED_FIELD]))
            rows = unpack_rows(partition, keys, data.get(PACKED_FIELD), select)
        except (self._tq.StorageKeyNotFoundError, _Stale):
            return False
        except _NotReady as exc:
            return [keys[i] for i in exc.positions]
        if rows.foreign:
            return False
        return TensorDict(rows.fields, batch_size=[len(keys)])

    async def _read_fields(self, client, partition: str, keys: list[str], meta, select) -> TensorDict:
        """Rows of the previous layout (one TQ field per tensor field): read, then checked by a lookup."""
        data = await client.async_get_data(_fields(meta, select))
        fresh = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if fresh.size != len(keys) or fresh.global_indexes != meta.global_indexes:
            raise _Stale()
        return data

    async def _read_mixed(self, client, partition: str, keys: list[str], meta, select) -> TensorDict:
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
                parts.append(dict((await self._read_fields(client, partition, [key], one, select)).items()))
        return TensorDict(join_rows(parts), batch_size=[len(keys)])

    def _missing(self, partition: str, keys: list[str]) -> list[str]:
        present = self.present(partition, keys)
        return [k for k in keys if k not in present]

    def _remember(self, partition: str, keys: list[str], meta: Any) -> None:
        with self._lock:
            self._located[(partition, tuple(keys))] = meta
            self._located.move_to_end((partition, tuple(keys)))
            while len(self._located) > _LOCATED_BATCHES:
                self._located.popitem(last=False)

    def _forget(self, partition: str, keys: Sequence[str]) -> None:
        gone = set(keys)
        with self._lock:
            for key in [k for k in self._located if k[0] == partition and not gone.isdisjoint(k[1])]:
                del self._located[key]

    def present(self, partition: str, keys: Sequence[str]) -> set[str]:
        listed = self.list(partition)
        return {k for k in keys if k in listed}

    def list(self, partition: str) -> dict[str, dict[str, Any]]:
        listed = self._call(f"list of {partition!r}", self._tq.async_kv_list(partition_id=partition))
        return dict(listed.get(partition, {}))

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        # One metadata call when every key is present (the common case); the tags are its custom meta.
        lookup = self._tq.get_client().async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        meta = self._call(f"lookup of {len(keys)} key(s) in {partition!r}", lookup)
        if meta.size == len(keys):
            self._remember(partition, keys, meta)
            # The tags as TQ sent them, copied per key (get_all_custom_meta deep-copies: ~6 ms for 64 rows).
            return {k: dict(t) for k, t in zip(keys, meta.custom_meta)}
        listed = self.list(partition)
        return {k: dict(listed[k]) for k in keys if k in listed}

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        if keys:
            self._forget(partition, keys)
            clear = self._tq.async_kv_clear(keys=list(keys), partition_id=partition)
            self._call(f"clear of {len(keys)} key(s) from {partition!r}", clear)


async def _within(coro, deadline_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(coro, deadline_s)
    except TimeoutError:
        raise TQTimeout(
            f"TQ {what} did not finish within {deadline_s:g}s: given up (cancelled where it waited, so it "
            "sends nothing more; what it sent already may still be applied)"
        ) from None


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
