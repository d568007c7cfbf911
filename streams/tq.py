"""TransferQueue on Ray: starting or attaching to it, and a small KV client for the staging and train partitions.

`KVStore` is the narrow interface the workers use; `TQStore` implements it over TQ's KV API (unit
tests of pure logic use a dict-backed store of the same interface, in tests/unit).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import psutil
from tensordict import TensorDict

from schemas.errors import RlstreamError
from streams.pids import record_pid

# Prefixed, so rlstream's rows never share a partition with a framework's own "train" (verl's, ...).
STAGING = "rlstream.staging"
TRAIN = "rlstream.train"


class TQError(RlstreamError, RuntimeError):
    """Ray or TQ could not be reached or started; the message says where."""


class MissingKeysError(RlstreamError, KeyError):
    """Some requested keys are not in the partition; `missing` lists them."""

    def __init__(self, partition: str, missing: Sequence[str]):
        self.partition = partition
        self.missing = list(missing)
        super().__init__(
            f"{len(self.missing)} key(s) missing from TQ partition {partition!r}: "
            f"{', '.join(self.missing[:5])}{' ...' if len(self.missing) > 5 else ''}"
        )


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


@dataclass(frozen=True)
class TQConfig:
    """How to reach Ray and size TQ; address None starts a local Ray instance unless one is running."""

    address: str | None = None
    num_storage_units: int = 2
    # TQ's controller and each storage unit ask Ray for one CPU, and reassembler actors one each;
    # logical CPUs above the physical count only oversubscribe cores that mostly wait on I/O.
    num_cpus: int = 16
    namespace: str = "rlstream"
    # TQ pins its storage units round-robin over the alive Ray nodes (sorted by node id) that offer
    # this custom resource; None: every alive node, so N units on k nodes put N/k on each.
    storage_node_resource: str | None = None
    # The longest one storage-unit request (put, get, clear) of this process may take, all of its
    # attempts together; None keeps TQ's own (200 s, three times). A reassembler bounds it so that a
    # put it was allowed to start lands while it still owns its partitions (reassembler/lease.py).
    call_budget_s: float | None = None


def _tq_threads() -> str:
    # TQ sizes its tensor-aggregation thread pool from TQ_NUM_THREADS (default 8) and warns on
    # every call when that exceeds the physical cores; set it once, for us and for Ray actors.
    return str(max(1, min(8, psutil.cpu_count(logical=False) or 1)))


class TQSession:
    """Ray and TQ as started or attached by `init_tq`; `close` stops only what this process started."""

    def __init__(self, started_ray: bool, started_tq: bool):
        self.started_ray = started_ray
        self.started_tq = started_tq

    def close(self) -> None:
        import ray
        import transfer_queue as tq

        if self.started_tq:
            tq.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


# Attempts of one storage-unit request when its budget is bounded: one retry on a fresh connection.
BOUNDED_ATTEMPTS = 2


def bound_tq_calls(budget_s: float) -> None:
    """Make every storage-unit request of this process give up within `budget_s`, retries included.

    TQ reads these when its client is created, so this must run before `init_tq` in that process.
    """
    if budget_s <= 0:
        raise ValueError(f"a TQ call budget must be positive, got {budget_s}")
    os.environ["TQ_SIMPLE_STORAGE_MAX_ATTEMPTS"] = str(BOUNDED_ATTEMPTS)
    os.environ["TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT"] = str(max(1, int(budget_s / BOUNDED_ATTEMPTS)))


def init_tq(config: TQConfig = TQConfig()) -> TQSession:
    """Start or attach to Ray, then create or attach to the TQ controller and its storage units."""
    os.environ.setdefault("TQ_NUM_THREADS", _tq_threads())
    if config.call_budget_s is not None:
        bound_tq_calls(config.call_budget_s)
    import ray

    started_ray = False
    if not ray.is_initialized():
        env = {"env_vars": {"TQ_NUM_THREADS": os.environ["TQ_NUM_THREADS"]}}
        if config.address is not None:
            _attach(ray, config, env)
        else:
            ray.init(
                num_cpus=config.num_cpus,
                include_dashboard=False,
                namespace=config.namespace,
                runtime_env=env,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            started_ray = True
            _record_ray_pids()
    import transfer_queue as tq
    from transfer_queue import interface

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)
    had_controller = _controller_exists()
    storage = {"num_data_storage_units": config.num_storage_units}
    if config.storage_node_resource is not None:
        if not had_controller:
            # Before TQ creates its controller: a controller left without storage hangs every attach.
            nodes_offering(config.storage_node_resource)
        storage["required_node_resource"] = config.storage_node_resource
    tq.init({"backend": {"SimpleStorage": storage}})
    return TQSession(started_ray, started_tq=not had_controller and interface._TQ_STORAGE is not None)


def _attach(ray, config: TQConfig, env: dict) -> None:
    try:
        ray.init(
            address=config.address,
            namespace=config.namespace,
            runtime_env=env,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except ConnectionError as exc:
        raise TQError(f"cannot reach Ray at {config.address!r}: {str(exc).splitlines()[0]}") from None


def _record_ray_pids() -> None:
    # Ray's own daemons (GCS, raylet, log monitor, ...) of the instance this process just started.
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            pid = getattr(getattr(info, "process", None), "pid", None)
            if pid:
                record_pid("ray", pid)


def _controller_exists() -> bool:
    import ray

    try:
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
        return True
    except ValueError:
        return False


def nodes_offering(resource: str) -> list[str]:
    """Ids of the alive Ray nodes that offer custom `resource`; TQError if none does (Ray must be attached)."""
    import ray

    found = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0)
    if not found:
        raise TQError(
            f"no alive Ray node offers custom resource {resource!r}: start the nodes meant to host it with "
            f"ray start --resources '{{\"{resource}\": 1}}'"
        )
    return found


def ray_address() -> str:
    """The address another process uses to attach to the running Ray instance."""
    import ray

    return ray.get_runtime_context().gcs_address


# Row lookups `TQStore.tags` keeps for a `get` of the same keys; a trainer has a batch or two in flight.
_LOCATED_BATCHES = 32


class TQStore:
    """KVStore over TQ's module-level KV API (the process must have called `init_tq`).

    TQ finds rows by a metadata call to its controller (keys -> storage locations), then fetches
    them from the storage units. `tags` keeps the locations of the keys it found all present, so a
    `get` of exactly those keys (a trainer's select, then materialize) sends its check of them
    alongside the data instead of before it: one round trip instead of two.
    """

    def __init__(self) -> None:
        import transfer_queue as tq

        self._tq = tq
        self._located: OrderedDict[tuple[str, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, partition: str, keys: Sequence[str], fields: TensorDict, tags: Sequence[Mapping[str, Any]]) -> None:
        if not keys:
            return
        self._tq.kv_batch_put(keys=list(keys), partition_id=partition, fields=fields, tags=[dict(t) for t in tags])

    def get(self, partition: str, keys: Sequence[str], select: Sequence[str] | None = None) -> TensorDict:
        """Rows in the order of `keys`; raises MissingKeysError naming absent keys instead of returning fewer rows."""
        keys = list(keys)
        if not keys:
            raise ValueError("get needs at least one key")
        client = self._tq.get_client()
        with self._lock:
            located = self._located.get((partition, tuple(keys)))
        if located is not None:
            data = client._run_coroutine(self._fetch_located(client, partition, keys, located, select))
            if data is not None:
                return data
            self._forget(partition, keys)
        # Both calls in one coroutine on TQ's loop, as its own kv_batch_get: one thread hop, not two.
        data = client._run_coroutine(self._look_up_and_fetch(client, partition, keys, select))
        if data is None:
            raise MissingKeysError(partition, self._missing(partition, keys))
        return data

    async def _look_up_and_fetch(self, client, partition: str, keys: list[str], select: Sequence[str] | None):
        """The rows, or None if some key is absent (or cleared between the lookup and the fetch, which TQ allows)."""
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if meta.size != len(keys):
            return None
        try:
            return await client.async_get_data(_fields(meta, select, partition, keys))
        except self._tq.StorageKeyNotFoundError:
            return None

    async def _fetch_located(self, client, partition: str, keys: list[str], located: Any, select):
        """The rows by the locations `tags` found, checked by a lookup sent alongside; None: look them up again.

        A lookup still naming the same locations means the rows read are those keys' rows: TQ reuses
        the locations of cleared rows for the next rows put, so data fetched by stale locations
        could be other rows, and is never returned.
        """
        fresh, data = await asyncio.gather(
            client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False),
            client.async_get_data(_fields(located, select, partition, keys)),
            return_exceptions=True,
        )
        if isinstance(fresh, BaseException):
            raise fresh
        if isinstance(data, self._tq.StorageKeyNotFoundError):
            return None
        if isinstance(data, BaseException):
            raise data
        return data if fresh.size == len(keys) and fresh.global_indexes == located.global_indexes else None

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
        return dict(self._tq.kv_list(partition_id=partition).get(partition, {}))

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        # One metadata call when every key is present (the common case); the tags are its custom meta.
        meta = self._tq.get_client().kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if meta.size == len(keys):
            self._remember(partition, keys, meta)
            # The tags as TQ sent them, copied per key (get_all_custom_meta deep-copies: ~6 ms for 64 rows).
            return {k: dict(t) for k, t in zip(keys, meta.custom_meta)}
        listed = self.list(partition)
        return {k: dict(listed[k]) for k in keys if k in listed}

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        if keys:
            self._forget(partition, keys)
            self._tq.kv_clear(keys=list(keys), partition_id=partition)


def _fields(meta: Any, select: Sequence[str] | None, partition: str, keys: Sequence[str]) -> Any:
    """TQ metadata cut to the `select`ed fields (None: all), checked ready as TQ's own get does.

    A row not ready is one being cleared (TQ marks it before it deletes it): to the caller it is
    as good as gone, so it is reported missing, which every caller handles, rather than as an error.
    """
    if select is not None:
        meta = meta.select_fields(list(select))
    if not meta.is_ready:
        status = np.asarray(meta.production_status)
        ready = status.reshape(len(keys), -1).min(axis=1) == 1 if status.size else np.zeros(len(keys), bool)
        raise MissingKeysError(partition, [k for k, ok in zip(keys, ready) if not ok] or list(keys))
    return meta
