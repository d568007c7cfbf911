"""Fetching rlstream's staged call deltas from TQ's staging partition for finalize (NeMo Gym's rows:
`gym_fetch.py`): batched gets, a key that vanished meanwhile left out, a step aborted when rows keep
vanishing or cannot be settled now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from schemas.jagged import jagged_rows
from schemas.staged_rows import ROUTED_EXPERTS, ROUTED_EXPERTS_K_TAG, SEGMENT_FIELDS
from streams.errors import MissingKeysError, RowsUnsettled
from streams.tq import KVStore
from workers.reassembler.errors import StagingUnstable

# Staged rows by key: rlstream's (its tensors) or NeMo Gym's (`GymStagedRow`, or why it is unreadable).
Segments = dict[str, Any]


def fetch_segments(
    store: KVStore,
    staging_partition: str,
    keys: Sequence[str],
    *,
    routed_experts: bool = False,
    tags: Mapping[str, Mapping[str, Any]] | None = None,
    unread: set[str] | None = None,
) -> Segments:
    """Batched gets of the staged call deltas; absent keys are simply missing from the result, and
    added to `unread` (when given) if the store reported them missing, as opposed to rows it gave
    that are not rlstream's (left out too, but the group's input, not a loss: `staging_lost.py`).

    With `routed_experts`, rows whose staging tags say they carry them (`routed_experts_k`) are
    fetched with the field and the others without it, in one get per kind: TQ drops a field that
    some of the requested rows lack, or refuses the read. A row left without experts is backfilled
    by the build (`num_routed_experts_backfilled`), never a crash.
    """
    keys = list(dict.fromkeys(keys))
    if not routed_experts:
        return _fetch(store, staging_partition, keys, SEGMENT_FIELDS, unread)
    tags = tags or {}
    with_experts = [k for k in keys if ROUTED_EXPERTS_K_TAG in tags.get(k, {})]
    plain = [k for k in keys if ROUTED_EXPERTS_K_TAG not in tags.get(k, {})]
    out = _fetch(store, staging_partition, with_experts, (*SEGMENT_FIELDS, ROUTED_EXPERTS), unread)
    out.update(_fetch(store, staging_partition, plain, SEGMENT_FIELDS, unread))
    return out


def _fetch(
    store: KVStore,
    staging_partition: str,
    keys: list[str],
    select: Sequence[str],
    unread: set[str] | None,
    *,
    whole: bool = True,
) -> Segments:
    if not keys:
        return {}
    try:
        keys, td = get_present(store, staging_partition, keys, select, unread)
    except ValueError:
        # A row the store cannot give as asked (a selected field it lacks, a layout it cannot
        # read): input, not a fault. Row by row, the rows that fail become missing staging rows.
        if not whole:
            return {}
        return {
            k: v
            for key in keys
            for k, v in _fetch(store, staging_partition, [key], select, unread, whole=False).items()
        }
    if not keys:
        return {}
    columns = {name: tensor_rows(value) for name in select if (value := td.get(name, None)) is not None}
    missing_fields = [name for name in SEGMENT_FIELDS if name not in columns]
    if missing_fields:
        # Rows staged without a field every call has: not this pipeline's rows. Their keys are
        # left out, so their receipts' rows are rejected as missing staging rows.
        return {}
    out: Segments = {}
    for i, key in enumerate(keys):
        seg = {name: columns[name][i] for name in SEGMENT_FIELDS}
        if ROUTED_EXPERTS in columns:
            seg[ROUTED_EXPERTS] = _unflatten_experts(columns[ROUTED_EXPERTS][i], seg["token_ids"].numel())
        out[key] = seg
    return out


def get_present(
    store: KVStore, partition: str, keys: list[str], select: Sequence[str], unread: set[str] | None = None
) -> tuple[list[str], Any]:
    """The keys still present and their rows in one get (None when none is left); the keys the store
    reported missing are added to `unread` (when given).

    A key can vanish between tries (its owner cleared it after a rebalance): read again without the
    absent ones (they become placeholder rows). Should keys keep vanishing, or the rows move under
    their keys (`RowsUnsettled`: cleared and put again, or TQ's controller failed while the read was
    checked), the step is aborted (`StagingUnstable`) and rebuilt, rather than finalizing its groups
    without rows it may yet find. A `ValueError` (rows the store cannot give as asked) is the caller's.
    """
    for _ in range(3):
        try:
            return keys, store.get(partition, keys, select=list(select))
        except RowsUnsettled as exc:
            raise StagingUnstable(f"staged rows could not be read as theirs now ({exc})") from exc
        except MissingKeysError as exc:
            missing = set(exc.missing)
            if unread is not None:
                unread |= missing & set(keys)
            keys = [k for k in keys if k not in missing]
            if not keys:
                return [], None
    raise StagingUnstable(f"staged rows kept vanishing from {partition!r} during three fetches")


def _unflatten_experts(flat: torch.Tensor, tokens: int) -> torch.Tensor:
    """Routed experts are staged flattened; each token has the same number of them."""
    if tokens == 0 or flat.numel() % tokens:
        return flat  # left 1-D: linearize rejects the row as invalid_staging_row
    return flat.reshape(tokens, -1)


def tensor_rows(value: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a batched field as a list (views), whether TQ returned it jagged or dense."""
    if not value.is_nested:
        return list(value)
    rows = jagged_rows(value)
    if rows.scale != 1 or rows.rest:
        return list(value.unbind())
    # Slices of the values: a nested tensor's unbind costs several times as much per row.
    values, starts = rows.values, rows.offsets.tolist()
    lengths = rows.item_lengths()
    return [values[a : a + n] for a, n in zip(starts, lengths)]
