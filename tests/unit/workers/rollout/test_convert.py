"""Engine turns to a `StagedRollout`: a valid receipt whose manifest matches its segments; synthetic uses it."""

import pytest
import torch

from schemas.errors import SchemaError
from schemas.linearize import LinearizedRollout, linearize
from schemas.receipt import Receipt
from schemas.turns import Turn
from workers.rollout.convert import failed_rollout, staged_rollout
from workers.rollout.synthetic import SyntheticShape, make_rollout

IDS = dict(rollout_id="g-r1", group_id="g", prompt_idx=0, rollout_index=1, group_size=2)


def two_turns():
    return [
        Turn(input_ids=[5, 6, 7], output_ids=[8, 9], output_logprobs=[-0.5, -0.25], weight_version=2),
        Turn(input_ids=[10], output_ids=[11, 12, 13], output_logprobs=[-1.0, -1.0, -2.0], weight_version=3),
    ]


def test_a_staged_rollout_has_a_valid_receipt_that_round_trips_and_linearizes():
    r = staged_rollout(two_turns(), **IDS, reward=0.5, environment="math", truncated=True)
    assert Receipt.from_bytes(r.receipt.to_bytes()) == r.receipt
    assert r.receipt.truncated and [c.cum_len for c in r.receipt.manifest] == [5, 9]
    segments = {c.staging_key: s for c, s in zip(r.receipt.manifest, r.segments)}
    assert isinstance(linearize(r.receipt, segments), LinearizedRollout)


def test_receipt_fields_are_still_validated_by_name():
    with pytest.raises(SchemaError, match="receipt.rollout_index"):
        staged_rollout(two_turns(), **{**IDS, "group_size": 1}, reward=0.0, environment="math")
    with pytest.raises(SchemaError) as err:
        staged_rollout(
            [two_turns()[0], Turn(input_ids=[1], output_ids=[2, 3], output_logprobs=[-1.0], weight_version=3)],
            **IDS,
            reward=0.0,
            environment="math",
        )
    assert err.value.path == "turns[1].output_logprobs"


def test_a_failed_rollout_has_no_calls_and_stages_nothing():
    r = failed_rollout(**IDS, environment="math", failure_reason="env_timeout")
    assert r.receipt.manifest == () and r.segments == [] and r.receipt.failure_reason == "env_timeout"


def test_synthetic_rollouts_are_built_by_the_converter():
    r = make_rollout("g", 0, 1, 4, shape=SyntheticShape(group_size=2, calls=(3, 3)), seed=1)
    turns = [
        Turn(
            input_ids=s["token_ids"][~s["token_mask"]],
            output_ids=s["token_ids"][s["token_mask"]],
            output_logprobs=s["generation_logprobs"][s["token_mask"]],
            weight_version=c.weight_version,
            invalid_tool_call=c.invalid_tool_call,
            malformed_thinking=c.malformed_thinking,
        )
        for c, s in zip(r.receipt.manifest, r.segments)
    ]
    again = staged_rollout(
        turns, **{**IDS, "rollout_id": r.receipt.rollout_id}, reward=r.receipt.reward, environment="synthetic"
    )
    assert again.receipt == r.receipt
    for a, b in zip(again.segments, r.segments):
        assert all(torch.equal(a[k], b[k]) for k in b)
