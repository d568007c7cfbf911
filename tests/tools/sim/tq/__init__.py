"""A model of TransferQueue 0.1.11 at the level `streams.tq.TQStore` calls it, deterministic and in memory.

`SimTQ(env)` is one TQ (a controller and its storage units, shared by a job's processes);
`tq.module(name)` is what one process imports as `transfer_queue`: `async_kv_batch_put`,
`async_kv_list`, `async_kv_clear`, `async_kv_batch_get`, `get_client()` (whose client has
`async_kv_retrieve_meta`, `async_kv_retrieve_keys`, `async_get_data`, `async_put`, `async_set_custom_meta`,
`async_clear_samples`, `_mark_clearing_in_controller`, `_clear_meta_in_controller`,
`storage_manager.put_data/get_data/clear_data`, `_run_coroutine`), `StorageKeyNotFoundError` and
`StorageUnitTimeout`. Each operation is the same sequence of requests TQ makes, each a `Request`
the environment lands when it decides, with points between them.

Claimed behaviours (each held to the real TQ by tests/integration/sim/test_tq_differential.py):

- T1 Global indexes: one pool for every partition. A new partition takes one index (pre-allocated,
  for its first key); keys get indexes from released ones first, in the order they were released
  (FIFO), then from a counter. A key put again keeps its index.
- T2 A put is four requests: index lookup/allocation (`kv_retrieve_meta(create=True)`), the storage
  write by global index, the controller marking the fields produced (`notify_data_update`), then
  the tags (`set_custom_meta`). Tags of a key put again are merged into its old ones. Between them a
  reader sees each phase as TQ's shows it: after the allocation the keys are listed with no tags and
  nothing reads (a lookup has no fields, `kv_batch_get` refuses); after the write and notice the rows
  read, still with no tags (a key put again: its old tags, its new values); then the tags. A put whose
  keys were cleared between its allocation and its write writes and tags the index given back, and
  the next key to take it reads that row and those tags as its own until its own put lands.
- T3 Lookups (`kv_retrieve_meta(create=False)`): the keys found, in the order asked (absent keys
  left out; an unknown partition gives an empty meta); `field_names` the fields every row found
  produced; `production_status` per row; `is_ready`; `custom_meta` per row.
- T4 A clear (`kv_clear`) is a lookup, then `_mark_clearing_in_controller` (rows not ready),
  `storage_manager.clear_data` (deletes by global index in every partition), then
  `_clear_meta_in_controller` (drops the keys and releases the indexes, ignoring indexes the named
  partition does not hold). A clear whose lookup went stale (the index changed hands) deletes the
  new owner's data while its controller entry stays ready, and releases nothing.
- T5 Gets: by meta, the rows in order; an index whose data is gone raises `StorageKeyNotFoundError`;
  a meta with no fields returns an empty batch; a marked (clearing) row is not ready.
- T6 Lists: `kv_list(partition)` names every key the controller maps, with its tags (`{}` while a
  put has allocated its index and not yet set its tags); an unknown partition is left out.
- T7 A request whose caller gave up (a deadline) still lands when the environment lands it: a put
  given up after its allocation leaves its key listed, with no data, until it lands.
- T8 Reverse lookups (`async_kv_retrieve_keys`): the key each index holds in the partition now, in
  the order asked, None for an index the partition does not hold (TQ's check for that is of the
  wrong list); an unknown partition raises RuntimeError, as every controller failure does.
  `BatchMeta.select_samples` keeps the rows at the positions given.

Not modelled (nothing in rlstream calls it): consumption status, samplers, get_meta's insert and
fetch modes, checkpoints, capacity limits, data parsers, per-sample shapes and dtype conflicts.
`lose_everything()` is a whole-job loss: every partition, row and index gone (the counter starts
again at 0), every client of the job dead (its calls and its requests in flight fail).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from tensordict import TensorDict

from tests.tools.sim.env import Environment
from tests.tools.sim.tq.client import JobLost, TQClient
from tests.tools.sim.tq.controller import Controller
from tests.tools.sim.tq.meta import BatchMeta
from tests.tools.sim.tq.storage import StorageKeyNotFoundError, StorageUnit, StorageUnitTimeout

__all__ = ["BatchMeta", "JobLost", "SimTQ", "StorageKeyNotFoundError", "StorageUnitTimeout", "TQClient", "TQModule"]

# TQ's own: TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT and TQ_SIMPLE_STORAGE_MAX_ATTEMPTS.
UNIT_TIMEOUT_S = 200.0
UNIT_ATTEMPTS = 3


class SimTQ:
    """One TQ: a controller and `units` storage units; `first_index` is where its index counter starts."""

    def __init__(self, env: Environment, *, units: int = 1, first_index: int = 0):
        if units < 1:
            raise ValueError(f"TQ needs at least one storage unit, got {units}")
        self.env = env
        self.lock = threading.RLock()
        self.unit_timeout_s = UNIT_TIMEOUT_S
        self.unit_attempts = UNIT_ATTEMPTS
        self.epoch = 0
        self._n_units = units
        self._names = itertools.count()
        self.controller = Controller(first_index)
        self.units = [StorageUnit(f"unit{i}") for i in range(units)]

    def bound_calls(self, budget_s: float, attempts: int = 2) -> None:
        """`streams.tq_setup.bound_tq_calls`: each unit request within `budget_s`, retries included."""
        self.unit_attempts = attempts
        self.unit_timeout_s = max(1, int(budget_s / attempts))

    def module(self, name: str | None = None) -> TQModule:
        """What one process imports as `transfer_queue`, with a client of its own."""
        return TQModule(self, name if name is not None else f"client{next(self._names)}")

    def lose_everything(self) -> None:
        """The whole job died: TQ comes back empty, and nothing of the old job's clients lands."""
        self.epoch += 1
        self.controller = Controller(0)
        self.units = [StorageUnit(f"unit{i}") for i in range(self._n_units)]

    def data_indexes(self) -> set[int]:
        """The global indexes some storage unit holds data for (what a test compares)."""
        return {i for u in self.units for i in u.indexes()}


class TQModule:
    """The `transfer_queue` module as one process sees it: the KV API, `get_client`, the error classes."""

    StorageKeyNotFoundError = StorageKeyNotFoundError
    StorageUnitTimeout = StorageUnitTimeout

    def __init__(self, tq: SimTQ, client_id: str):
        self.tq = tq
        self._client = TQClient(tq, client_id)

    def get_client(self) -> TQClient:
        return self._client

    async def _op(self, name: str, body, **details: Any) -> Any:
        env = self.tq.env
        env.point(f"tq.{name}.begin", client=self._client.client_id, **details)
        result = await body()
        env.point(f"tq.{name}.end", client=self._client.client_id, **details)
        return result

    async def async_kv_batch_put(
        self,
        keys: list[str],
        partition_id: str,
        fields: TensorDict | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> BatchMeta:
        if fields is None and tags is None:
            raise ValueError("Please provide at least one parameter of `fields` or `tags`.")
        if fields is not None and fields.batch_size[0] != len(keys):
            raise ValueError(
                f"`keys` with length {len(keys)} does not match the `fields` TensorDict with "
                f"batch_size {fields.batch_size[0]}"
            )
        client = self._client

        async def body() -> BatchMeta:
            meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=True)
            if meta.size != len(keys):
                raise RuntimeError(
                    f"Retrieved BatchMeta size {meta.size} does not match with input `keys` size {len(keys)}!"
                )
            if tags is not None:
                if len(tags) != len(keys):
                    raise ValueError(f"keys with length {len(keys)} does not match length of tags {len(tags)}")
                meta.update_custom_meta(tags)
            if fields is not None:
                meta = await client.async_put(fields, meta)
            else:
                await client.async_set_custom_meta(meta)
            return meta

        return await self._op("kv_batch_put", body, partition=partition_id, keys=list(keys))

    async def async_kv_batch_get(
        self, keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
    ) -> TensorDict:
        client = self._client

        async def body() -> TensorDict:
            meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
            if meta.size == 0:
                raise ValueError("keys or partition were not found!")
            if select_fields is not None:
                meta = meta.select_fields([select_fields] if isinstance(select_fields, str) else list(select_fields))
            if not meta.is_ready:
                raise ValueError("Some fields are not ready in all the requested keys!")
            return await client.async_get_data(meta)

        return await self._op("kv_batch_get", body, partition=partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        return await self._op("kv_list", lambda: self._client.async_kv_list(partition_id), partition=partition_id)

    async def async_kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys)
        client = self._client

        async def body() -> None:
            meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition_id, create=False)
            if meta.size > 0:
                await client.async_clear_samples(meta)

        return await self._op("kv_clear", body, partition=partition_id, keys=keys)

    # The synchronous faces, on the client's `_run_coroutine` as TQ's are.
    def kv_batch_put(self, keys, partition_id, fields=None, tags=None) -> BatchMeta:
        return self._client._run_coroutine(self.async_kv_batch_put(keys, partition_id, fields, tags))

    def kv_batch_get(self, keys, partition_id, select_fields=None) -> TensorDict:
        return self._client._run_coroutine(self.async_kv_batch_get(keys, partition_id, select_fields))

    def kv_list(self, partition_id=None) -> dict[str, dict[str, dict[str, Any]]]:
        return self._client._run_coroutine(self.async_kv_list(partition_id))

    def kv_clear(self, keys, partition_id) -> None:
        return self._client._run_coroutine(self.async_kv_clear(keys, partition_id))
