"""The payload helpers on NeMo RL's row contract: its message keys, `rollout_environment`, and packed
multimodal inputs with `<field>__row_shapes` tags, bit for bit through packing and TQ's row layout."""

import pytest
import torch

from schemas.multimodal import PackedRows
from schemas.payload import (
    Completion,
    PromptGroupRecord,
    _add_message_violation_masks,
    _violation_counts,
    pack_payload,
    record_to_train_batch,
    unpack_payload,
)
from schemas.rowpack import pack_rows as pack_tq_rows
from schemas.rowpack import unpack_rows

PAD = {"input_ids": 0}


def msg(role, ids, *, logprobs=None, **extra):
    message = {"role": role, "token_ids": torch.tensor(ids, dtype=torch.int64)}
    if logprobs is not None:
        message["generation_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
    message.update(extra)
    return message


def nemo_rl_log():
    """A NeMo RL message log: generated assistant turns carry generation_logprobs and NeMo RL's flags."""
    return [
        msg("user", [1, 2, 3], is_invalid_tool_call=True),  # not generated: never counted
        msg("assistant", [4, 5], logprobs=[-0.1, -0.2], is_invalid_tool_call=True),
        msg("tool", [6]),
        msg("assistant", [7], logprobs=[-0.3], has_malformed_thinking=True),
        msg("assistant", [8, 9], logprobs=[-0.4, -0.5], is_invalid_tool_call=True, has_malformed_thinking=True),
    ]


def test_a_nemo_rl_message_log_gives_nemo_rls_counts():
    # By NeMo RL's `_violation_counts`: over assistant messages with generation_logprobs, one count
    # per message for each of `is_invalid_tool_call` and `has_malformed_thinking`.
    assert _violation_counts(nemo_rl_log()) == {
        "num_invalid_tool_calls": 2,
        "num_malformed_thinking": 2,
        "num_assistant_messages": 3,
        "num_routed_experts_backfilled": 0,
    }


def test_a_nemo_rl_message_log_gives_nemo_rls_masks():
    log = nemo_rl_log()
    _add_message_violation_masks([log])
    f, t = False, True
    assert [m["invalid_tool_call_mask"].tolist() for m in log] == [[f, f, f], [t, t], [f], [f], [t, t]]
    assert [m["malformed_thinking_mask"].tolist() for m in log] == [[f, f, f], [f, f], [f], [t], [t, t]]


def test_rlstreams_earlier_names_still_count_and_a_disagreement_names_both():
    old = [msg("assistant", [4], logprobs=[-0.1], invalid_tool_call=True, malformed_thinking=True)]
    assert _violation_counts(old)["num_invalid_tool_calls"] == 1
    assert _violation_counts(old)["num_malformed_thinking"] == 1
    both = [msg("assistant", [4], logprobs=[-0.1], is_invalid_tool_call=True, invalid_tool_call=False)]
    with pytest.raises(ValueError, match="is_invalid_tool_call=True and invalid_tool_call=False disagree"):
        _violation_counts(both)
    with pytest.raises(ValueError, match="has_malformed_thinking"):
        _add_message_violation_masks([[msg("assistant", [4], logprobs=[-0.1], has_malformed_thinking=False,
                                           malformed_thinking=True)]])  # fmt: skip


def _pixels(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _vlm_record(environment="vision"):
    image_a, image_b = _pixels((4, 12), 1), _pixels((2, 12), 2)
    rows = [
        Completion(
            [msg("user", [1, 2]), msg("assistant", [3, 4], logprobs=[-0.5, -0.25])],
            1.0,
            False,
            True,
            multimodal={
                "pixel_values": [image_a, image_b],
                "imgs_sizes": [torch.tensor([[2, 8], [1, 8]], dtype=torch.int32)],
            },
        ),
        Completion([], 0.0, False, True, rejection_reason="missing_staging_row"),
        Completion([msg("user", [1, 2]), msg("assistant", [5], logprobs=[-1.0])], 0.5, False, True),
    ]
    return PromptGroupRecord(torch.tensor([1, 2]), tuple(rows), rollout_environment=environment), (image_a, image_b)


def test_packed_multimodal_inputs_ride_with_nemo_rls_row_shapes_tags():
    record, (image_a, image_b) = _vlm_record()
    batch = record_to_train_batch(record, pad_value_dict=PAD, include_message_violation_fields=True)
    ids, fields, tags = pack_payload(batch, weight_version=3, group_id="g", prompt_idx=7)
    assert ids == ["g_g0", "g_g1", "g_g2"]
    assert [t["pixel_values__row_shapes"] for t in tags] == [
        {"shapes": [[4, 12], [2, 12]], "pad": False},
        {"shapes": [], "pad": False},
        {"shapes": [], "pad": False},
    ]
    assert tags[0]["imgs_sizes__row_shapes"] == {"shapes": [[2, 2]], "pad": False}
    assert all(t["rollout_environment"] == "vision" and t["group_id"] == "g" for t in tags)
    # Through TQ's packed row layout and the trainer's unpacking, the pixels come back bit for bit.
    rows = unpack_rows("rlstream.train", ids, pack_tq_rows("rlstream.train", ids, fields)).fields
    out = unpack_payload(rows, tags, pad_value_dict=PAD)
    pixels = PackedRows.from_wire(out["pixel_values"], tags, "pixel_values")
    assert [len(r) for r in pixels.rows] == [2, 0, 0]
    for got, want in zip(pixels.rows[0], (image_a, image_b)):
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    sizes = PackedRows.from_wire(out["imgs_sizes"], tags, "imgs_sizes")
    assert torch.equal(sizes.rows[0][0], torch.tensor([[2, 8], [1, 8]], dtype=torch.int32))
    assert out["input_ids"].shape == (3, 4)  # token fields are still padded


def test_unknown_environment_is_not_stamped_and_an_all_text_group_sends_no_media():
    record, _ = _vlm_record(environment="unknown")
    text_only = PromptGroupRecord(record.prompt_ids, (record.completions[2],), rollout_environment="unknown")
    for r in (record, text_only):
        batch = record_to_train_batch(r, pad_value_dict=PAD, include_message_violation_fields=False)
        _, fields, tags = pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)
        assert all("rollout_environment" not in t for t in tags)
    assert "pixel_values" not in fields and not any("pixel_values__row_shapes" in t for t in tags)


def test_a_media_field_may_not_take_a_row_fields_name():
    bad = Completion([msg("user", [1]), msg("assistant", [2], logprobs=[-1.0])], 0.0, False, True,
                     multimodal={"input_ids": [torch.zeros(2)]})  # fmt: skip
    with pytest.raises(ValueError, match="'input_ids' would take the name of a row field"):
        record_to_train_batch(PromptGroupRecord(torch.tensor([1]), (bad,)), pad_value_dict=PAD,
                              include_message_violation_fields=False)  # fmt: skip


def test_from_wire_refuses_rows_whose_shapes_are_missing_or_wrong():
    packed = PackedRows([[torch.arange(6).reshape(2, 3)], []])
    wire = packed.to_wire()
    with pytest.raises(ValueError, match="no 'x__row_shapes' tag"):
        PackedRows.from_wire(wire, [{}, {}], "x")
    bad = [{"x__row_shapes": {"shapes": [[2, 2]], "pad": False}}, {"x__row_shapes": {"shapes": [], "pad": False}}]
    with pytest.raises(ValueError, match="holds 6 values"):
        PackedRows.from_wire(wire, bad, "x")
    assert torch.equal(PackedRows.from_wire(wire, packed.row_tags("x"), "x").rows[0][0], torch.arange(6).reshape(2, 3))
