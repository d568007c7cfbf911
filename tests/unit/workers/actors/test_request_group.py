"""The Ray face's request → group: one rollout may not fill two slots (it would be trained twice)."""

import pytest

from schemas.errors import SchemaError
from schemas.request import ReassemblyRequest
from workers.actors.reassembler import request_group
from workers.rollout.synthetic import SyntheticShape, make_group

SHAPE = SyntheticShape(group_size=3, calls=(1, 1), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))


def _request(rollout_ids, receipts):
    n = len(rollout_ids)
    return ReassemblyRequest(
        group_id="g", rollout_ids=tuple(rollout_ids), canonical_sample_ids=tuple(f"g_g{i}" for i in range(n)),
        receipts=tuple(receipts), rewards=(1.0,) * n, fallback_weight_version=0, prompt_idx=0, mask_sample=(True,) * n,
    )  # fmt: skip


def test_a_group_from_distinct_rollouts():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    group = request_group(_request([r.receipt.rollout_id for r in rollouts], [r.receipt.to_dict() for r in rollouts]))
    assert sorted(group.receipts) == [0, 1, 2] and group.group_size == 3


def test_a_rollout_id_named_twice_is_refused_naming_it_and_its_slots():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    ids = [rollouts[0].receipt.rollout_id, rollouts[1].receipt.rollout_id, rollouts[0].receipt.rollout_id]
    with pytest.raises(SchemaError, match=r"rpc\.rollout_ids: .*'g-r0'.*slots 0 and 2"):
        request_group(_request(ids, [r.receipt.to_dict() for r in rollouts]))


def test_one_rlstream_receipt_in_two_slots_is_refused_naming_both():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    receipts = [rollouts[0].receipt.to_dict(), rollouts[1].receipt.to_dict(), rollouts[0].receipt.to_dict()]
    with pytest.raises(SchemaError, match=r"rpc\.receipts\[2\]\.rollout_id: .*'g-r0'.*receipts\[0\]"):
        request_group(_request(["a", "b", "c"], receipts))
