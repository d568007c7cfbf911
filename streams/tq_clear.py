"""A TQ clear that never deletes by an index that changed hands since its lookup.

transfer_queue 0.1.11's `kv_clear` looks the keys up, then marks the rows as being cleared, clears
storage and releases the indexes, each by the global indexes the lookup found. Storage units keep
rows by index alone (no partition, no key) and the controller hands released indexes to the next
put of any partition, first in first out. A clear whose lookup went stale (its process frozen after
it while the keys' next owner cleared them and a put was given an index) would therefore delete that
put's row in storage while the controller keeps it ready. `clear_unmoved` runs TQ's steps itself and
checks, between the mark and the storage clear, that each index still holds the key it was looked
up for: not merely some key of the clear, since a key of the clear staged again meanwhile (a
publisher's retry) can be handed another one's old index.
"""

from __future__ import annotations

from collections.abc import Callable

from streams.errors import ClearRefused, TQError

# Asked before each request of a clear that changes TQ; a reason not to go on, or None.
ClearGuard = Callable[[], "str | None"]
# The client internals of transfer_queue 0.1.11 this clear runs (`TransferQueueClient.async_clear_samples`'s steps).
_STEPS = ("_mark_clearing_in_controller", "_clear_meta_in_controller", "storage_manager", "async_kv_retrieve_keys")


async def clear_unmoved(client, partition: str, keys: list[str], guard: ClearGuard | None) -> None:
    """Clear the rows of `keys` (absent ones skipped) in `partition` on TQ client `client`'s loop.

    Lookup, then (`guard` allowing) the clearing mark, then which keys the marked indexes hold now:
    only the indexes still holding the very key each was looked up for are cleared in storage and
    released, each request after `guard` allowed it (a reason raises `ClearRefused`). The mark itself goes by the
    lookup's indexes, as TQ's does: an index reused within the partition meanwhile is marked as
    being cleared (its row reads as missing until its owner clears or puts it again), never deleted.
    """
    missing = [name for name in _STEPS if not hasattr(client, name)]
    if missing:
        raise TQError(
            f"TQ's client has no {', '.join(missing)}: rlstream's clear runs transfer_queue 0.1.11's clear steps"
        )
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if meta.size == 0:
        return
    # The key each index was looked up for. TQ answers the keys found in the order asked, absent
    # ones left out: position i is keys[i] when all were found; otherwise ask right after the lookup.
    looked_up = keys if meta.size == len(keys) else await _held(client, partition, keys, meta)
    _ask(guard, "mark", partition, keys)
    await client._mark_clearing_in_controller(meta)
    held = await _held(client, partition, keys, meta)
    # Each index still holding the key it was looked up for, not merely some key of this clear: a key
    # of the clear staged again meanwhile can have taken another one's old index.
    still = [i for i, (was, now) in enumerate(zip(looked_up, held, strict=True)) if was is not None and was == now]
    if not still:
        return
    if len(still) < meta.size:
        meta = meta.select_samples(still)
    _ask(guard, "delete", partition, keys)
    await client.storage_manager.clear_data(meta)
    _ask(guard, "release", partition, keys)
    await client._clear_meta_in_controller(meta)


async def _held(client, partition: str, keys: list[str], meta) -> list:
    """The key each of `meta`'s indexes holds in `partition` now (None: none)."""
    try:
        return list(
            await client.async_kv_retrieve_keys(global_indexes=list(meta.global_indexes), partition_id=partition)
        )
    except RuntimeError as exc:
        raise TQError(
            f"clear of {len(keys)} key(s) from {partition!r}: could not check who holds their rows "
            f"({exc}); nothing deleted"
        ) from None


def _ask(guard: ClearGuard | None, step: str, partition: str, keys: list[str]) -> None:
    if guard is not None and (why := guard()) is not None:
        raise ClearRefused(
            f"clear of {len(keys)} key(s) from TQ partition {partition!r} (first {keys[0]!r}) given up "
            f"before its {step}: {why}"
        )
