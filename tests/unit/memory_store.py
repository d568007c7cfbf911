"""A dict-backed `KVStore` for unit tests of pure logic; integration tests use the real TQ."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import STAGING, TRAIN


class MidClear:
    """Keys whose rows TQ is clearing: marked, not yet deleted (TQ marks a row before it deletes it).

    A store given one still lists them and finds their tags, as TQ's lookups do, but a get of them
    reports them missing, as `TQStore.get` does for rows not ready (`MissingKeysError` naming them).
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.keys = set(keys)


class InMemoryStore:
    """KVStore over a dict, for unit tests of pure logic; integration tests use TQStore.

    `mid_clear` (a test's) names rows caught in the middle of a clear.
    """

    def __init__(self, *, mid_clear: MidClear | None = None, packed: Sequence[str] = (STAGING, TRAIN)) -> None:
        self._rows: dict[str, dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]] = {}
        self.mid_clear = mid_clear if mid_clear is not None else MidClear()
        # As TQStore: rlstream's own partitions hold packed rows, whose get refuses rows of other fields.
        self._packed = frozenset(packed)

    def put(self, partition: str, keys: Sequence[str], fields: TensorDict, tags: Sequence[Mapping[str, Any]]) -> None:
        part = self._rows.setdefault(partition, {})
        for i, key in enumerate(keys):
            # A TensorDict iterates over rows, not field names.
            row = {name: _row(fields.get(name), i).clone() for name in fields.keys()}  # noqa: SIM118
            part[key] = (row, dict(tags[i]) if tags else {})

    def get(self, partition: str, keys: Sequence[str], select: Sequence[str] | None = None) -> TensorDict:
        part = self._rows.get(partition, {})
        missing = [k for k in keys if k not in part or k in self.mid_clear.keys]
        if missing:
            raise MissingKeysError(partition, missing)
        names = list(select) if select is not None else list(part[keys[0]][0])
        out: dict[str, torch.Tensor] = {}
        if partition in self._packed and select is None and any(part[k][0].keys() != set(names) for k in keys):
            raise ValueError(f"rows of TQ partition {partition!r} do not all have the fields {names}")
        packed = partition in self._packed
        for name in names:
            lacking = next((k for k in keys if name not in part[k][0]), None)
            if lacking is not None:
                if packed:  # as TQStore's packed read (`schemas.rowpack.unpack_rows`)
                    raise ValueError(f"field {name!r} is not in row {lacking!r} of TQ partition {partition!r}")
                continue  # as TQ's select_fields: a field some of the rows lack is left out, silently
            rows = [part[k][0][name] for k in keys]
            if packed and len({r.dtype for r in rows}) > 1:
                raise ValueError(f"rows of field {name!r} disagree on their dtype")
            if packed and any(r.dim() == 1 for r in rows):
                # As TQStore's packed read: 1-D rows come back jagged, even all of one length.
                out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
            elif all(r.shape == rows[0].shape for r in rows):
                out[name] = torch.stack(rows)
            else:
                out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
        return TensorDict(out, batch_size=[len(keys)])

    def present(self, partition: str, keys: Sequence[str]) -> set[str]:
        part = self._rows.get(partition, {})
        return {k for k in keys if k in part}

    def list(self, partition: str) -> dict[str, dict[str, Any]]:
        return {k: dict(tag) for k, (_, tag) in self._rows.get(partition, {}).items()}

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        part = self._rows.get(partition, {})
        return {k: dict(part[k][1]) for k in keys if k in part}

    def row_bytes(self, partition: str, keys: Sequence[str]) -> dict[str, int]:
        part = self._rows.get(partition, {})
        return {k: sum(t.numel() * t.element_size() for t in part[k][0].values()) for k in keys if k in part}

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        part = self._rows.get(partition, {})
        for k in keys:
            part.pop(k, None)


def _row(value: torch.Tensor, i: int) -> torch.Tensor:
    if value.is_nested:
        return value.unbind()[i]
    return value[i]
