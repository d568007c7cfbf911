import math

import pytest

from schemas.errors import SchemaError
from schemas.request import ReassemblyRequest, RolloutReassemblerActorConfig


def request(**changes):
    fields = dict(
        group_id="g",
        rollout_ids=("r0", "r1"),
        canonical_sample_ids=("g_g0", "g_g1"),
        receipts=(None, {"rollout_id": "r1"}),
        rewards=(0.0, 1.0),
        fallback_weight_version=2,
        prompt_idx=0,
        mask_sample=(True, False),
    )
    fields.update(changes)
    return ReassemblyRequest(**fields)


@pytest.mark.parametrize("field", ["canonical_sample_ids", "receipts", "rewards", "mask_sample"])
def test_parallel_tuples_must_have_one_length(field):
    short = getattr(request(), field)[:1]
    with pytest.raises(SchemaError) as info:
        request(**{field: short})
    assert info.value.path == f"reassembly_request.{field}"


def test_request_round_trips_and_defaults():
    message = request()
    assert message.loss_multiplier == 1.0
    assert ReassemblyRequest.from_bytes(message.to_bytes()) == message


def test_request_rejects_a_nan_reward():
    with pytest.raises(SchemaError) as info:
        request(rewards=(0.0, math.nan))
    assert info.value.path == "reassembly_request.rewards[1]"


def test_config_round_trips_and_checks():
    config = RolloutReassemblerActorConfig("train", "staging", 0, True, False, 4096)
    assert RolloutReassemblerActorConfig.from_bytes(config.to_bytes()) == config
    with pytest.raises(SchemaError) as info:
        RolloutReassemblerActorConfig("train", "staging", 0, True, False, 0)
    assert info.value.path == "reassembler_config.max_seq_len"
