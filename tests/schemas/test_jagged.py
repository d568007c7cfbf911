import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.jagged import jagged_parts, make_jagged, offsets_from_lengths, pad, unpad


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.sampled_from([(), (3,)]),
       st.sampled_from([torch.int64, torch.bool, torch.float16]))
def test_unpad_and_pad_match_a_row_by_row_reference(lengths, rest, dtype):
    width = max(lengths) + 2
    padded = (torch.rand(len(lengths), width, *rest) * 50).to(dtype)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    values = unpad(padded, offsets)
    reference = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    assert torch.equal(values, reference)
    back = pad(values, offsets, width, 1)
    for i, n in enumerate(lengths):
        assert torch.equal(back[i, :n], padded[i, :n])
        assert torch.equal(back[i, n:], torch.ones_like(back[i, n:]))
    assert back.dtype == dtype


def test_make_jagged_and_jagged_parts_round_trip_including_gapped_views():
    values, offsets = torch.arange(10), torch.tensor([0, 3, 3, 10])
    njt = make_jagged(values, offsets)
    assert [r.tolist() for r in njt.unbind()] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8, 9]]
    got_values, got_offsets = jagged_parts(njt)
    assert torch.equal(got_values, values) and torch.equal(got_offsets, offsets)
    # A jagged view with gaps between rows (as narrow() makes) is read row by row.
    gapped = torch.nested.narrow(torch.arange(12).reshape(3, 4), 1, 0, torch.tensor([1, 4, 2]),
                                 layout=torch.jagged)
    got_values, got_offsets = jagged_parts(gapped)
    assert got_values.tolist() == [0, 4, 5, 6, 7, 8, 9]
    assert got_offsets.tolist() == [0, 1, 5, 7]
