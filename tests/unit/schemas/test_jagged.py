import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import jagged
from schemas.jagged import (
    JaggedLayout,
    JaggedRows,
    jagged_rows,
    make_jagged,
    native_row_copier,
    offsets_from_lengths,
    pad_rows,
    stack_padded,
)

DTYPES = [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
]


@pytest.fixture(params=["native", "numpy"])
def copier(request, monkeypatch):
    """Run a test with the C row copier and again with the numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setattr(jagged, "_rowcopy", None)
    elif not native_row_copier():
        pytest.fail("schemas._rowcopy was not built at install (no C compiler?)")
    return request.param


def _values(n, dtype):
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    return (torch.arange(n) % 97 + 1).to(dtype)


def test_the_native_row_copier_is_built():
    # The install compiles schemas/_rowcopy.c; without it rows still pad, at about half speed.
    assert native_row_copier(), "schemas._rowcopy was not built at install (no C compiler?)"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pad_rows_matches_a_row_by_row_reference(data):
    # Hypothesis and function-scoped fixtures do not mix: each example tries both copiers.
    n = data.draw(st.integers(0, 6))
    scale = data.draw(st.sampled_from([1, 1, 3]))
    dtype = data.draw(st.sampled_from(DTYPES))
    lengths = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    gaps = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    with_lengths = data.draw(st.booleans()) or any(gaps)
    starts, at = [], data.draw(st.integers(0, 3))
    for length, gap in zip(lengths, gaps):
        starts.append(at)
        at += length + gap
    values = _values((at + data.draw(st.integers(0, 3))) * scale, dtype)
    width = max(lengths, default=0) + data.draw(st.integers(0, 3))
    fill = data.draw(
        st.sampled_from(
            [0, 1, -1, 99, 1.5] if dtype.is_floating_point else [0, 1] if dtype == torch.bool else [0, 1, 99]
        )
    )
    if dtype in (torch.uint8,) and fill == -1:
        fill = 7
    if with_lengths:
        rows = JaggedRows(
            values, torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64), scale, ()
        )
    else:
        rows = JaggedRows(values, torch.tensor([*starts, at], dtype=torch.int64), None, scale, ())
    expected = torch.full((n, width * scale), fill, dtype=dtype)
    for i, (start, length) in enumerate(zip(starts, lengths)):
        expected[i, : length * scale] = values[start * scale : (start + length) * scale]
    saved = jagged._rowcopy
    try:
        for copier in [saved, None] if saved is not None else [None]:
            jagged._rowcopy = copier
            got = pad_rows(rows, width * scale, fill)
            assert got.dtype == dtype and got.shape == (n, width * scale)
            assert torch.equal(got, expected), (copier, got, expected)
    finally:
        jagged._rowcopy = saved


@pytest.mark.parametrize(
    "case",
    [
        ("row past the end", [0, 4], [3, 3], 8, "row 1"),
        ("row wider than the output", [0], [5], 4, "row 0"),
        ("negative start", [-1], [2], 4, "row 0"),
    ],
)
def test_pad_rows_rejects_rows_outside_their_values(copier, case):
    _, starts, lengths, width, where = case
    rows = JaggedRows(torch.arange(6), torch.tensor(starts), torch.tensor(lengths), 1, ())
    with pytest.raises(ValueError, match=where):
        pad_rows(rows, width, 0)


def test_pad_rows_needs_an_offset_per_length(copier):
    rows = JaggedRows(torch.arange(6), torch.tensor([0]), torch.tensor([2, 2]), 1, ())
    with pytest.raises(ValueError, match="1 row offsets for 2 row lengths"):
        pad_rows(rows, 4, 0)


def test_layout_views_rows_without_copying_and_shares_one_ragged_dim():
    lengths = torch.tensor([3, 1, 4])
    layout = JaggedLayout(lengths, 4, full=False)
    ids = torch.arange(12).reshape(3, 4)
    mask = ids % 2 == 0
    experts = torch.arange(24, dtype=torch.int16).reshape(3, 4, 2)
    viewed = {name: layout.view(t) for name, t in (("ids", ids), ("mask", mask), ("experts", experts))}
    for name, source in (("ids", ids), ("mask", mask), ("experts", experts)):
        rows = viewed[name].unbind()
        assert [r.tolist() for r in rows] == [
            source[i, :n].reshape(-1).tolist() for i, n in enumerate(lengths.tolist())
        ]
        assert viewed[name]._values.data_ptr() == source.data_ptr()  # a view, not a copy
    # Fields of one row width have one ragged dimension, so torch sees them as aligned.
    assert viewed["ids"].shape[1] == viewed["mask"].shape[1]
    assert viewed["ids"].shape[1] != viewed["experts"].shape[1]


def test_layout_of_full_rows_has_no_gaps_and_copies_a_non_contiguous_input():
    layout = JaggedLayout(torch.tensor([2, 2]), 2, full=True)
    source = torch.arange(8).reshape(2, 4)[:, ::2]  # not contiguous
    view = layout.view(source)
    assert view._lengths is None
    assert [r.tolist() for r in view.unbind()] == [[0, 2], [4, 6]]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_jagged_rows_reads_every_nested_layout(copier):
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    contiguous = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    strided = torch.nested.nested_tensor(rows)  # the older strided layout: read row by row
    gapped = make_jagged(torch.tensor([1, 2, 3, 9, 4, 9]), torch.tensor([0, 4, 6]), torch.tensor([3, 1]))
    two_d = torch.nested.as_nested_tensor([torch.ones(2, 3), torch.zeros(1, 3)], layout=torch.jagged)
    for nested in (contiguous, strided, gapped):
        got = jagged_rows(nested)
        assert got.rest == ()
        assert pad_rows(got, 4, -1).tolist() == [[1, 2, 3, -1], [4, -1, -1, -1]]
    got = jagged_rows(two_d)
    assert got.rest == (3,) and got.scale == 3 and got.item_lengths() == [6, 3]
    assert pad_rows(got, 6, 5).tolist() == [[1.0] * 6, [0.0] * 3 + [5.0] * 3]


def test_stack_padded_pads_rows_of_any_trailing_shape(copier):
    rows = [torch.ones(2, 2, dtype=torch.int16), torch.full((1, 2), 7, dtype=torch.int16)]
    out = stack_padded(rows, 3, 0)
    assert out.shape == (2, 3, 2) and out.dtype == torch.int16
    assert out.tolist() == [[[1, 1], [1, 1], [0, 0]], [[7, 7], [0, 0], [0, 0]]]
    with pytest.raises(ValueError, match="row 1 of shape"):
        stack_padded([torch.ones(2, 2), torch.ones(2, 3)], 3, 0)


def test_the_fast_nested_constructor_agrees_with_torch():
    # On the pinned torch the fast path is in use; its own import-time check compares it with
    # NestedTensor() and falls back when they differ.
    assert jagged._FAST_NJT is not None
    ragged, build = jagged._FAST_NJT
    offsets, lengths = offsets_from_lengths(torch.tensor([2, 0, 3])), torch.tensor([1, 0, 3])
    values = torch.arange(5.0)
    fast = build(values, ragged(offsets, lengths))
    public = torch.nested.nested_tensor_from_jagged(values, offsets, lengths)
    assert fast.shape[0] == public.shape[0] and fast.dtype == public.dtype
    assert [r.tolist() for r in fast.unbind()] == [r.tolist() for r in public.unbind()]


def test_pad_rows_rejects_offsets_that_would_overflow(copier):
    rows = JaggedRows(torch.arange(6), torch.tensor([5, -(2**63)]), None, 1, ())
    with pytest.raises(ValueError, match="row 0"):
        pad_rows(rows, 4, 0)


def test_pad_rows_of_zero_width(copier):
    rows = JaggedRows(torch.arange(6), torch.tensor([0, 0, 0]), None, 1, ())
    assert pad_rows(rows, 0, 0).shape == (2, 0)


def test_fill_values_that_compare_equal_keep_their_own_bits(copier):
    rows = JaggedRows(torch.ones(2), torch.tensor([0, 1, 2]), None, 1, ())
    assert pad_rows(rows, 2, 0.0)[0, 1].item() == 0.0
    negative_zero = pad_rows(rows, 2, -0.0)[0, 1]
    assert torch.signbit(negative_zero)


def test_layout_flattens_a_strided_trailing_dim_into_unit_stride_values():
    layout = JaggedLayout(torch.tensor([2, 1]), 2, full=False)
    experts = torch.arange(16).reshape(2, 2, 4)[:, :, ::2]  # reshape(-1) alone keeps stride 2
    view = layout.view(experts)
    assert view._values.stride() == (1,)
    assert [r.tolist() for r in view.unbind()] == [[0, 2, 4, 6], [8, 10]]


def _batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    ids = torch.randint(0, 100, (sum(lengths),), generator=gen)
    return {
        "ids": jagged.jagged_views({"v": ids}, offsets)["v"],
        "mask": jagged.jagged_views({"v": ids % 2 == 0}, offsets)["v"],
        "reward": torch.rand(len(lengths), generator=gen),
        "prompt": torch.randint(0, 9, (len(lengths), 3), generator=gen),
    }


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=5), st.integers(0, 99))
def test_concatenated_batches_hold_every_part_s_rows_in_order(parts_lengths, seed):
    parts = [_batch(lengths, seed + i) for i, lengths in enumerate(parts_lengths)]
    joined = jagged.concat_batches(parts)
    assert joined is not None and list(joined) == list(parts[0])
    for name in parts[0]:
        want = [r for p in parts for r in (p[name].unbind() if p[name].is_nested else p[name])]
        got = list(joined[name].unbind()) if joined[name].is_nested else list(joined[name])
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_batches_that_do_not_line_up_are_not_concatenated():
    a, b = _batch([2, 3], 0), _batch([1], 1)
    assert jagged.concat_batches([a, {k: v for k, v in b.items() if k != "mask"}]) is None
    assert jagged.concat_batches([a, {**b, "reward": b["reward"].double()}]) is None
    gapped = make_jagged(torch.arange(10), torch.tensor([0, 5]), torch.tensor([2]))  # a row with a gap after it
    assert jagged.concat_batches([a, {**b, "ids": gapped}]) is None
