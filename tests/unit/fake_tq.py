"""A fake of TransferQueue's module and client for unit tests of `TQStore` (no Ray, no TQ processes).

It keeps TQ's two halves apart, as transfer_queue 0.1.11 does: a controller that maps each
partition's keys to global indexes (with their tags and whether their rows are ready), and storage
that keeps rows by global index only, knowing nothing of partitions or keys. Indexes come from one
pool shared by every partition and freed indexes are handed out again first in first out, so a
stale location finds another key's row, of any partition. A clear is TQ's: a lookup, then the
clearing mark, the storage clear by index and the release, each its own request
(`async_clear_samples`), so a test can step in between them (`on`), as a process frozen there would
let other clients do. It counts round trips (a synchronous call, or one coroutine run on its loop),
lookups, the requests of the KV API by kind (`calls`) and the rows storage read (`rows_read`). A
test can hold its puts at the controller (`hold_puts`), as a controller that stopped answering
would, and see whether the abandoned put was cancelled there.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable

import torch
from tensordict import TensorDict


class FakeMeta:
    """TQ's BatchMeta as far as `TQStore` reads it."""

    def __init__(self, indexes: list[int], partitions: list[str], tags: list[dict], fields: list[str], ready):
        self.global_indexes, self.partition_ids, self.custom_meta, self.field_names = indexes, partitions, tags, fields
        self.production_status = [1 if r else 0 for r in ready]
        self.size = len(indexes)

    @property
    def is_ready(self) -> bool:
        return all(self.production_status)

    def select_fields(self, names: list[str]) -> FakeMeta:
        return FakeMeta(
            self.global_indexes,
            self.partition_ids,
            self.custom_meta,
            [f for f in self.field_names if f in names],
            self.production_status,
        )

    def select_samples(self, positions: list[int]) -> FakeMeta:
        return FakeMeta(
            [self.global_indexes[i] for i in positions],
            [self.partition_ids[i] for i in positions],
            [self.custom_meta[i] for i in positions],
            self.field_names,
            [self.production_status[i] for i in positions],
        )


class _Storage:
    """The storage units: rows by global index, whatever partition or key they were put for."""

    def __init__(self, tq: FakeTQ):
        self._tq = tq

    async def clear_data(self, metadata) -> None:
        self._tq._at("storage_clear", metadata)
        for i in metadata.global_indexes:
            self._tq.rows.pop(i, None)


class FakeTQ:
    """TQ's module and client in one: a controller and storage, locations of cleared rows reused first."""

    class StorageKeyNotFoundError(KeyError):
        pass

    def __init__(self):
        self.where: dict[tuple[str, str], int] = {}  # controller: (partition, key) -> global index
        self.owner: dict[int, tuple[str, str]] = {}  # controller: global index -> (partition, key)
        self.tags: dict[int, dict] = {}
        self.ready: dict[int, list[str]] = {}  # controller: fields produced per index; [] while being cleared
        self.rows: dict[int, dict[str, torch.Tensor]] = {}  # storage: global index -> fields
        self.free: list[int] = []
        self._next = 0
        self.storage_manager = _Storage(self)
        self.round_trips = self.lookups = 0
        # Requests served, by kind ("meta", "keys", "get"), and rows storage read.
        self.calls: Counter[str] = Counter()
        self.rows_read = 0
        # While set, a put waits at its controller request for this long (seconds) before going on.
        self.hold_puts: float | None = None
        self.puts_cancelled = 0
        self._hooks: dict[str, Callable] = {}

    def on(self, point: str, hook: Callable, *, once: bool = True) -> None:
        """Call `hook(meta)` when a request reaches `point`, before TQ serves it: "mark", "storage_clear",
        "release" (the three requests of a clear), "keys" (after a keys-by-index lookup is answered),
        "read" (a storage get), "put_located" (a put's indexes given, its rows not yet written). The
        hook runs on a thread of its own while the request waits, as another client of TQ would."""

        def fire(meta):
            if once:
                self._hooks.pop(point, None)
            # On a thread of its own, as another client: this request waits meanwhile.
            failed: list[BaseException] = []
            t = threading.Thread(target=lambda: _catch(failed, hook, meta), name=f"fake-tq-{point}")
            t.start()
            t.join()
            if failed:
                raise failed[0]

        self._hooks[point] = fire

    def _at(self, point: str, meta) -> None:
        hook = self._hooks.get(point)
        if hook is not None:
            hook(meta)

    def get_client(self):
        return self

    def stale_clear(self, partition: str, key: str, *, looked_up_in: str) -> None:
        """What a clear whose lookup went stale does to `key`'s row: TQ's clear steps by `key`'s index,
        sent for a key of partition `looked_up_in` that held the index before it was cleared and
        handed to `key`. Storage deletes the index; the controller, named another partition, keeps
        `key` mapped and ready."""
        assert looked_up_in != partition, "a stale lookup of another partition"
        stale = FakeMeta([self.where[partition, key]], [looked_up_in], [{}], [], [True])
        _drive(self.async_clear_samples(stale))

    # ----- the controller ---------------------------------------------------------------------

    def _allocate(self, partition_id: str, key: str) -> int:
        if (partition_id, key) not in self.where:
            at = self.free.pop(0) if self.free else self._take_new()
            self.where[partition_id, key], self.owner[at] = at, (partition_id, key)
            self.ready[at] = []
        return self.where[partition_id, key]

    def _take_new(self) -> int:
        self._next += 1
        return self._next - 1

    def _meta(self, keys, partition_id) -> FakeMeta:
        self.lookups += 1
        at = [self.where[partition_id, k] for k in keys if (partition_id, k) in self.where]
        produced = [set(self.ready[i]) for i in at]
        # As TQ: the fields every requested row has; a row without them (being cleared) is not ready.
        fields = sorted(set.intersection(*produced)) if produced else []
        return FakeMeta(
            at, [partition_id] * len(at), [self.tags.get(i, {}) for i in at], fields, [bool(p) for p in produced]
        )

    async def async_kv_retrieve_meta(self, keys, partition_id, create=False):
        self.calls["meta"] += 1
        if create:
            for k in keys:
                self._allocate(partition_id, k)
        return self._meta(keys, partition_id)

    def kv_retrieve_meta(self, keys, partition_id, create=False):
        self.round_trips += 1
        return _drive(self.async_kv_retrieve_meta(keys, partition_id, create))

    async def async_kv_retrieve_keys(self, global_indexes, partition_id):
        self.calls["keys"] += 1
        keys = [self.owner[i][1] if self.owner.get(i, ("",))[0] == partition_id else None for i in global_indexes]
        self._at("keys", keys)
        return keys

    async def _mark_clearing_in_controller(self, metadata):
        self._at("mark", metadata)
        for i, p in zip(metadata.global_indexes, metadata.partition_ids, strict=True):
            if self.owner.get(i, ("",))[0] == p:  # as TQ: an index not in the named partition is ignored
                self.ready[i] = []

    async def _clear_meta_in_controller(self, metadata):
        self._at("release", metadata)
        for i, p in zip(metadata.global_indexes, metadata.partition_ids, strict=True):
            if self.owner.get(i, ("",))[0] == p:
                del self.where[self.owner.pop(i)]
                self.tags.pop(i, None)
                self.ready.pop(i, None)
                self.free.append(i)

    async def async_clear_samples(self, metadata):
        await self._mark_clearing_in_controller(metadata)
        await self.storage_manager.clear_data(metadata)
        await self._clear_meta_in_controller(metadata)

    async def async_kv_clear(self, keys, partition_id):
        # transfer_queue.interface.async_kv_clear: a lookup, then a clear by the indexes it found.
        meta = await self.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
        if meta.size > 0:
            await self.async_clear_samples(meta)

    def kv_clear(self, keys, partition_id):
        _drive(self.async_kv_clear(keys, partition_id))

    def kv_list(self, partition_id):
        return {partition_id: {k: self.tags.get(at, {}) for (p, k), at in self.where.items() if p == partition_id}}

    async def async_kv_list(self, partition_id):
        self.calls["list"] += 1
        return self.kv_list(partition_id)

    # ----- puts and gets ----------------------------------------------------------------------

    async def async_kv_batch_put(self, keys, partition_id, fields, tags):
        if self.hold_puts is not None:
            try:
                await asyncio.sleep(self.hold_puts)  # the controller's answer to the index lookup
            except asyncio.CancelledError:
                self.puts_cancelled += 1
                raise
        self._put(keys, partition_id, fields, tags)

    def kv_batch_put(self, keys, partition_id, fields, tags):
        self._put(keys, partition_id, fields, tags)

    def _put(self, keys, partition_id, fields, tags):
        at = [self._allocate(partition_id, k) for k in keys]
        self._at("put_located", at)
        names = list(fields.keys())
        for i, (key, index) in enumerate(zip(keys, at, strict=True)):
            self.rows[index] = {n: fields.get(n)[i] for n in names}  # storage writes where it was told
            if self.owner.get(index) == (partition_id, key):  # the controller marks only its own key's row
                self.ready[index] = names
                self.tags[index] = dict(tags[i])

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        self.round_trips += 1
        meta = self._meta(keys, partition_id)
        return self._data(meta if select_fields is None else meta.select_fields(select_fields))

    def _data(self, meta: FakeMeta) -> TensorDict:
        if any(i not in self.rows for i in meta.global_indexes):
            raise self.StorageKeyNotFoundError("gone")
        out = {}
        for f in meta.field_names:
            rows = [self.rows[i][f] for i in meta.global_indexes]
            # As TQ's get: 0-dim rows stacked, others rebuilt as a jagged nested tensor.
            dense = all(r.dim() == 0 for r in rows)
            out[f] = torch.stack(rows) if dense else torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        return TensorDict(out, batch_size=[meta.size])

    def get_data(self, metadata):
        self.round_trips += 1
        return self._data(metadata)

    async def async_get_data(self, metadata):
        self.calls["get"] += 1
        self._at("read", metadata)
        data = self._data(metadata)
        self.rows_read += metadata.size
        return data

    def _run_coroutine(self, coro):
        self.round_trips += 1
        return asyncio.run(coro)


def _drive(coro):
    """Run a coroutine of the fake that never waits (a synchronous TQ call), also from inside a running loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a synchronous fake TQ call waited")


def _catch(failed: list, hook, meta) -> None:
    try:
        hook(meta)
    except BaseException as exc:  # noqa: BLE001 - re-raised on the thread that waited
        failed.append(exc)
