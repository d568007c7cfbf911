"""Jagged row layout: cut padded rows to their lengths, pad them back, and wrap them as nested
tensors, each with one native kernel per field rather than a Python loop over rows or tokens.
"""

from __future__ import annotations

import torch

try:
    # Constructing the NJT subclass directly skips ~35 us of view bookkeeping per field that
    # nested_tensor_from_jagged spends; the public call is the fallback if the internals move.
    from torch.nested._internal.nested_tensor import NestedTensor as _NestedTensor
except ImportError:  # pragma: no cover - depends on the torch build
    _NestedTensor = None

# torch's own NJT <-> padded kernels (what to_padded_tensor uses); any dtype, any trailing dims.
_TO_JAGGED = getattr(torch.ops.aten, "_padded_dense_to_jagged_forward", None)
_TO_PADDED = getattr(torch.ops.aten, "_jagged_to_padded_dense_forward", None)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Row offsets [N + 1] (starting at 0) from row lengths [N]."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1).to(torch.int64), 0, out=offsets[1:])
    return offsets


def unpad(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `padded` [N, W, *rest] cut to their lengths and concatenated: [total, *rest]."""
    total = int(offsets[-1])
    if padded.shape[0] == 0:
        return padded.new_empty((0, *padded.shape[2:]))
    if total == padded.shape[0] * padded.shape[1]:
        # Every row full: one memcpy instead of the per-element jagged kernel (~4x slower).
        return padded.reshape(total, *padded.shape[2:]).clone(memory_format=torch.contiguous_format)
    if _TO_JAGGED is not None and padded.dim() >= 2:
        dense = padded if padded.dim() > 2 else padded.unsqueeze(-1)
        values = _TO_JAGGED(dense, [offsets], total)
        return values if padded.dim() > 2 else values.squeeze(-1)
    return padded[_row_mask(offsets, padded.shape[1])]  # pragma: no cover


def pad(values: torch.Tensor, offsets: torch.Tensor, width: int, pad_value: float) -> torch.Tensor:
    """Inverse of `unpad`: [total, *rest] back to [N, width, *rest] filled with `pad_value`."""
    n = offsets.numel() - 1
    if values.shape[0] == n * width:
        # Every row full, nothing to pad: one memcpy instead of the per-element jagged kernel.
        return values.reshape(n, width, *values.shape[1:]).clone(
            memory_format=torch.contiguous_format
        )
    if n > 0 and width > 0 and _TO_PADDED is not None:
        dense = values if values.dim() > 1 else values.unsqueeze(-1)
        out = _TO_PADDED(dense, [offsets], [width], float(pad_value))
        return out if values.dim() > 1 else out.squeeze(-1)
    out = torch.full((n, width, *values.shape[1:]), pad_value, dtype=values.dtype)
    out[_row_mask(offsets, width)] = values
    return out


def make_jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A jagged-layout nested tensor over 1-D `values` split at `offsets` (no copy)."""
    if _NestedTensor is not None:
        return _NestedTensor(values, offsets)
    return torch.nested.nested_tensor_from_jagged(values, offsets)  # pragma: no cover


def is_nested(value: object) -> bool:
    """Whether `value` is a nested tensor, without NJT's per-attribute dispatch when avoidable."""
    if _NestedTensor is not None and isinstance(value, _NestedTensor):
        return True
    return isinstance(value, torch.Tensor) and value.is_nested


def jagged_parts(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, offsets from 0) of a nested tensor; copies only when its rows are not contiguous."""
    if _NestedTensor is not None and isinstance(value, _NestedTensor):
        # Plain attribute reads: every NJT property access otherwise costs a __torch_function__.
        values, offsets, gapped = value._values, value._offsets, value._lengths is not None
    elif value.layout == torch.jagged:  # pragma: no cover - only if the internals moved
        values, offsets, gapped = value.values(), value.offsets(), value.lengths() is not None
    else:
        gapped = True
    if not gapped:
        offsets = offsets.to(torch.int64)
        start, end = int(offsets[0]), int(offsets[-1])
        if start != 0 or end != values.shape[0]:
            values, offsets = values[start:end], offsets - start
        return values, offsets
    rows = value.unbind()
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    return torch.cat(rows), offsets_from_lengths(lengths)


def _row_mask(offsets: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width) < offsets.diff().unsqueeze(1)
