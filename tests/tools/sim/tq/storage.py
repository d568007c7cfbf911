"""TQ 0.1.11's simple storage: units holding field values by global index, and the manager that routes to them.

Ported from `transfer_queue/storage/simple_storage.py` (`StorageUnitData`) and
`storage/managers/simple_storage_manager.py`: a row goes to unit `global_index % units`; a unit keeps
`field -> {global_index: value}` with no partition at all, so a clear by index deletes that index's
data whatever partition it now belongs to; a get of an index a unit lacks raises
`StorageKeyNotFoundError`, of a field it never held a plain error. Each put or get request waits at
most `unit_timeout_s` for its answer and is sent again on a fresh connection up to `unit_attempts`
times (`StorageUnitTimeout` after the last); a request that timed out may still be applied when it
lands. A clear is one attempt, and its units' errors are logged by TQ and swallowed, as here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorStack, TensorDict

from tests.tools.sim.aio import reply
from tests.tools.sim.tq.meta import BatchMeta, field_schema

if TYPE_CHECKING:
    from tests.tools.sim.tq.client import TQClient


class StorageKeyNotFoundError(KeyError):
    """A requested global index is absent from a storage unit (TQ's class of the same name)."""


class StorageUnitTimeout(RuntimeError):
    """A storage unit did not answer within the send/recv timeout (TQ's class of the same name)."""


class StorageUnit:
    """`StorageUnitData`: field -> {global index: value}."""

    def __init__(self, unit_id: str):
        self.unit_id = unit_id
        self.field_data: dict[str, dict[int, Any]] = {}

    def put(self, indexes: list[int], data: dict[str, list[Any]]) -> None:
        for name, values in data.items():
            column = self.field_data.setdefault(name, {})
            for i, value in zip(indexes, values):
                column[i] = value

    def get(self, fields: list[str], indexes: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for name in fields:
            if name not in self.field_data:
                raise RuntimeError(
                    f"Error getting data from storage unit {self.unit_id}: RuntimeError: Failed to get data from "
                    f"storage unit {self.unit_id}: StorageUnitData get_data: field '{name}' not found. "
                    f"Available: {list(self.field_data)}"
                )
            column = self.field_data[name]
            missing = [i for i in indexes if i not in column]
            if missing:
                raise StorageKeyNotFoundError(
                    f"Failed to get data from storage unit {self.unit_id}: [TQKeyNotFound] StorageUnitData "
                    f"get_data: key {missing[0]} not found in field '{name}'"
                )
            out[name] = [column[i] for i in indexes]
        return out

    def clear(self, indexes: list[int]) -> None:
        for column in self.field_data.values():
            for i in indexes:
                column.pop(i, None)

    def indexes(self) -> set[int]:
        return {i for column in self.field_data.values() for i in column}


def _rows(values: Any, positions: list[int]) -> list[Any]:
    """One value per row, detached from the caller's tensor (TQ serializes them on the wire)."""
    if isinstance(values, torch.Tensor):
        if values.is_nested:
            unbound = values.unbind()
            return [unbound[p].clone() for p in positions]
        return [values[p].clone() for p in positions]
    if isinstance(values, NonTensorStack):
        items = values.tolist()
        return [items[p] for p in positions]
    return [values[p] for p in positions]


def pack_field_values(values: list[Any]) -> Any:
    """Per-row values as one batch, as TQ's `_pack_field_values`: 0-dim rows stacked, tensors jagged."""
    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        try:
            return torch.nested.as_nested_tensor(values, layout=torch.jagged)
        except (RuntimeError, TypeError):
            try:
                return torch.nested.as_nested_tensor(values, layout=torch.strided)
            except (RuntimeError, TypeError):
                return NonTensorStack(*values)
    return NonTensorStack(*values)


class StorageManager:
    """The client's `storage_manager`: `put_data`, `get_data`, `clear_data` over the units."""

    def __init__(self, client: TQClient):
        self._client = client

    @property
    def _units(self) -> list[StorageUnit]:
        return self._client.tq.units

    def _route(self, indexes: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for pos, gi in enumerate(indexes):
            g = groups.setdefault(gi % len(self._units), ([], []))
            g[0].append(gi)
            g[1].append(pos)
        return groups

    async def _unit_request(self, op: str, unit: int, apply, attempts: int | None = None, **details: Any) -> Any:
        tq = self._client.tq
        attempts = max(1, tq.unit_attempts if attempts is None else attempts)
        for attempt in range(1, attempts + 1):
            request = self._client.request(f"tq.storage.{op}", apply, unit=unit, attempt=attempt, **details)
            try:
                return await reply(tq.env, request, timeout=tq.unit_timeout_s)
            except TimeoutError:
                if attempt >= attempts:
                    raise StorageUnitTimeout(
                        f"no answer in {tq.unit_timeout_s:g}s during {op} to storage unit {unit}"
                    ) from None
        raise AssertionError("unreachable")

    async def put_data(self, data: TensorDict, metadata: BatchMeta) -> None:
        if metadata.size == 0:
            return
        schema = field_schema(data)
        tasks = []
        for unit, (indexes, positions) in self._route(metadata.global_indexes).items():
            rows = {name: _rows(data.get(name), positions) for name in data.keys()}  # noqa: SIM118
            target = self._units[unit]
            tasks.append(
                self._unit_request(
                    "put_data", unit, lambda t=target, i=indexes, r=rows: t.put(i, r), indexes=list(indexes)
                )
            )
        await asyncio.gather(*tasks)
        partition = metadata.partition_ids[0]
        indexes = list(metadata.global_indexes)
        await self._client.controller_request(
            "notify_data_update",
            lambda c: c.notify_data_update(partition, indexes, schema),
            partition=partition,
            indexes=indexes,
        )

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0:
            return TensorDict({}, batch_size=0)
        fields = list(metadata.field_names)
        groups = self._route(metadata.global_indexes)
        tasks = [
            self._unit_request("get_data", unit, lambda t=self._units[unit], i=idx: t.get(fields, i), indexes=list(idx))
            for unit, (idx, _) in groups.items()
        ]
        results = await asyncio.gather(*tasks)
        ordered: dict[str, list[Any]] = {f: [None] * metadata.size for f in fields}
        for (_, positions), got in zip(groups.values(), results):
            for name in fields:
                for k, pos in enumerate(positions):
                    ordered[name][pos] = got[name][k]
        return TensorDict({f: pack_field_values(v) for f, v in ordered.items()}, batch_size=metadata.size)

    async def clear_data(self, metadata: BatchMeta) -> None:
        if metadata.size == 0:
            return
        tasks = [
            self._unit_request(
                "clear_data", unit, lambda t=self._units[unit], i=idx: t.clear(i), attempts=1, indexes=list(idx)
            )
            for unit, (idx, _) in self._route(metadata.global_indexes).items()
        ]
        # TQ gathers with return_exceptions and only logs a unit's failure: the clear "succeeds".
        await asyncio.gather(*tasks, return_exceptions=True)
