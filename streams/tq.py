"""The small KV client over TransferQueue that the workers use for the staging and train partitions.

`KVStore` is the narrow interface the workers use; `TQStore` implements it over TQ's KV API (unit
tests of pure logic use a dict-backed store of the same interface, in tests/unit). How a read is
checked to be the key's row, and what a failed one means, is `streams.tq_read`; the clear that never
deletes an index that changed hands, `streams.tq_clear`. Starting or attaching to Ray and TQ is
`streams.tq_setup`, whose names are re-exported here.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from tensordict import TensorDict

from schemas.errors import RlstreamError
from schemas.rowpack import PACKED_FIELD, pack_rows
from streams import tq_read
from streams.errors import MissingKeysError, RowsUnsettled, TQError, TQTimeout
from streams.tq_clear import ClearGuard, clear_unmoved
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
    set_torch_threads,
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
    "nodes_offering",
    "ray_address",
    "set_torch_threads",
    "start_tq_metrics",
    "with_call_deadline",
    "with_clear_guard",
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

    def row_bytes(self, partition: str, keys: Sequence[str]) -> dict[str, int]:
        """About how many bytes each present key's row holds, from metadata (no row is read); absent keys,
        and rows whose size the store cannot tell, are left out. A reader sizes its reads by it."""
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


def with_clear_guard(store: KVStore, guard: ClearGuard) -> KVStore:
    """`store` with every clear asking `guard` right before each of its requests that changes TQ (the
    clearing mark, the storage clear, the release), and given up (`ClearRefused`) when it names a
    reason; `store` itself when it does not call TQ (an in-memory store of tests).

    A reassembler passes its lease's refusal: a worker frozen after a clear's lookup, whose
    partitions moved meanwhile, gives the clear up on waking instead of deleting by indexes that
    may belong to other keys by then (see `TQStore.clear`).
    """
    if not isinstance(store, TQStore):
        return store
    guarded = copy.copy(store)
    guarded._clear_guard = guard
    return guarded


# Row lookups `TQStore.tags` keeps for a `get` of the same keys; a trainer has a batch or two in flight.
_LOCATED_BATCHES = 32
# Reads of one get before giving up on rows that keep moving under their keys (cleared and put again).
_READS = 3


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

    A row TQ still maps under its key whose storage is gone, or holds another key's packed row, reads
    as missing (`MissingKeysError`), as a row cleared does: a clear or put whose lookup went stale
    can leave that (TQ's storage knows indexes, not keys), and it is the key's owner who clears it
    by its normal path, never a reader. A clear never deletes by an index that changed hands since
    its lookup (`clear`).

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
        self._clear_guard: ClearGuard | None = None

    def _call(self, what: str, coro, *, read: bool = False) -> Any:
        """Run `coro` on TQ's client loop, within the deadline if there is one.

        TQ's client wraps every controller failure in `RuntimeError`: raised in TQ's code, it is "not
        now" here, `RowsUnsettled` for a `read` (nothing is known missing), else `TQError` (nothing is
        known done), which every caller handles; a `RuntimeError` raised elsewhere (rlstream's own
        code, torch) is no TQ failure and is left as it is.
        """
        client = self._tq.get_client()
        if self._deadline_s is not None:
            coro = _within(coro, self._deadline_s, what)
        try:
            return client._run_coroutine(coro)
        except self._unit_timeout as exc:
            # After TQ's own attempts, each on a new connection: the unit may still serve the request.
            raise TQTimeout(f"TQ {what}: {exc}") from exc
        except RlstreamError:
            raise
        except RuntimeError as exc:
            # The package of TQ's code: transfer_queue, or a fake's module in unit tests.
            if not _raised_in(exc, getattr(self._tq, "__name__", None) or type(self._tq).__module__):
                raise
            raise (RowsUnsettled if read else TQError)(f"TQ {what} failed, not known done: {exc}") from exc

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
        what = f"get of {len(keys)} key(s) from {partition!r}"
        for _ in range(_READS):
            # The lookup (if any), the read and its check in one coroutine on TQ's loop: one thread hop.
            got = self._call(what, tq_read.read(self._tq, client, partition, keys, select, located), read=True)
            if got.rows is not None:
                return got.rows
            if got.clearing:
                raise MissingKeysError(partition, [keys[i] for i in got.clearing])
            # Absent at the lookup, perhaps put since (the listing then names none): read again.
            if got.absent and (missing := self._missing(partition, keys)):
                raise MissingKeysError(partition, missing)
            if got.absent or located is not None:
                self._forget(partition, keys)
                located = None
                continue
            # Read by a lookup of its own and still not the keys' rows: some moved since (read again),
            # or TQ maps a key to an index whose storage is gone or holds another key's row (missing).
            unreadable = self._call(what, tq_read.unreadable(self._tq, client, partition, keys, select, got), read=True)
            if unreadable is None and (missing := self._missing(partition, keys)):
                raise MissingKeysError(partition, missing)
            if unreadable:
                raise MissingKeysError(partition, unreadable)
        raise RowsUnsettled(
            f"rows of {len(keys)} key(s) of TQ partition {partition!r} (first {keys[0]!r}) kept moving "
            f"while read {_READS} times: cleared and put again by another client"
        )

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
        listed = self._call(f"list of {partition!r}", self._tq.async_kv_list(partition_id=partition), read=True)
        return dict(listed.get(partition, {}))

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The tags each present key was put with, absent keys left out: one lookup when every key is
        present (the common case), else a reverse lookup too (TQ's answer leaves the absent ones out
        without saying which), never a list of the partition. `RowsUnsettled` if the reverse lookup
        fails (TQ's controller): which keys are present is not known then."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return {}
        what = f"lookup of {len(keys)} key(s) in {partition!r}"
        meta, held = self._call(what, self._lookup(self._tq.get_client(), partition, keys), read=True)
        if meta.size == len(keys):
            self._remember(partition, keys, meta)
            # The tags as TQ sent them, copied per key (get_all_custom_meta deep-copies: ~6 ms for 64 rows).
            return {k: dict(t) for k, t in zip(keys, meta.custom_meta)}
        wanted = set(keys)
        return {k: dict(t) for k, t in zip(held, meta.custom_meta) if k in wanted}

    def row_bytes(self, partition: str, keys: Sequence[str]) -> dict[str, int]:
        """From the shapes and dtypes TQ's controller keeps per row (one metadata call; a packed row is one
        uint8 field of its bytes). Keys cleared since the caller listed them are looked up again without."""
        keys = list(dict.fromkeys(keys))
        for _ in range(2):
            if not keys:
                return {}
            lookup = self._tq.get_client().async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
            meta = self._call(f"lookup of {len(keys)} key(s) in {partition!r}", lookup)
            if meta.size == len(keys):
                return {k: n for k, n in zip(keys, _sizes(meta)) if n is not None}
            present = self.present(partition, keys)
            keys = [k for k in keys if k in present]
        return {}

    async def _lookup(self, client, partition: str, keys: list[str]) -> tuple[Any, list]:
        """TQ's lookup of `keys`, and the key each index it found holds when some were absent."""
        meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
        if meta.size in (0, len(keys)):
            return meta, []
        try:
            held = await client.async_kv_retrieve_keys(global_indexes=list(meta.global_indexes), partition_id=partition)
        except RuntimeError as exc:
            raise RowsUnsettled(f"TQ lookup of {len(keys)} key(s) in {partition!r}: which are present: {exc}") from exc
        return meta, list(held)

    def clear(self, partition: str, keys: Sequence[str], *, guard: ClearGuard | None = None) -> None:
        """Clear `keys`' rows (absent ones are skipped), never by an index that changed hands since the lookup.

        TQ 0.1.11's own clear looks the keys up, then marks, deletes from storage and releases by the
        indexes found; storage deletes an index whatever partition or key holds it now, and the index
        pool is shared by every partition. A clear whose lookup went stale (its process frozen after
        it while another owner cleared the keys and a put was given the index) would delete that
        put's row, which its controller keeps ready. So the clear runs TQ's steps itself: lookup,
        a check of which keys the found indexes hold (only those holding their key are marked), mark,
        then a check of which keys the marked indexes hold now, and only the indexes still
        holding the very key each was looked up for are deleted and released (not any key of this
        clear: one staged again meanwhile can hold another's old index). `guard` (default: the one given by
        `with_clear_guard`) is asked right before the mark, the storage clear and the release; a
        reason raises `ClearRefused`. What no check closes: a freeze after the last check and before
        the request leaves the process, a request sent and served late by a stalled storage unit, or
        a storage clear a unit did not confirm in time, which TQ only logs, the index released all the
        same (docs/DESIGN.md, "Zombies"; docs/TQ-UPSTREAM.md, 8).
        """
        if not keys:
            return
        keys = list(dict.fromkeys(keys))
        self._forget(partition, keys)
        guard = guard if guard is not None else self._clear_guard
        clear = clear_unmoved(self._tq.get_client(), partition, keys, guard)
        self._call(f"clear of {len(keys)} key(s) from {partition!r}", clear)


def _raised_in(exc: BaseException, package: str) -> bool:
    """Whether `exc` was raised by code of `package` (the innermost frame of its traceback)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_globals.get("__name__", "")
    return name == package or name.startswith(package + ".")


async def _within(coro, deadline_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(coro, deadline_s)
    except TimeoutError:
        raise TQTimeout(
            f"TQ {what} did not finish within {deadline_s:g}s: given up (cancelled where it waited, so it "
            "sends nothing more; what it sent already may still be applied)"
        ) from None


def _sizes(meta: Any) -> list[int | None]:
    """Bytes of each row of `meta` from its fields' per-row shapes and dtypes; None where one is unknown."""
    if not hasattr(meta, "get_shapes"):  # a client whose metadata keeps no per-row shapes: unknown
        return [None] * meta.size
    sizes: list[int | None] = [0] * meta.size
    for name, schema in meta.field_schema.items():
        dtype = schema.get("dtype")
        itemsize = getattr(dtype, "itemsize", None)
        for i, shape in enumerate(meta.get_shapes(name)):
            if sizes[i] is None:
                continue
            if itemsize is None or shape is None:
                sizes[i] = None
            else:
                sizes[i] += math.prod(shape) * itemsize
    return sizes
