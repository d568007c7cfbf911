"""TQ 0.1.11's `BatchMeta`, as far as a client reads it: the model hands these out where TQ hands its own.

The same attributes and rules as `transfer_queue.metadata.BatchMeta` (importing TQ starts Ray's
machinery, about 4 s, so the model keeps its own): `size`, `global_indexes`, `partition_ids`,
`field_names` (sorted schema keys), `production_status` (int8 per row), `is_ready` (non-empty and
every row 1), `custom_meta` (a dict per row), `select_fields`, `update_custom_meta`, `add_fields`.
The schema per field keeps dtype, shape and nesting of the batch put; its finer rules (per-sample
shapes, dtype conflicts) are not modelled and not claimed.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


def field_schema(data: TensorDict) -> dict[str, dict[str, Any]]:
    """Each field's schema as TQ's `extract_field_schema` records it (dtype, shape of a row, nesting)."""
    schema: dict[str, dict[str, Any]] = {}
    for name, value in data.items():
        is_tensor = isinstance(value, torch.Tensor)
        nested = is_tensor and value.is_nested
        first = value.unbind()[0] if nested else (value[0] if is_tensor else None)
        schema[name] = {
            "dtype": getattr(first, "dtype", None),
            "shape": None if nested or first is None else tuple(first.shape),
            "is_nested": nested,
            "is_non_tensor": not is_tensor,
        }
    return schema


class BatchMeta:
    """Metadata of a batch of rows: their global indexes, partition, fields, readiness and tags."""

    def __init__(
        self,
        global_indexes: list[int],
        partition_ids: list[str],
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: Any = None,
        custom_meta: list[dict[str, Any]] | None = None,
        extra_info: dict[str, Any] | None = None,
    ):
        self.global_indexes = list(global_indexes)
        self.partition_ids = list(partition_ids)
        if len(self.global_indexes) != len(self.partition_ids):
            raise ValueError(
                f"Length mismatch: global_indexes has {len(self.global_indexes)}, "
                f"partition_ids has {len(self.partition_ids)}"
            )
        n = len(self.global_indexes)
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if len(self.production_status) != n:
                raise ValueError(f"production_status length {len(self.production_status)} != batch_size {n}")
        self.custom_meta = [dict(d) for d in custom_meta] if custom_meta else [{} for _ in range(n)]
        if len(self.custom_meta) != n:
            raise ValueError(f"custom_meta length {len(self.custom_meta)} != batch_size {n}")
        self.extra_info = dict(extra_info or {})

    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: list[dict[str, Any]] | None) -> None:
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise ValueError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, theirs in zip(self.custom_meta, custom_meta):
            mine.update(theirs)

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        if any(i < 0 or i >= self.size for i in sample_indices):
            raise ValueError(f"Sample indices must be in range [0, {self.size})")
        return BatchMeta(
            [self.global_indexes[i] for i in sample_indices],
            [self.partition_ids[i] for i in sample_indices],
            copy.deepcopy(self.field_schema),
            self.production_status[sample_indices],
            [copy.deepcopy(self.custom_meta[i]) for i in sample_indices],
            self.extra_info,
        )

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        return BatchMeta(
            self.global_indexes,
            self.partition_ids,
            {f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema},
            self.production_status.copy(),
            copy.deepcopy(self.custom_meta),
            copy.deepcopy(self.extra_info),
        )

    def add_fields(self, data: TensorDict) -> BatchMeta:
        """After a put: the fields written join the schema and every row counts as ready (as TQ's)."""
        if data.batch_size[0] == 0:
            return self
        if data.batch_size[0] != self.size:
            raise ValueError(
                f"add_fields batch size mismatch: self.size={self.size} vs tensor_dict={data.batch_size[0]}"
            )
        self.field_schema.update(field_schema(data))
        self.production_status[:] = 1
        return self

    def copy(self) -> BatchMeta:
        return BatchMeta(
            self.global_indexes,
            self.partition_ids,
            copy.deepcopy(self.field_schema),
            self.production_status.copy(),
            copy.deepcopy(self.custom_meta),
            copy.deepcopy(self.extra_info),
        )

    @classmethod
    def empty(cls) -> BatchMeta:
        return cls([], [])

    def __repr__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, global_indexes={self.global_indexes}, fields={self.field_names}, "
            f"ready={self.is_ready})"
        )
