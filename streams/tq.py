"""TransferQueue on Ray: starting or attaching to it, and a small KV client for the staging and train partitions.

`KVStore` is the narrow interface the workers use; `TQStore` implements it over TQ's KV API (unit
tests of pure logic use a dict-backed store of the same interface, in tests/unit).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import psutil
import torch
from tensordict import TensorDict

from schemas.jagged import is_nested
from schemas.rowpack import PACKED_FIELD, pack_rows, unpack_rows
from streams.errors import MissingKeysError, TQError, TQTimeout
from streams.pids import record_pid

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


@dataclass(frozen=True)
class TQProfile:
    """TQ's sizing for one kind of deployment: what a `TQConfig` field left None takes."""

    num_storage_units: int
    client_io_threads: int  # TQ_CLIENT_ZMQ_IO_THREADS: libzmq I/O threads of each process's TQ client
    num_threads: int | None  # TQ_NUM_THREADS: torch threads in TQ's put/get; None: physical cores, at most 8


# Cluster defaults: TQ's own (8 client I/O threads), storage spread over two units (and nodes).
CLUSTER = TQProfile(num_storage_units=2, client_io_threads=8, num_threads=None)
# One node, chosen by measurement (bench/dataplane, docs/DESIGN.md "TQ settings"): every
# process on the machine shares its cores, so one storage unit (each put, get and clear is then one
# storage request, a dense field is never sliced with a step, one process fewer) and one I/O and
# torch thread per client (8 I/O threads in each of the publisher, reassembler and trainer
# processes only compete for the cores the bytes need).
SINGLE_NODE = TQProfile(num_storage_units=1, client_io_threads=1, num_threads=1)


@dataclass(frozen=True)
class TQConfig:
    """How to reach Ray and size TQ; address None starts a local Ray instance unless one is running.

    The sizing fields left None follow `profile`: "auto" takes `SINGLE_NODE` when this process
    starts Ray itself or attaches to a one-node cluster, `CLUSTER` otherwise. A TQ_* environment
    variable already set (by the operator, or by the parent that started this process) wins over a
    profile; an explicit field wins over both.
    """

    address: str | None = None
    num_storage_units: int | None = None
    client_io_threads: int | None = None
    num_threads: int | None = None
    profile: Literal["auto", "single_node", "cluster"] = "auto"
    # TQ's controller and each storage unit ask Ray for one CPU, and reassembler actors one each;
    # logical CPUs above the physical count only oversubscribe cores that mostly wait on I/O.
    num_cpus: int = 16
    namespace: str = "rlstream"
    # TQ pins its storage units round-robin over the alive Ray nodes (sorted by node id) that offer
    # this custom resource; None: every alive node, so N units on k nodes put N/k on each.
    storage_node_resource: str | None = None
    # The longest one storage-unit request (put, get, clear) of this process may take, all of its
    # attempts together; None keeps TQ's own (200 s, three times). A reassembler process bounds it
    # (reassembler/run.py) beside the deadline of every call its store makes (`with_call_deadline`).
    call_budget_s: float | None = None


def _physical_threads() -> int:
    # TQ warns on every call when TQ_NUM_THREADS exceeds the physical cores.
    return max(1, min(8, psutil.cpu_count(logical=False) or 1))


def _apply_client_settings(config: TQConfig, profile: TQProfile) -> dict[str, str]:
    """Resolve TQ's per-process settings (field > environment > profile) into os.environ; returns them.

    TQ reads them at import: set before `transfer_queue` is imported, or patched in its client
    module when something imported it earlier (its client is created later, by `tq.init`).
    """
    wanted = {
        "TQ_CLIENT_ZMQ_IO_THREADS": (config.client_io_threads, profile.client_io_threads),
        "TQ_NUM_THREADS": (config.num_threads, profile.num_threads or _physical_threads()),
    }
    settings = {}
    for name, (explicit, default) in wanted.items():
        value = str(explicit) if explicit is not None else os.environ.get(name) or str(default)
        if int(value) < 1:
            raise TQError(f"{name} must be at least 1, got {value}")
        os.environ[name] = settings[name] = value
    client = sys.modules.get("transfer_queue.client")
    if client is not None:
        client.TQ_CLIENT_ZMQ_IO_THREADS = int(settings["TQ_CLIENT_ZMQ_IO_THREADS"])
        client.TQ_NUM_THREADS = int(settings["TQ_NUM_THREADS"])
    return settings


def _profile(config: TQConfig, single_node: bool) -> TQProfile:
    if config.profile == "single_node" or (config.profile == "auto" and single_node):
        return SINGLE_NODE
    return CLUSTER


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

    TQ reads these settings when its storage module is imported (the attempts at each request, the
    timeout when its client is created): in a process that imported TQ already, its module's copies
    are set too. Run it before `init_tq` creates the client.
    """
    if budget_s <= 0:
        raise ValueError(f"a TQ call budget must be positive, got {budget_s}")
    settings = {
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": BOUNDED_ATTEMPTS,
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": max(1, int(budget_s / BOUNDED_ATTEMPTS)),
    }
    storage = sys.modules.get("transfer_queue.storage.managers.simple_storage_manager")
    for name, value in settings.items():
        os.environ[name] = str(value)
        if storage is not None:
            setattr(storage, name, value)


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


def init_tq(config: TQConfig = TQConfig()) -> TQSession:
    """Start or attach to Ray, then create or attach to the TQ controller and its storage units."""
    if config.call_budget_s is not None:
        bound_tq_calls(config.call_budget_s)
    import ray

    started_ray = False
    if not ray.is_initialized():
        local = config.address is None
        # Ray actors (TQ's controller and storage units) take the job's environment.
        env = {"env_vars": _apply_client_settings(config, _profile(config, single_node=local))}
        if not local:
            _attach(ray, config, env)
        else:
            # Ray turns token authentication on for a new local cluster and says so as a WARNING
            # on every start, which a user of rlstream can do nothing about: that one logger of
            # Ray's only speaks from ERROR up. Authentication itself is unchanged.
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
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
    alive = [n for n in ray.nodes() if n.get("Alive")]
    profile = _profile(config, single_node=len(alive) <= 1)
    _apply_client_settings(config, profile)
    import transfer_queue as tq
    from transfer_queue import interface

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)
    had_controller = _controller_exists()
    units = config.num_storage_units if config.num_storage_units is not None else profile.num_storage_units
    storage = {"num_data_storage_units": units}
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

    def __init__(self, packed: Iterable[str] = (STAGING, TRAIN)) -> None:
        import transfer_queue as tq
        from transfer_queue.storage.managers.simple_storage_manager import StorageUnitTimeout

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
