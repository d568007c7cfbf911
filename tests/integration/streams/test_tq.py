"""The TQ client against real TransferQueue on a local Ray instance."""

import pytest
import torch
from tensordict import TensorDict

from streams.tq import STAGING, MissingKeysError


def test_jagged_rows_round_trip_with_tags_field_selection_list_and_clear(tq_store, unique):
    lengths = [3, 1, 7, 4]
    ids = [torch.randint(0, 50_000, (n,), dtype=torch.int64) for n in lengths]
    lps = [torch.randn(n, dtype=torch.float32) for n in lengths]
    fields = TensorDict(
        {
            "token_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "generation_logprobs": torch.nested.nested_tensor(lps, layout=torch.jagged),
            "reward": torch.tensor([0.5, -1.0, 2.0, 0.0]),
        },
        batch_size=[4],
    )
    keys = [f"{unique}/call{i}" for i in range(4)]
    tags = [{"rollout_id": unique, "call": i, "weight_version": 7} for i in range(4)]
    tq_store.put(STAGING, keys, fields, tags)

    order = [2, 0, 3, 1]
    got = tq_store.get(STAGING, [keys[i] for i in order], select=["token_ids", "reward"])
    assert set(got.keys()) == {"token_ids", "reward"}
    for row, i in zip(got["token_ids"].unbind(), order):
        assert torch.equal(row, ids[i])
    assert torch.equal(got["reward"], fields["reward"][order])
    full = tq_store.get(STAGING, keys)
    for row, lp in zip(full["generation_logprobs"].unbind(), lps):
        assert torch.equal(row, lp)

    listed = tq_store.list(STAGING)
    for k, t in zip(keys, tags):
        assert listed[k] == t

    tq_store.clear(STAGING, keys)
    assert tq_store.present(STAGING, keys) == set()
    with pytest.raises(MissingKeysError) as err:
        tq_store.get(STAGING, keys[:1])
    assert keys[0] in str(err.value)


def test_get_names_the_missing_key_instead_of_returning_fewer_rows(tq_store, unique):
    fields = TensorDict({"x": torch.arange(2).reshape(2, 1)}, batch_size=[2])
    tq_store.put(STAGING, [f"{unique}/a", f"{unique}/b"], fields, [{}, {}])
    with pytest.raises(MissingKeysError) as err:
        tq_store.get(STAGING, [f"{unique}/a", f"{unique}/nope", f"{unique}/b"])
    assert err.value.missing == [f"{unique}/nope"]
    tq_store.clear(STAGING, [f"{unique}/a", f"{unique}/b"])
