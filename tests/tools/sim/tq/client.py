"""TQ 0.1.11's client (`TransferQueueClient`), the methods `streams.tq.TQStore` and a guarded clear call.

Every controller and storage-unit request is a `Request` the environment lands (now, later, never),
with points `<request>.send` before it goes and `<request>.reply` once its answer is in. Controller
requests have no timeout (as TQ's); unit requests follow `StorageManager`'s. A request sent before a
whole-job loss that lands after it does nothing and fails: its process is gone with the job.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tensordict import TensorDict

from tests.tools.sim import aio
from tests.tools.sim.env import Request
from tests.tools.sim.tq.controller import Controller
from tests.tools.sim.tq.meta import BatchMeta
from tests.tools.sim.tq.storage import StorageManager

if TYPE_CHECKING:
    from tests.tools.sim.tq import SimTQ

T = TypeVar("T")


class JobLost(RuntimeError):
    """TQ died with the job: this client's controller and storage units are gone."""


class TQClient:
    """One process's TQ client: the low-level API over the controller and the storage units."""

    def __init__(self, tq: SimTQ, client_id: str):
        self.tq = tq
        self.client_id = client_id
        self.storage_manager = StorageManager(self)
        self._epoch = tq.epoch

    # ----- requests ------------------------------------------------------------------------------

    def request(self, name: str, apply: Callable[[], Any], **details: Any) -> Request:
        """A request to send: its `send` point first; it applies nothing if the job was lost meanwhile."""
        epoch, tq = self._epoch, self.tq
        if tq.epoch != epoch:
            raise JobLost(f"[{self.client_id}]: TQ is gone (the job was lost)")
        tq.env.point(f"{name}.send", client=self.client_id, **details)

        def apply_if_alive() -> Any:
            with tq.lock:  # a server serves one request at a time
                if tq.epoch != epoch:
                    raise JobLost(f"[{self.client_id}]: {name} landed after the job was lost; nothing applied")
                return apply()

        return Request(name, apply_if_alive, client=self.client_id, **details)

    async def controller_request(self, op: str, apply: Callable[[Controller], Any], **details: Any) -> Any:
        request = self.request(f"tq.controller.{op}", lambda: apply(self.tq.controller), **details)
        try:
            result = await aio.reply(self.tq.env, request)
        except JobLost:
            raise
        except Exception as exc:  # the controller answered with an error
            raise RuntimeError(f"[{self.client_id}]: controller {op} failed: {exc}") from exc
        self.tq.env.point(f"tq.controller.{op}.reply", client=self.client_id, **details)
        return result

    def _run_coroutine(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to its end (on the calling thread, in the environment's time)."""
        return aio.run(self.tq.env, coro)

    # ----- the KV side ---------------------------------------------------------------------------

    async def async_kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        if isinstance(keys, str):
            keys = [keys]
        elif isinstance(keys, list):
            if not keys:
                raise ValueError("Received an empty list as keys.")
            if not all(isinstance(k, str) for k in keys):
                raise TypeError("Not all elements in `keys` are strings.")
        else:
            raise TypeError("Only string or list of strings are allowed as `keys`.")
        keys = list(keys)
        return await self.controller_request(
            "kv_retrieve_meta",
            lambda c: c.kv_retrieve_meta(keys, partition_id, create),
            partition=partition_id,
            keys=keys,
            create=create,
        )

    async def async_kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str | None]:
        if isinstance(global_indexes, int):
            global_indexes = [global_indexes]
        elif isinstance(global_indexes, list):
            if not global_indexes:
                raise ValueError("Received an empty list as `global_indexes`.")
            if not all(isinstance(i, int) for i in global_indexes):
                raise TypeError("Not all elements in `global_indexes` are int.")
        else:
            raise TypeError("Only int or list of int are allowed as `global_indexes`.")
        indexes = list(global_indexes)
        keys = await self.controller_request(
            "kv_retrieve_keys", lambda c: c.kv_retrieve_keys(indexes, partition_id), partition=partition_id
        )
        if len(keys) != len(indexes):  # TQ's client wraps this one like every controller failure
            raise RuntimeError(
                f"[{self.client_id}]: Error in kv_retrieve_indexes: Some global_indexes have no corresponding keys!"
            )
        return keys

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        return await self.controller_request("kv_list", lambda c: c.kv_list(partition_id), partition=partition_id)

    # ----- data ------------------------------------------------------------------------------------

    async def async_put(self, data: TensorDict, metadata: BatchMeta) -> BatchMeta:
        if metadata is None:
            raise NotImplementedError("the model's put needs the metadata of a kv_retrieve_meta (no insert mode)")
        if metadata.size == 0:
            raise ValueError("metadata cannot be none or empty")
        await self.storage_manager.put_data(data, metadata)
        await self.async_set_custom_meta(metadata)
        return metadata.add_fields(data)

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        if not metadata or metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=0)
        return await self.storage_manager.get_data(metadata)

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        tags = metadata.get_all_custom_meta()
        if not metadata.global_indexes or not tags:
            return
        by_partition: dict[str, dict[int, dict[str, Any]]] = {pid: {} for pid in set(metadata.partition_ids)}
        for gi, pid, t in zip(metadata.global_indexes, metadata.partition_ids, tags):
            by_partition[pid][gi] = t
        await self.controller_request(
            "set_custom_meta",
            lambda c: c.set_custom_meta(by_partition),
            partitions=sorted(by_partition),
            indexes=list(metadata.global_indexes),
        )

    # ----- clearing, step by step ------------------------------------------------------------------

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        """Mark the rows clearing, delete them from storage by index, then release their indexes."""
        try:
            if metadata.size == 0:
                return
            await self._mark_clearing_in_controller(metadata)
            await self.storage_manager.clear_data(metadata)
            await self._clear_meta_in_controller(metadata)
        except JobLost:
            raise
        except Exception as exc:
            raise RuntimeError(f"Error in clear_samples operation: {exc}") from exc

    async def _mark_clearing_in_controller(self, metadata: BatchMeta, socket=None) -> None:
        indexes, pids = list(metadata.global_indexes), list(metadata.partition_ids)
        await self.controller_request(
            "mark_clearing", lambda c: c.mark_clearing(indexes, pids), partitions=sorted(set(pids)), indexes=indexes
        )

    async def _clear_meta_in_controller(self, metadata: BatchMeta, socket=None) -> None:
        indexes, pids = list(metadata.global_indexes), list(metadata.partition_ids)
        await self.controller_request(
            "clear_meta", lambda c: c.clear_meta(indexes, pids), partitions=sorted(set(pids)), indexes=indexes
        )
