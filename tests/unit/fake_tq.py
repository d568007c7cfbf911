"""A fake of TransferQueue's module and client for unit tests of `TQStore` (no Ray, no TQ processes).

It keeps rows by location and, as TQ does, gives the locations of cleared rows to the next rows put,
so a stale location returns another key's row. It counts round trips (a synchronous call, or one
coroutine run on its loop) and lookups. A test can hold its puts at the controller (`hold_puts`), as a
controller that stopped answering would, and see whether the abandoned put was cancelled there.
"""

from __future__ import annotations

import asyncio

import torch
from tensordict import TensorDict


class FakeMeta:
    def __init__(self, indexes: list[int], tags: list[dict], fields: list[str]):
        self.global_indexes, self.custom_meta, self.field_names = indexes, tags, fields
        self.size, self.is_ready = len(indexes), True

    def select_fields(self, names: list[str]) -> FakeMeta:
        return FakeMeta(self.global_indexes, self.custom_meta, [f for f in self.field_names if f in names])


class FakeTQ:
    """TQ's module and client in one: rows by location, locations of cleared rows reused first."""

    class StorageKeyNotFoundError(KeyError):
        pass

    def __init__(self):
        self.where: dict[tuple[str, str], int] = {}
        self.rows: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
        self.free: list[int] = []
        self.round_trips = self.lookups = 0
        # While set, a put waits at its controller request for this long (seconds) before going on.
        self.hold_puts: float | None = None
        self.puts_cancelled = 0

    def get_client(self):
        return self

    def kv_batch_put(self, keys, partition_id, fields, tags):
        for i, key in enumerate(keys):
            if (partition_id, key) not in self.where:
                self.where[partition_id, key] = self.free.pop(0) if self.free else len(self.rows) + len(self.free)
            self.rows[self.where[partition_id, key]] = ({n: fields.get(n)[i] for n in fields.keys()}, tags[i])  # noqa: SIM118

    async def async_kv_batch_put(self, keys, partition_id, fields, tags):
        if self.hold_puts is not None:
            try:
                await asyncio.sleep(self.hold_puts)  # the controller's answer to the index lookup
            except asyncio.CancelledError:
                self.puts_cancelled += 1
                raise
        self.kv_batch_put(keys, partition_id, fields, tags)

    def kv_clear(self, keys, partition_id):
        for key in keys:
            if (at := self.where.pop((partition_id, key), None)) is not None:
                del self.rows[at]
                self.free.append(at)

    async def async_kv_clear(self, keys, partition_id):
        self.kv_clear(keys, partition_id)

    def kv_list(self, partition_id):
        return {partition_id: {k: self.rows[at][1] for (p, k), at in self.where.items() if p == partition_id}}

    async def async_kv_list(self, partition_id):
        return self.kv_list(partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        self.round_trips += 1
        meta = self._meta(keys, partition_id)
        return self._data(meta if select_fields is None else meta.select_fields(select_fields))

    def _meta(self, keys, partition_id) -> FakeMeta:
        self.lookups += 1
        at = [self.where[partition_id, k] for k in keys if (partition_id, k) in self.where]
        fields = sorted(self.rows[at[0]][0]) if at else []
        return FakeMeta(at, [self.rows[i][1] for i in at], fields)

    def _data(self, meta: FakeMeta) -> TensorDict:
        if any(i not in self.rows for i in meta.global_indexes):
            raise self.StorageKeyNotFoundError("gone")
        out = {}
        for f in meta.field_names:
            rows = [self.rows[i][0][f] for i in meta.global_indexes]
            # As TQ's get: 0-dim rows stacked, others rebuilt as a jagged nested tensor.
            dense = all(r.dim() == 0 for r in rows)
            out[f] = torch.stack(rows) if dense else torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        return TensorDict(out, batch_size=[meta.size])

    def kv_retrieve_meta(self, keys, partition_id, create=False):
        self.round_trips += 1
        return self._meta(keys, partition_id)

    def get_data(self, metadata):
        self.round_trips += 1
        return self._data(metadata)

    async def async_kv_retrieve_meta(self, keys, partition_id, create=False):
        return self._meta(keys, partition_id)

    async def async_get_data(self, metadata):
        return self._data(metadata)

    def _run_coroutine(self, coro):
        self.round_trips += 1
        return asyncio.run(coro)
