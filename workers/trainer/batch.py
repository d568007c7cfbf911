"""What the trainer selects and what it trains on: `BatchMeta` (metadata only) and its tensors.

`select` hands out a `BatchMeta`: the groups' finalized records, their sample ids and tags, the TQ
partition holding their rows and the records' positions, but no tensor. Whoever trains fetches
the rows with `materialize` (in this process or in a data-parallel worker that has only the meta),
padded for a model or jagged as packed; `ack` settles the meta. `TrainBatch` is the older shape of
the same thing: meta plus padded tensors, what `next_batch` returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import TensorDict

from schemas.errors import InvalidArgument, LayoutError
from schemas.finalized import FinalizedGroup
from schemas.multimodal import packed_fields
from schemas.payload import unpack_payload
from streams.tq import TRAIN, KVStore
from streams.tq_read import join_rows

Layout = Literal["padded", "jagged"]


@dataclass(frozen=True)
class BatchMeta:
    """Prompt groups selected together at `version`: everything about them but their tensors."""

    version: int
    groups: tuple[FinalizedGroup, ...]
    positions: tuple[tuple[int, int], ...]  # (partition, offset) of each group's finalized record
    train_partition: str  # the TQ partition holding the groups' rows

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(s for g in self.groups for s in g.sample_ids)

    @property
    def tags(self) -> tuple[dict, ...]:
        return tuple(t for g in self.groups for t in g.tags)

    @property
    def weight_versions(self) -> tuple[tuple[int, int], ...]:
        """(lowest, highest) weight version of each group's rollouts."""
        return tuple((g.group_min_wv, g.group_max_wv) for g in self.groups)

    @property
    def staleness(self) -> list[int]:
        return [self.version - g.group_min_wv for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)


@dataclass(frozen=True)
class TrainBatch:
    """Groups yielded together, their sample IDs and tags, and the padded tensors from TQ train."""

    version: int
    groups: tuple[FinalizedGroup, ...]
    sample_ids: tuple[str, ...]
    tags: tuple[dict, ...]
    tensors: dict[str, torch.Tensor]
    positions: tuple[tuple[int, int], ...]  # (partition, offset) of each group's record
    train_partition: str = TRAIN

    @property
    def staleness(self) -> list[int]:
        return [self.version - g.group_min_wv for g in self.groups]

    @property
    def meta(self) -> BatchMeta:
        return BatchMeta(self.version, self.groups, self.positions, self.train_partition)


def materialize(
    store: KVStore,
    meta: BatchMeta,
    *,
    fields: Sequence[str] | None = None,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, int],
) -> TensorDict:
    """The rows of `meta` from TQ, one per sample id in order: padded tensors, or jagged as packed.

    Raises `MissingKeysError` naming rows absent from the partition.
    """
    if layout not in ("padded", "jagged"):
        raise InvalidArgument(f"layout must be 'padded' or 'jagged', got {layout!r}")
    if layout == "jagged":
        return _rows(store, meta, fields)
    tensors = padded(store, meta, fields=fields, pad_value_dict=pad_value_dict)
    return TensorDict(tensors, batch_size=[len(meta.sample_ids)])


def padded(
    store: KVStore, meta: BatchMeta, *, fields: Sequence[str] | None = None, pad_value_dict: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """`materialize`'s padded tensors as a plain dict (what `TrainBatch.tensors` holds)."""
    return unpack_payload(_rows(store, meta, fields), meta.tags, pad_value_dict=pad_value_dict)


def _rows(store: KVStore, meta: BatchMeta, fields: Sequence[str] | None) -> TensorDict:
    """The batch's rows in one get; groups whose rows hold different fields (a VLM group's media, a
    text group's none), one get per group, joined.

    A packed media field a group lacks (selected or not) is that group's empty rows. Refused with
    `InvalidArgument` naming the field and the groups: a selected field that is neither in every
    group's rows nor a packed field of some group, and a field the groups hold in different dtypes
    (one jagged field holds one dtype: materialize those groups in separate batches).
    """
    ids = list(meta.sample_ids)
    if not ids:
        raise InvalidArgument("materialize needs a batch with at least one row")
    select = list(fields) if fields is not None else None
    try:
        return store.get(meta.train_partition, ids, select=select)
    except LayoutError:
        raise  # a row this code cannot read: no other way of reading it would
    except ValueError:
        if len(meta.groups) < 2:
            raise
    parts = []
    for g in meta.groups:
        mine = packed_fields(g.tags)
        # A packed field of other groups is not asked of this one: it comes back as its empty rows.
        wanted = None if select is None else [n for n in select if n in mine or n not in _packed(meta)]
        try:
            parts.append(dict(store.get(meta.train_partition, list(g.sample_ids), select=wanted).items()))
        except LayoutError:
            raise
        except ValueError as exc:
            raise InvalidArgument(
                f"group {g.group_id}'s rows cannot be read as asked ({exc}); the batch's groups: {_names(meta.groups)}"
            ) from exc
    return TensorDict(_join_groups(parts, meta), batch_size=[len(ids)])


def _packed(meta: BatchMeta) -> set[str]:
    return {name for g in meta.groups for name in packed_fields(g.tags)}


def _names(groups: Sequence[FinalizedGroup]) -> str:
    shown = ", ".join(g.group_id for g in groups[:8])
    return shown + (f" (+{len(groups) - 8} more)" if len(groups) > 8 else "")


def _join_groups(parts: list[dict[str, torch.Tensor]], meta: BatchMeta) -> dict[str, torch.Tensor]:
    """The groups' fields as one batch; a packed multimodal field a group lacks is its empty rows."""
    packed = _packed(meta)
    names = list(dict.fromkeys(name for p in parts for name in p))
    for name in names:
        having = [(p[name], g) for p, g in zip(parts, meta.groups) if name in p]
        dtypes: dict[torch.dtype, list[str]] = {}
        for value, g in having:
            dtypes.setdefault(value.dtype, []).append(g.group_id)
        if len(dtypes) > 1:
            shown = "; ".join(f"{str(d).removeprefix('torch.')}: {', '.join(gs[:8])}" for d, gs in dtypes.items())
            raise InvalidArgument(
                f"the batch's groups hold the field {name!r} in different dtypes ({shown}): one batch field "
                "holds one dtype; materialize these groups in separate batches"
            )
        if len(having) == len(parts):
            continue
        if name not in packed:
            lacking = [g for p, g in zip(parts, meta.groups) if name not in p]
            raise InvalidArgument(
                f"the field {name!r} is not in the rows of group(s) {_names(lacking)} (the batch's groups: "
                f"{_names(meta.groups)})"
            )
        empty = torch.empty(0, dtype=having[0][0].dtype)
        for part, group in zip(parts, meta.groups):
            if name not in part:
                part[name] = torch.nested.as_nested_tensor([empty] * len(group.sample_ids), layout=torch.jagged)
    return join_rows(parts)
