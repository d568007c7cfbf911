"""Jagged rows: padded rows viewed as nested tensors without copying, and jagged rows padded back
by one native call per field (a memcpy and a fill per row), numpy when the copier is not built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

try:
    # Constructing the NJT subclass directly skips the view bookkeeping that
    # nested_tensor_from_jagged spends per field; the public call is the fallback.
    from torch.nested._internal.nested_tensor import NestedTensor as _NestedTensor
except ImportError:  # pragma: no cover - depends on the torch build
    _NestedTensor = None

try:
    from schemas import _rowcopy  # built from _rowcopy.c at install; optional
except ImportError:  # pragma: no cover - no C compiler where this was installed
    _rowcopy = None

# dtype -> same-width integer dtype numpy can hold (None: numpy takes it as it is).
_NUMPY_VIEW: dict[torch.dtype, torch.dtype | None] = {}
_FILL_ITEMS: dict[tuple[torch.dtype, str], bytes] = {}
_ROW_STARTS: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def native_row_copier() -> bool:
    """Whether rows are padded by the C copier built at install, rather than by numpy."""
    return _rowcopy is not None


def per_token_items(name: str, rest: tuple[int, ...]) -> int:
    """The items one token of field `name` holds (`rest`: its per-token shape); ValueError if none:
    rows of zero items per token all lie at offset 0 of their values, so no reader can tell them apart."""
    items = math.prod(rest)
    if items == 0:
        raise ValueError(
            f"{name} holds nothing per token (per-token shape {rest}; a [delta_len, k] field needs k >= 1)"
        )
    return items


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Row offsets [N + 1] (starting at 0) from row lengths [N]."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1).to(torch.int64), 0, out=offsets[1:])
    return offsets


def make_jagged(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """A jagged nested tensor over 1-D `values`: row i starts at offsets[i] and runs to
    offsets[i + 1], or for `lengths[i]` elements when given (rows may then have gaps). No copy."""
    if _NestedTensor is not None:
        return _NestedTensor(values, offsets, lengths=lengths)
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths)  # pragma: no cover


class _Ragged(NamedTuple):
    """Everything but the values of a 1-D-rows NJT: what NestedTensor.__new__ derives per call
    (size and strides stay empty where the fast builder is unavailable)."""

    offsets: torch.Tensor
    lengths: torch.Tensor | None
    size: tuple
    strides: tuple


def _fast_njt_builder():
    """(ragged, build): `ragged(offsets, lengths)` derives the ragged size and strides once;
    `build(values, r)` wraps 1-D values with them, for about half of NestedTensor()'s ~13 us.

    Every field of a group shares the rows, so the symbolic ragged size is derived once per
    group rather than once per field. The builder is checked once against the public
    constructor; any mismatch or error (another torch) returns None and callers use that.
    """
    if _NestedTensor is None:  # pragma: no cover
        return None
    from torch._C import DispatchKey, DispatchKeySet
    from torch.nested._internal.nested_tensor import get_tensor_symint

    keys = DispatchKeySet(DispatchKey.NestedTensor).add(DispatchKey.AutogradNestedTensor)

    def ragged(offsets: torch.Tensor, lengths: torch.Tensor | None) -> _Ragged:
        size = get_tensor_symint(offsets if lengths is None else lengths, coeff=1)
        # NestedTensor.__new__ gives 1-D values the strides (size * 1, 1); size * 1 is size.
        return _Ragged(offsets, lengths, (offsets.shape[0] - 1, size), (size, 1))

    def build(values: torch.Tensor, r: _Ragged) -> torch.Tensor:
        njt = torch.Tensor._make_wrapper_subclass(
            _NestedTensor,
            r.size,
            r.strides,
            0,
            torch.contiguous_format,
            values.dtype,
            torch.jagged,
            values.device,
            False,
            False,
            "sizes",
            False,
            True,
            keys,
            storage_size=values.untyped_storage().size(),
        )
        njt._ragged_idx, njt._size, njt._strides = 1, r.size, r.strides
        _NestedTensor.__init__(njt, values, r.offsets, lengths=r.lengths)
        return njt

    try:
        for offsets, lengths in ((torch.tensor([0, 3, 7]), torch.tensor([2, 4])), (torch.tensor([0, 3, 7]), None)):
            values = torch.arange(7, dtype=torch.int16)
            fast = build(values, ragged(offsets, lengths))
            public = _NestedTensor(values, offsets, lengths=lengths)
            same = (
                fast.shape == public.shape
                and fast.stride() == public.stride()
                and fast.dtype == public.dtype
                and fast.layout == public.layout
                and [r.tolist() for r in fast.unbind()] == [r.tolist() for r in public.unbind()]
            )
            if not same:
                return None
    except Exception:  # pragma: no cover - only on a torch whose internals moved
        return None
    return ragged, build


_FAST_NJT = _fast_njt_builder()


class JaggedLayout:
    """Where the rows of padded [N, W, *rest] fields lie once viewed as jagged 1-D rows: one
    offsets and one lengths tensor per row size, shared by every field of that size so that they
    share one ragged dimension."""

    def __init__(self, lengths: torch.Tensor, width: int, *, full: bool) -> None:
        """`lengths` [N] int64 tokens per row; `full` says every one is `width`, so no gaps."""
        self.lengths, self.width, self.full = lengths, width, full
        self._rows: dict[tuple, _Ragged] = {}

    def view(self, padded: torch.Tensor) -> torch.Tensor:
        """Rows of `padded` cut to their lengths and flattened to 1-D, as a jagged view of the
        same memory (copied only if `padded` is not contiguous)."""
        per_token = math.prod(padded.shape[2:])
        device = padded.device
        rows = self._rows.get((per_token, device))
        if rows is None:
            offsets = _row_starts(padded.shape[0], self.width * per_token, device)
            # Rows shorter than the stride leave gaps; TQ's put serializes each row on its own,
            # so the gaps are never copied and nothing needs cutting here.
            lengths = None if self.full else (self.lengths if per_token == 1 else self.lengths * per_token).to(device)
            rows = _FAST_NJT[0](offsets, lengths) if _FAST_NJT is not None else (_Ragged(offsets, lengths, (), ()))
            self._rows[(per_token, device)] = rows
        values = padded.contiguous().view(-1)  # the fast wrapper assumes unit stride
        if _FAST_NJT is not None:
            return _FAST_NJT[1](values, rows)
        return make_jagged(values, rows.offsets, rows.lengths)  # pragma: no cover


def jagged_at(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`make_jagged` with row lengths, for contiguous 1-D `values`, at about half its cost (no copy)."""
    if _FAST_NJT is None or values.dim() != 1 or not values.is_contiguous():
        return make_jagged(values, offsets, lengths)
    return _FAST_NJT[1](values, _FAST_NJT[0](offsets, lengths))


def jagged_views(values: Mapping[str, torch.Tensor], offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """1-D `values` whose rows lie one after another, row i from offsets[i] to offsets[i + 1], as jagged
    tensors over the same memory that share one ragged dimension (fields of one group's rows)."""
    if _FAST_NJT is None:  # pragma: no cover - depends on the torch build
        return {name: make_jagged(v.contiguous(), offsets) for name, v in values.items()}
    rows = _FAST_NJT[0](offsets, None)
    return {name: _FAST_NJT[1](v.contiguous(), rows) for name, v in values.items()}


def concat_batches(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The rows of several batches of the same fields, one batch after another (one copy of the
    values per field); None if they do not line up (other fields or dtypes, jagged rows with gaps).

    What `torch.cat` of their TensorDicts gives, at a fraction of its cost: a nested tensor's cat
    dispatches per field and per part; here each jagged field is one concatenation of its values,
    sharing one offsets tensor with the other fields whose rows have the same lengths.
    """
    if not parts or any(p.keys() != parts[0].keys() for p in parts):
        return None
    out: dict[str, torch.Tensor] = {}
    shared: dict[tuple[int, ...], torch.Tensor] = {}
    for name, first in parts[0].items():
        values = [p[name] for p in parts]
        if any(v.dtype != first.dtype for v in values):
            return None
        if not is_nested(first):
            if any(is_nested(v) or v.shape[1:] != first.shape[1:] for v in values):
                return None
            out[name] = torch.cat(values)
            continue
        rows = [jagged_rows(v) if is_nested(v) else None for v in values]
        if any(r is None or r.lengths is not None or r.scale != 1 or r.rest for r in rows):
            return None
        lengths = tuple(n for r in rows for n in r.item_lengths())
        offsets = shared.get(lengths)
        if offsets is None:
            offsets = shared[lengths] = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
        flat = [r.values[int(r.offsets[0]) : int(r.offsets[-1])] for r in rows]
        out[name] = jagged_views({name: torch.cat(flat)}, offsets)[name]
    return out


def _row_starts(n: int, stride: int, device: torch.device) -> torch.Tensor:
    """Offsets 0, stride, ..., n * stride, shared by every group of that shape (never mutated:
    a full group's nested tensors take them as their ragged source, so groups share its size)."""
    key = (n, stride, device)
    starts = _ROW_STARTS.get(key)
    if starts is None:
        if len(_ROW_STARTS) >= 256:
            _ROW_STARTS.clear()
        starts = _ROW_STARTS[key] = (
            torch.arange(0, (n + 1) * stride, stride, device=device)
            if stride
            else torch.zeros(n + 1, dtype=torch.int64, device=device)
        )
    return starts


def is_nested(value: object) -> bool:
    """Whether `value` is a nested tensor, without NJT's per-attribute dispatch when avoidable."""
    if _NestedTensor is not None and isinstance(value, _NestedTensor):
        return True
    return isinstance(value, torch.Tensor) and value.is_nested


class JaggedRows(NamedTuple):
    """Where the rows of a nested tensor lie in its 1-D values, in items of those values."""

    values: torch.Tensor
    offsets: torch.Tensor  # int64 row starts in `scale`-item units; N + 1 of them without lengths
    lengths: torch.Tensor | None  # int64 row lengths in the same units, or None: the differences
    scale: int
    rest: tuple[int, ...]  # shape of one token of a row

    def item_lengths(self) -> list[int]:
        """Each row's length in items of `values`."""
        if self.lengths is not None:
            lengths = self.lengths.tolist()
        else:
            offsets = self.offsets.tolist()
            lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        return lengths if self.scale == 1 else [n * self.scale for n in lengths]


def jagged_rows(value: torch.Tensor) -> JaggedRows:
    """The rows of a nested tensor as views when its layout allows, else copied row by row."""
    if _NestedTensor is not None and type(value) is _NestedTensor and value._ragged_idx == 1:
        # Plain attribute reads: every NJT property access otherwise costs a __torch_function__.
        values = value._values
        if values.dim() == 1 and values.is_contiguous():
            return JaggedRows(values, value._offsets, value._lengths, 1, ())
        if values.is_contiguous():
            rest = tuple(values.shape[1:])
            return JaggedRows(values.reshape(-1), value._offsets, value._lengths, math.prod(rest), rest)
    rows = value.unbind()
    rest = tuple(rows[0].shape[1:]) if rows else ()
    flat = [row.reshape(-1) for row in rows]
    lengths = torch.tensor([int(row.shape[0]) for row in flat], dtype=torch.int64)
    values = torch.cat(flat) if rows else torch.empty(0, dtype=value.dtype)
    return JaggedRows(values, offsets_from_lengths(lengths), None, 1, rest)


def pad_rows(rows: JaggedRows, row_width: int, fill: float) -> torch.Tensor:
    """The rows padded with `fill` to `row_width` items each: a new [N, row_width] tensor."""
    values, offsets, lengths = rows.values, rows.offsets, rows.lengths
    if values.dim() != 1 or offsets.dim() != 1 or (lengths is not None and lengths.dim() != 1):
        raise ValueError("jagged values, offsets and lengths must be 1-D")
    n = offsets.shape[0] - 1 if lengths is None else lengths.shape[0]
    if lengths is not None and offsets.shape[0] < n:
        raise ValueError(f"{offsets.shape[0]} row offsets for {n} row lengths")
    out = torch.empty((n, row_width), dtype=values.dtype, device=values.device)
    if _rowcopy is None or not values.is_cpu:
        return _pad_rows_fallback(rows, out, fill)
    # The native copier reads raw addresses: hold contiguous int64 copies while it runs.
    offsets, values = _int64(offsets), values.contiguous()
    lengths = None if lengths is None else _int64(lengths)
    _rowcopy.pad_rows(
        out.data_ptr(),
        out.numel(),
        values.data_ptr(),
        values.shape[0],
        offsets.data_ptr(),
        n,
        0 if lengths is None else lengths.data_ptr(),
        rows.scale,
        row_width,
        _fill_item(values.dtype, fill),
    )
    return out


def stack_padded(rows: Sequence[torch.Tensor], width: int, fill: float) -> torch.Tensor:
    """Tensors [L_i, *rest] of one dtype stacked into a new [N, width, *rest] padded with `fill`."""
    if not rows:
        raise ValueError("stack_padded needs at least one row")
    rest = tuple(rows[0].shape[1:])
    for i, row in enumerate(rows):
        if tuple(row.shape[1:]) != rest or row.shape[0] > width:
            raise ValueError(
                f"row {i} of shape {tuple(row.shape)} does not fit width {width} with per-token shape {rest}"
            )
    lengths = torch.tensor([int(row.shape[0]) for row in rows], dtype=torch.int64)
    values = torch.cat([row.reshape(-1) for row in rows])
    per_token = math.prod(rest)
    jagged = JaggedRows(values, offsets_from_lengths(lengths), None, per_token, rest)
    return pad_rows(jagged, width * per_token, fill).view(len(rows), width, *rest)


def _pad_rows_fallback(rows: JaggedRows, out: torch.Tensor, fill: float) -> torch.Tensor:
    # Without the native copier (no C compiler at install, or off-CPU tensors): the same checks,
    # then numpy concatenate on CPU or a copy per row elsewhere.
    n, row_width = out.shape
    starts = rows.offsets.tolist()[:n]
    if rows.scale != 1:
        starts = [s * rows.scale for s in starts]
    lengths = rows.item_lengths()
    total = rows.values.shape[0]
    for i, (start, length) in enumerate(zip(starts, lengths)):
        if start < 0 or length < 0 or length > row_width or start + length > total:
            raise ValueError(f"row {i} lies outside its values or is wider than {row_width}")
    if n == 0 or row_width == 0:
        return out
    if out.device.type != "cpu":
        out.fill_(fill)
        for i, (start, length) in enumerate(zip(starts, lengths)):
            out[i, :length] = rows.values[start : start + length]
        return out
    src = _as_numpy(rows.values)
    pad = _as_numpy(torch.full((row_width - min(lengths),), fill, dtype=out.dtype))
    pieces = [piece for s, k in zip(starts, lengths) for piece in (src[s : s + k], pad[: row_width - k])]
    np.concatenate(pieces, out=_as_numpy(out).reshape(-1))
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    if t.dtype is torch.int64 and t.is_contiguous():
        return t
    return t.to(torch.int64).contiguous()


def _fill_item(dtype: torch.dtype, fill: float) -> bytes:
    """One item of `dtype` holding `fill`, as bytes (cached: a group pads with few values)."""
    key = (dtype, repr(fill))  # repr: 0.0 and -0.0 compare equal but are different items
    item = _FILL_ITEMS.get(key)
    if item is None:
        item = _as_numpy(torch.full((1,), fill, dtype=dtype)).tobytes()
        if len(_FILL_ITEMS) < 1024:
            _FILL_ITEMS[key] = item
    return item


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor, reinterpreting dtypes numpy lacks (bfloat16, float8)."""
    try:
        view_as = _NUMPY_VIEW[t.dtype]
    except KeyError:
        view_as = _NUMPY_VIEW.setdefault(t.dtype, _numpy_view_dtype(t.dtype))
    if t.requires_grad:
        t = t.detach()
    return (t if view_as is None else t.view(view_as)).numpy()


def _numpy_view_dtype(dtype: torch.dtype) -> torch.dtype | None:
    try:
        torch.empty(0, dtype=dtype).numpy()
        return None
    except TypeError:
        return _INT_OF_SIZE[torch.empty(0, dtype=dtype).element_size()]
