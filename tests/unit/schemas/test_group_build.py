import msgspec
import pytest
import torch

from schemas.group_build import build_group
from schemas.payload import unpack_payload
from schemas.request import RolloutReassemblerActorConfig
from tests.unit.schemas.chains import make_rollout

PAD = 7


def config(**changes):
    fields = dict(
        partition_id="train",
        staging_partition="staging",
        pad_token_id=PAD,
        router_replay_enabled=False,
        defer_routed_experts_to_policy=False,
        max_seq_len=64,
    )
    fields.update(changes)
    return RolloutReassemblerActorConfig(**fields)


def group(specs, **kw):
    """specs[i] = calls of rollout i, or None for a missing receipt."""
    receipts, segments = [], {}
    for i, calls in enumerate(specs):
        if calls is None:
            receipts.append(None)
            continue
        receipt, segs = make_rollout(
            calls,
            rollout_id=f"r{i}",
            rollout_index=i,
            group_size=len(specs),
            prompt_idx=3,
            reward=float(i),
            weight_versions=[10 + i] * len(calls),
            seed=i,
            **kw,
        )
        receipts.append(receipt)
        segments.update(segs)
    return receipts, segments


def test_a_group_always_yields_n_rows_with_placeholders_for_failures():
    receipts, segments = group([[(4, 3), (2, 2)], None, [(4, 5)], [(4, 1)]])
    receipts[3] = msgspec.structs.replace(receipts[3], failure_reason="env_timeout")
    build = build_group(group_id="g", prompt_idx=3, group_size=4, receipts=receipts, segments=segments, config=config())
    assert build.rejection_reasons == (None, "missing_receipt", None, "rollout_failed")
    assert build.sample_ids == ["g_g0", "g_g1", "g_g2", "g_g3"]
    assert (build.valid_row_count, build.total_row_count, build.all_failed) == (2, 4, False)
    assert (build.group_min_wv, build.group_max_wv) == (10, 12)
    assert build.canonical_output_tokens == 11 + 9
    assert all(tag["weight_version"] == 10 for tag in build.tags)
    out = unpack_payload(build.fields, build.tags, pad_value_dict={"input_ids": PAD})
    assert out["input_lengths"].tolist() == [11, 1, 9, 1]
    assert out["input_ids"][1, 0] == PAD and out["input_ids"][3, 0] == PAD
    assert out["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["total_reward"].tolist() == [0.0, 0.0, 2.0, 0.0]
    prompt = segments["r0/c0"]["token_ids"][:4]
    assert torch.equal(out["prompt_ids_for_adv"], prompt.repeat(4, 1))
    assert "routed_experts" not in out
    assert "invalid_tool_call_mask" in out


def test_all_failed_group_falls_back_to_the_given_weight_version():
    receipts, segments = group([None, [(2, 2)]])
    segments.clear()
    build = build_group(
        group_id="g",
        prompt_idx=3,
        group_size=2,
        receipts=receipts,
        segments=segments,
        config=config(),
        fallback_weight_version=4,
    )
    assert build.all_failed and build.valid_row_count == 0
    assert build.rejection_reasons == ("missing_receipt", "missing_staging_row")
    assert (build.group_min_wv, build.group_max_wv) == (4, 4)
    assert build.canonical_output_tokens == 0
    assert build.fields.get("prompt_ids_for_adv").tolist() == [[PAD], [PAD]]


def test_rows_longer_than_max_seq_len_are_truncated_and_marked():
    receipts, segments = group([[(4, 6), (3, 8)], [(4, 2)]], experts_k=2)
    build = build_group(
        group_id="g",
        prompt_idx=3,
        group_size=2,
        receipts=receipts,
        segments=segments,
        config=config(max_seq_len=12, router_replay_enabled=True),
    )
    out = unpack_payload(build.fields, build.tags, pad_value_dict={"input_ids": PAD})
    assert out["input_lengths"].tolist() == [12, 6]
    assert out["truncated"].tolist() == [True, False]
    whole = torch.cat([segments["r0/c0"]["token_ids"], segments["r0/c1"]["token_ids"]])
    assert torch.equal(out["input_ids"][0], whole[:12])
    assert out["routed_experts"].shape == (2, 12, 2)
    assert build.tags[0]["routed_experts__row_shapes"] == [12, 2]
    assert build.canonical_output_tokens == 18


def test_a_receipt_in_the_wrong_slot_is_invalid():
    receipts, segments = group([[(2, 2)], [(2, 2)]])
    receipts.reverse()
    build = build_group(group_id="g", prompt_idx=3, group_size=2, receipts=receipts, segments=segments, config=config())
    assert build.rejection_reasons == ("invalid_receipt", "invalid_receipt")


def test_receipt_slots_must_match_the_group_size():
    receipts, segments = group([[(2, 2)]])
    with pytest.raises(ValueError):
        build_group(group_id="g", prompt_idx=3, group_size=2, receipts=receipts, segments=segments, config=config())
