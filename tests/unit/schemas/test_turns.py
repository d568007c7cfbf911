"""Engine turns to a call chain: what the converter builds passes linearize, and bad turns are named."""

import pytest
import torch

from schemas.errors import SchemaError
from schemas.group_build import build_group
from schemas.linearize import LinearizedRollout, linearize
from schemas.payload import unpack_payload
from schemas.receipt import Receipt
from schemas.request import RolloutReassemblerActorConfig
from schemas.turns import Turn, turns_to_calls

PAD = 0


def turns(seed=0, versions=(3, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, v in enumerate(versions):
        n_in, n_out = (5, 4) if i == 0 else (2 + i, 3)
        out.append(
            Turn(
                input_ids=torch.randint(1, 100, (n_in,), generator=g),
                output_ids=torch.randint(1, 100, (n_out,), generator=g).tolist(),  # lists are accepted too
                output_logprobs=(-torch.rand(n_out, generator=g)).tolist(),
                weight_version=v,
                invalid_tool_call=i == 1,
                malformed_thinking=i == 2,
            )
        )
    return out


def receipt(rollout_id, calls, index=0, size=1):
    return Receipt(
        rollout_id=rollout_id,
        group_id="g",
        prompt_idx=2,
        rollout_index=index,
        group_size=size,
        reward=1.0,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="test",
        failure_reason=None,
        manifest=tuple(calls),
    )


def test_the_call_chain_is_computed_and_passes_linearize():
    ts = turns()
    segments, calls = turns_to_calls("r0", ts)
    assert [c.call_id for c in calls] == ["c0", "c1", "c2"]
    assert [c.parent_call_id for c in calls] == [None, "c0", "c1"]
    assert [(c.prev_len, c.delta_len, c.cum_len) for c in calls] == [(0, 9, 9), (9, 6, 15), (15, 7, 22)]
    assert [c.staging_key for c in calls] == ["r0/c0", "r0/c1", "r0/c2"]
    assert [c.weight_version for c in calls] == [3, 4, 4]
    assert [(c.invalid_tool_call, c.malformed_thinking) for c in calls] == [(0, 0), (1, 0), (0, 1)]
    result = linearize(receipt("r0", calls), {c.staging_key: s for c, s in zip(calls, segments)})
    assert isinstance(result, LinearizedRollout), result
    assert (result.length, result.min_wv, result.max_wv) == (22, 3, 4)
    assert [m["role"] for m in result.message_log] == ["user", "assistant"] + ["environment", "assistant"] * 2
    for message, turn in zip(result.message_log[1::2], ts):
        assert message["token_ids"].tolist() == list(turn.output_ids)
        assert torch.allclose(message["generation_logprobs"], torch.tensor(turn.output_logprobs))


def test_group_build_gives_the_concatenated_tokens_and_a_loss_mask_on_exactly_the_outputs():
    rollouts = [turns(seed=i) for i in range(2)]
    receipts, segments = [], {}
    for i, ts in enumerate(rollouts):
        segs, calls = turns_to_calls(f"r{i}", ts)
        receipts.append(receipt(f"r{i}", calls, index=i, size=2))
        segments.update({c.staging_key: s for c, s in zip(calls, segs)})
    config = RolloutReassemblerActorConfig(
        partition_id="train",
        staging_partition="staging",
        pad_token_id=PAD,
        router_replay_enabled=False,
        defer_routed_experts_to_policy=False,
        max_seq_len=1000,
    )
    build = build_group(group_id="g", prompt_idx=2, group_size=2, receipts=receipts, segments=segments, config=config)
    assert build.rejection_reasons == (None, None)
    out = unpack_payload(build.fields, build.tags, pad_value_dict={"input_ids": PAD})
    for row, ts in enumerate(rollouts):
        ids = [t for turn in ts for t in [*torch.as_tensor(turn.input_ids).tolist(), *turn.output_ids]]
        mask = [m for turn in ts for m in [False] * len(turn.input_ids) + [True] * len(turn.output_ids)]
        n = len(ids)
        assert out["input_lengths"][row] == n
        assert out["input_ids"][row, :n].tolist() == ids
        assert out["token_mask"][row, :n].tolist() == mask
        assert not out["token_mask"][row, n:].any()
        logprobs = out["generation_logprobs"][row, :n][torch.tensor(mask)]
        assert torch.allclose(logprobs, torch.tensor([lp for turn in ts for lp in turn.output_logprobs]))


def replace_turn(ts, i, **changes):
    fields = {k: getattr(ts[i], k) for k in Turn.__dataclass_fields__}
    fields.update(changes)
    return [*ts[:i], Turn(**fields), *ts[i + 1 :]]


@pytest.mark.parametrize(
    "index,changes,path,reason",
    [
        (1, {"output_logprobs": [-0.1, -0.2]}, "turns[1].output_logprobs", "has 2 entries, output_ids has 3"),
        (2, {"output_logprobs": [-0.1, float("nan"), -0.3]}, "turns[2].output_logprobs", "NaN"),
        (0, {"input_ids": []}, "turns[0].input_ids", "turn 0 must begin with the prompt"),
        (1, {"output_ids": torch.zeros(3)}, "turns[1].output_ids", "integer token ids"),
        (2, {"input_ids": [[1, 2]]}, "turns[2].input_ids", "1-D"),
        (1, {"input_ids": [4, -1]}, "turns[1].input_ids", ">= 0"),
        (1, {"weight_version": -1}, "turns[1].weight_version", ">= 0"),
        (0, {"routed_experts": torch.zeros((3, 2), dtype=torch.int32)}, "turns[0].routed_experts", "3 rows"),
    ],
)
def test_a_tampered_turn_is_refused_naming_the_turn_and_field(index, changes, path, reason):
    ts = replace_turn(turns(), index, **changes)
    with pytest.raises(SchemaError, match=reason) as err:
        turns_to_calls("r0", ts)
    assert err.value.path == path


def test_no_turns_or_no_rollout_id_is_refused():
    with pytest.raises(SchemaError, match="at least one turn"):
        turns_to_calls("r0", [])
    with pytest.raises(SchemaError, match="rollout_id"):
        turns_to_calls("", turns())


def test_routed_experts_cover_input_and_output_rows():
    ts = turns(versions=(1,))
    routed = torch.randint(0, 8, (9, 2), dtype=torch.int32)
    segments, calls = turns_to_calls("r0", replace_turn(ts, 0, routed_experts=routed))
    assert torch.equal(segments[0]["routed_experts"], routed)
    assert isinstance(linearize(receipt("r0", calls), {"r0/c0": segments[0]}), LinearizedRollout)
