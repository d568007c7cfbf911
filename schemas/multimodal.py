"""Packed multimodal model inputs (pixels, image sizes, ...) on the wire, as NeMo RL carries them.

A packed field holds, per training row, a list of tensor segments of any shapes (one per image, or
per model call that ran on media), none for a text row. On the wire (NeMo RL's
`PackedTensor.to_wire`) the field is one jagged tensor whose row i is row i's segments flattened
and concatenated, and the segment shapes ride in row i's tag `<field>__row_shapes` as
`{"shapes": [[...], ...], "pad": bool}` (`pad`: whether the model wants the segments padded to a
common shape before use, which is the consumer's to do). `PackedRows.from_wire` undoes it bit for
bit. A field every row of which is empty is not sent at all (NeMo RL omits it too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from schemas.jagged import is_nested, jagged_rows, make_jagged

ROW_SHAPES_SUFFIX = "__row_shapes"
ROW_GEOMETRY_SHAPES = "shapes"
ROW_GEOMETRY_PAD = "pad"


def row_shapes_key(name: str) -> str:
    """The tag carrying `name`'s per-row segment shapes."""
    return name + ROW_SHAPES_SUFFIX


def is_geometry(value: Any) -> bool:
    """Whether a `<field>__row_shapes` tag value is a packed field's (not a token-aligned field's [len, ...])."""
    return isinstance(value, Mapping) and ROW_GEOMETRY_SHAPES in value


@dataclass(frozen=True, eq=False)
class PackedRows:
    """One packed multimodal field of a batch: per row, its segments (an empty list for a text row)."""

    rows: list[list[torch.Tensor]]
    pad_to_max_shape: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def shapes(self) -> list[list[list[int]]]:
        return [[list(s.shape) for s in row] for row in self.rows]

    def dtype(self) -> torch.dtype | None:
        dtypes = {s.dtype for row in self.rows for s in row}
        if len(dtypes) > 1:
            raise ValueError(f"a packed field's segments must share one dtype, got {sorted(map(str, dtypes))}")
        return next(iter(dtypes), None)

    def to_wire(self) -> torch.Tensor | None:
        """The jagged wire value (row i: its segments flattened, back to back); None if every row is empty."""
        dtype = self.dtype()
        if dtype is None:
            return None
        flat = [s.detach().to("cpu").contiguous().reshape(-1) for row in self.rows for s in row]
        lengths = torch.tensor([sum(s.numel() for s in row) for row in self.rows], dtype=torch.int64)
        offsets = torch.zeros(len(self.rows) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return make_jagged(torch.cat(flat), offsets)

    def row_tags(self, name: str) -> list[dict[str, Any]]:
        """Row i's `<name>__row_shapes` tag entry."""
        key = row_shapes_key(name)
        return [
            {key: {ROW_GEOMETRY_SHAPES: shapes, ROW_GEOMETRY_PAD: self.pad_to_max_shape}} for shapes in self.shapes()
        ]

    @classmethod
    def concat(cls, parts: Sequence[PackedRows]) -> PackedRows:
        pads = {p.pad_to_max_shape for p in parts}
        if len(pads) > 1:
            raise ValueError("packed fields to join disagree on pad_to_max_shape")
        return cls([row for p in parts for row in p.rows], pads.pop() if pads else False)

    @classmethod
    def from_wire(cls, value: torch.Tensor, tags: Sequence[Mapping[str, Any]], name: str) -> PackedRows:
        """The segments of `name` from its wire value and the rows' tags (ValueError if they disagree)."""
        if not is_nested(value):
            raise ValueError(f"{name!r} is not a jagged wire value (got a dense tensor {tuple(value.shape)})")
        rows = jagged_rows(value)
        if rows.rest:
            raise ValueError(f"{name!r} rows must be flat, got rows of shape [*, {rows.rest}]")
        starts, lengths = rows.offsets.tolist(), rows.item_lengths()
        if len(lengths) != len(tags):
            raise ValueError(f"{name!r} has {len(lengths)} rows but {len(tags)} tags")
        key = row_shapes_key(name)
        out, pad = [], None
        for i, (start, length, tag) in enumerate(zip(starts, lengths, tags)):
            geometry = tag.get(key)
            if geometry is None and length == 0:
                out.append([])  # a row of a group without this field (a text group batched with a VLM one)
                continue
            if not is_geometry(geometry):
                raise ValueError(f"row {i} of {name!r} has no {key!r} tag: its segments' shapes are unknown")
            pad = bool(geometry[ROW_GEOMETRY_PAD]) if pad is None else pad
            shapes = [[int(d) for d in shape] for shape in geometry[ROW_GEOMETRY_SHAPES]]
            if sum(math.prod(s) for s in shapes) != length:
                raise ValueError(f"row {i} of {name!r} holds {length} values, its shapes {shapes} describe another")
            segments, at = [], start
            for shape in shapes:
                n = math.prod(shape)
                segments.append(rows.values[at : at + n].reshape(shape))
                at += n
            out.append(segments)
        return cls(out, bool(pad))


def packed_fields(tags: Sequence[Mapping[str, Any]]) -> set[str]:
    """Names of the packed multimodal fields the rows' tags describe (any row's: a batch may join a
    VLM group with a text one)."""
    return {
        key[: -len(ROW_SHAPES_SUFFIX)]
        for tag in tags
        for key, value in tag.items()
        if key.endswith(ROW_SHAPES_SUFFIX) and is_geometry(value)
    }
