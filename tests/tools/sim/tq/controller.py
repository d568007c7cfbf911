"""TQ 0.1.11's controller, the part the KV API reaches: one global index pool, partitions, keys, readiness, tags.

Ported from `transfer_queue/controller.py` (`PartitionIndexManager`, `DataPartitionStatus`,
`TransferQueueController.kv_retrieve_meta`, `update_production_status`, `set_custom_meta`,
`mark_clearing`, `clear_meta`, `_handle_kv_list_request`) with the same set and list operations in
the same order, so the order indexes go back to the pool (a set intersection's order) is TQ's own.
Readiness is kept per row as the set of fields produced instead of TQ's int8 matrix; consumption
tracking, samplers and checkpoints are left out. Each method is one request the real controller
serves whole, in the order requests arrive.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import Any

import numpy as np

from tests.tools.sim.tq.meta import BatchMeta

# TQ's TQ_PRE_ALLOC_SAMPLE_NUM default: a partition takes one index from the pool when it is created.
PRE_ALLOC_SAMPLE_NUM = 1


class IndexPool:
    """`PartitionIndexManager`: one FIFO pool of released indexes for every partition, then a counter."""

    def __init__(self, first: int = 0):
        self.partition_to_indexes: defaultdict[str, set[int]] = defaultdict(set)
        self.reusable_indexes: list[int] = []
        self.global_index_counter = first
        self.allocated_indexes: set[int] = set()

    def allocate(self, partition_id: str, count: int) -> list[int]:
        if count <= 0:
            raise ValueError(f"Number of indexes needed must be larger than 0, but got {count}")
        indexes: list[int] = []
        if self.reusable_indexes:
            n = min(count, len(self.reusable_indexes))
            indexes.extend(self.reusable_indexes[:n])
            del self.reusable_indexes[:n]
        if len(indexes) < count:
            start = self.global_index_counter
            new = list(range(start, start + count - len(indexes)))
            self.allocated_indexes.update(new)
            self.global_index_counter = start + len(new)
            indexes.extend(new)
        self.partition_to_indexes[partition_id].update(indexes)
        return indexes

    def release(self, partition_id: str, indexes: list[int]) -> None:
        if partition_id not in self.partition_to_indexes:
            return
        mine = self.partition_to_indexes[partition_id]
        if not set(indexes).issubset(mine):
            raise ValueError("Some indexes to release do not belong to the specified partition.")
        mine.difference_update(indexes)
        self.reusable_indexes.extend(indexes)
        self.allocated_indexes.difference_update(indexes)
        if not mine:
            self.partition_to_indexes.pop(partition_id, None)


@dataclass
class _FieldMeta:
    global_indexes: set[int] = field(default_factory=set)
    schema: dict[str, Any] = field(default_factory=dict)


@dataclass
class Partition:
    """`DataPartitionStatus`, minus consumption: rows, the fields each produced, tags, keys."""

    partition_id: str
    global_indexes: set[int] = field(default_factory=set)
    pre_allocated: set[int] = field(default_factory=set)
    # The fields ever registered, in registration order (TQ's field_name_mapping never shrinks).
    field_names: list[str] = field(default_factory=list)
    field_metadata: dict[str, _FieldMeta] = field(default_factory=dict)
    produced: dict[int, set[str]] = field(default_factory=dict)
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    keys_mapping: dict[str, int] = field(default_factory=dict)
    revert_keys_mapping: dict[int, str] = field(default_factory=dict)

    def activate_pre_allocated(self, count: int) -> list[int]:
        if len(self.pre_allocated) < count:
            taken = list(self.pre_allocated)
        else:
            taken = sorted(self.pre_allocated)[:count]
        self.global_indexes.update(taken)
        self.pre_allocated.difference_update(set(taken))
        return taken

    def update_production(self, indexes: list[int], schema: dict[str, dict[str, Any]]) -> None:
        for name in schema:
            if name not in self.field_names:
                self.field_names.append(name)
        for i in indexes:
            self.produced.setdefault(i, set()).update(schema)
        for name, meta in schema.items():
            fm = self.field_metadata.setdefault(name, _FieldMeta(schema=dict(meta)))
            fm.global_indexes.update(indexes)
        self.global_indexes.update(indexes)

    def clear_data(self, indexes: list[int]) -> None:
        for i in indexes:
            self.produced.pop(i, None)
        self.global_indexes.difference_update(indexes)
        empty = []
        for name, fm in self.field_metadata.items():
            fm.global_indexes.difference_update(indexes)
            if not fm.global_indexes:
                empty.append(name)
        if not self.global_indexes:
            self.field_metadata.clear()
        else:
            for name in empty:
                self.field_metadata.pop(name)
        for i in indexes:
            self.custom_meta.pop(i, None)
            if i in self.revert_keys_mapping:
                self.keys_mapping.pop(self.revert_keys_mapping[i], None)
                self.revert_keys_mapping.pop(i, None)

    def ready(self, index: int, fields: list[str]) -> bool:
        done = self.produced.get(index, ())
        return all(f in done for f in fields)


class Controller:
    """The controller's state and the requests of the KV API, each applied whole."""

    def __init__(self, first_index: int = 0):
        self.pool = IndexPool(first_index)
        self.partitions: dict[str, Partition] = {}

    def create_partition(self, partition_id: str) -> None:
        if partition_id in self.partitions:
            return
        part = self.partitions[partition_id] = Partition(partition_id)
        part.pre_allocated.update(self.pool.allocate(partition_id, PRE_ALLOC_SAMPLE_NUM))

    def kv_retrieve_meta(self, keys: list[str], partition_id: str, create: bool = False) -> BatchMeta:
        part = self.partitions.get(partition_id)
        if part is None:
            if not create:
                return BatchMeta.empty()
            self.create_partition(partition_id)
            part = self.partitions[partition_id]
        indexes: list[int | None] = [part.keys_mapping.get(k) for k in keys]
        absent = [i for i, v in enumerate(indexes) if v is None]
        if absent and create:
            fresh = part.activate_pre_allocated(len(absent))
            if len(fresh) < len(absent):
                fresh.extend(self.pool.allocate(partition_id, len(absent) - len(fresh)))
            part.global_indexes.update(fresh)
            for pos, gi in zip(absent, fresh):
                indexes[pos] = gi
                part.keys_mapping[keys[pos]] = gi
                part.revert_keys_mapping[gi] = keys[pos]
        found = [i for i in indexes if i is not None]
        # Only the fields every requested row produced; readiness per row over those fields.
        fields = [f for f in part.field_names if all(f in part.produced.get(i, ()) for i in found)]
        return self._batch_meta(part, found, fields)

    def _batch_meta(self, part: Partition, indexes: list[int], fields: list[str]) -> BatchMeta:
        schema = {f: dict(part.field_metadata[f].schema) for f in fields if f in part.field_metadata}
        status = np.zeros(len(indexes), dtype=np.int8)
        if fields:
            status[:] = [1 if part.ready(i, fields) else 0 for i in indexes]
        tags = [dict(part.custom_meta.get(i, {})) for i in indexes]
        return BatchMeta(indexes, [part.partition_id] * len(indexes), schema, status, tags)

    def notify_data_update(self, partition_id: str, indexes: list[int], schema: dict[str, dict[str, Any]]) -> bool:
        part = self.partitions.get(partition_id)
        if part is None:
            return False
        part.update_production(indexes, schema)
        return True

    def set_custom_meta(self, partition_custom_meta: dict[str, dict[int, dict[str, Any]]]) -> None:
        for partition_id, tags in partition_custom_meta.items():
            part = self.partitions.get(partition_id)
            if part is not None:
                part.custom_meta.update(tags)

    def mark_clearing(self, indexes: list[int], partition_ids: list[str]) -> None:
        for partition_id, group in _by_partition(indexes, partition_ids):
            part = self.partitions.get(partition_id)
            if part is None:
                continue
            existing = list(set(idx for _, idx in group) & part.global_indexes)
            for i in existing:
                part.produced.pop(i, None)

    def clear_meta(self, indexes: list[int], partition_ids: list[str]) -> None:
        for partition_id, group in _by_partition(indexes, partition_ids):
            part = self.partitions.get(partition_id)
            if part is None:
                continue
            to_clear = list(set(idx for _, idx in group) & part.global_indexes)
            if not to_clear:
                continue
            part.clear_data(to_clear)
            self.pool.release(partition_id, to_clear)

    def kv_retrieve_keys(self, indexes: list[int], partition_id: str) -> list[str | None]:
        """The key each index holds in the partition now, None where it holds none; [] for an unknown
        partition. TQ 0.1.11 means to answer [] when an index holds no key, but its check looks at the
        indexes instead of the keys found, so a None comes through."""
        part = self.partitions.get(partition_id)
        if part is None:
            return []
        return [part.revert_keys_mapping.get(i) for i in indexes]

    def kv_list(self, partition_id: str | None) -> dict[str, dict[str, dict[str, Any]]]:
        ids = list(self.partitions) if partition_id is None else [partition_id]
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for pid in ids:
            part = self.partitions.get(pid)
            if part is not None:
                out[pid] = {key: dict(part.custom_meta.get(i, {})) for key, i in part.keys_mapping.items()}
        return out


def _by_partition(indexes: list[int], partition_ids: list[str]):
    if len(indexes) != len(partition_ids):
        raise ValueError(
            f"global_indexes and partition_ids must have the same length, got {len(indexes)} and {len(partition_ids)}"
        )
    combined = sorted(zip(partition_ids, indexes), key=itemgetter(0))
    return [(pid, list(group)) for pid, group in groupby(combined, key=itemgetter(0))]
