"""The packed row layout: fields of several dtypes and shapes round-trip; rows of another key or layout are named."""

import struct

import pytest
import torch

from schemas.errors import LayoutError
from schemas.rowpack import LAYOUT_VERSION, pack_rows, unpack_rows


def _as_tq_returns(packed: torch.Tensor) -> torch.Tensor:
    # TQ serializes each row on its own and rebuilds the batch as one jagged tensor on get.
    return torch.nested.as_nested_tensor(list(packed.unbind()), layout=torch.jagged)


def _fields():
    ids = [torch.arange(n, dtype=torch.int64) * 7 for n in (3, 1, 5)]
    experts = [torch.randint(0, 255, (n, 384), dtype=torch.uint8) for n in (3, 1, 5)]
    return (
        {
            "token_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "mask": torch.nested.nested_tensor([i % 2 == 0 for i in ids], layout=torch.jagged),
            "logprobs": torch.nested.nested_tensor([-i.to(torch.bfloat16) for i in ids], layout=torch.jagged),
            "routed_experts": torch.nested.nested_tensor(experts, layout=torch.jagged),
            "reward": torch.tensor([0.5, -1.0, 2.0]),
            "prompt": torch.arange(6).reshape(3, 2),
        },
        ids,
        experts,
    )


def test_rows_of_every_dtype_and_shape_come_back_as_put():
    fields, ids, experts = _fields()
    keys = ["a", "b", "c"]
    got = unpack_rows("P", keys, _as_tq_returns(pack_rows("P", keys, fields)))
    assert got.foreign == []
    for name in ("token_ids", "mask", "logprobs"):
        for row, want in zip(got.fields[name].unbind(), fields[name].unbind()):
            assert row.dtype == want.dtype and torch.equal(row, want)
    for row, want in zip(got.fields["routed_experts"].unbind(), experts):
        assert row.shape == want.shape and torch.equal(row, want)
    assert torch.equal(got.fields["reward"], fields["reward"])  # 0-dim rows: stacked, as TQ's get
    assert [r.tolist() for r in got.fields["prompt"].unbind()] == [[0, 1], [2, 3], [4, 5]]


def test_one_d_rows_are_views_of_the_fetched_buffer_and_select_cuts_fields():
    fields, _, _ = _fields()
    fetched = _as_tq_returns(pack_rows("P", ["a", "b", "c"], fields))
    got = unpack_rows("P", ["a", "b", "c"], fetched, select=["token_ids"])
    assert set(got.fields) == {"token_ids"}
    assert got.fields["token_ids"]._values.untyped_storage().data_ptr() == fetched.values().untyped_storage().data_ptr()


def test_a_row_of_another_key_or_partition_is_named_not_returned():
    fields, _, _ = _fields()
    fetched = _as_tq_returns(pack_rows("P", ["a", "b", "c"], fields))
    assert unpack_rows("P", ["a", "x", "c"], fetched).foreign == ["x"]
    assert unpack_rows("Q", ["a", "b", "c"], fetched).foreign == ["a", "b", "c"]
    assert unpack_rows("P", ["a", "x", "c"], fetched).fields == {}


def test_a_row_of_an_unknown_layout_is_refused_naming_partition_key_and_layout():
    fields, _, _ = _fields()
    rows = list(pack_rows("P", ["a", "b", "c"], fields).unbind())
    later = rows[1].clone()
    later[:8] = torch.frombuffer(bytearray(struct.pack("<4sHH", b"RLPK", LAYOUT_VERSION + 1, 0)), dtype=torch.uint8)
    with pytest.raises(LayoutError) as err:
        unpack_rows("P", ["a", "b", "c"], torch.nested.as_nested_tensor([rows[0], later, rows[2]], layout=torch.jagged))
    assert "'P'" in str(err.value) and "'b'" in str(err.value) and f"layout {LAYOUT_VERSION + 1}" in str(err.value)
    junk = torch.nested.as_nested_tensor([torch.zeros(16, dtype=torch.uint8)], layout=torch.jagged)
    with pytest.raises(LayoutError, match="magic"):
        unpack_rows("P", ["a"], junk)


def test_a_selected_field_missing_from_a_row_is_named():
    one = torch.nested.nested_tensor([torch.arange(3)], layout=torch.jagged)
    a = pack_rows("P", ["a"], {"token_ids": one})
    b = pack_rows("P", ["b"], {"token_ids": one, "reward": torch.tensor([1.0])})
    both = torch.nested.as_nested_tensor([a.unbind()[0], b.unbind()[0]], layout=torch.jagged)
    with pytest.raises(ValueError, match="'reward' is not in row 'a'"):
        unpack_rows("P", ["a", "b"], both, select=["reward"])
    with pytest.raises(ValueError, match="do not all have"):
        unpack_rows("P", ["a", "b"], both)
