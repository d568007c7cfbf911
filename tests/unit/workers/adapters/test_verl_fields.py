"""rlstream's packed rows in verl's names: every field, key and tag, checked against rows built by pack_payload."""

from __future__ import annotations

import msgspec
import torch

from schemas.finalized import FinalizedGroup
from schemas.payload import Completion, PromptGroupRecord, pack_payload, record_to_train_batch
from workers.adapters.verl_fields import VERL_FIELDS, VERL_TOKEN_FIELDS, rejected_uid, to_verl_rows, verl_key, verl_uid
from workers.trainer.batch import BatchMeta

PROMPT = torch.tensor([11, 12, 13], dtype=torch.int64)


def _msg(role: str, tokens: list[int], logprob: float | None = None, experts: bool = False) -> dict:
    m = {"role": role, "token_ids": torch.tensor(tokens, dtype=torch.int64)}
    if logprob is not None:
        m["generation_logprobs"] = torch.full((len(tokens),), logprob)
    if experts:
        m["routed_experts"] = torch.arange(len(tokens) * 2, dtype=torch.int32).reshape(len(tokens), 2) + tokens[0]
    return m


def _completions(experts: bool = False) -> tuple[Completion, ...]:
    turn = [
        _msg("user", PROMPT.tolist(), experts=experts),
        _msg("assistant", [21, 22], -0.5, experts=experts),
        _msg("tool", [31, 32, 33], experts=experts),
        _msg("assistant", [23], -0.25, experts=experts),
    ]
    single = [
        _msg("user", PROMPT.tolist(), experts=experts),
        _msg("assistant", [41, 42, 43, 44], -1.0, experts=experts),
    ]
    return (
        Completion(turn, reward=1.5, truncated=False, mask_sample=True),
        Completion([], reward=0.0, truncated=False, mask_sample=False, rejection_reason="timeout"),
        Completion(single, reward=-2.0, truncated=True, mask_sample=False),
    )


def _batch(group_id: str = "gA", weight_version: int = 7, experts: bool = False) -> tuple[BatchMeta, object]:
    record = PromptGroupRecord(PROMPT, _completions(experts))
    rows = record_to_train_batch(record, pad_value_dict={"input_ids": 0}, include_message_violation_fields=False)
    sample_ids, fields, tags = pack_payload(rows, weight_version=weight_version, group_id=group_id, prompt_idx=3)
    group = FinalizedGroup(
        group_id=group_id,
        prompt_idx=3,
        partition_id="rlstream.train",
        sample_ids=tuple(sample_ids),
        tags=tuple(tags),
        group_min_wv=weight_version,
        group_max_wv=weight_version,
        canonical_output_tokens=10,
        valid_row_count=2,
        total_row_count=3,
        rejection_reasons=(None, "timeout", None),
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
    )
    return BatchMeta(9, (group,), ((0, 0),), "rlstream.train"), fields


def test_rows_get_verl_names_and_contents_and_every_rollout_is_a_row():
    meta, rows = _batch()
    verl = to_verl_rows(meta, rows, version_offset=2, group_size=3)
    # verl sizes mini-batches as ppo_mini_batch_size * rollout.n rows: a group of n hands over n rows.
    assert verl.rejected == 1 and verl.keys == ["gA_0_0", "gA_1_0", "gA_2_0"]
    assert set(verl.fields.keys()) == set(VERL_FIELDS)
    f = {name: verl.fields[name].unbind(0) for name in VERL_TOKEN_FIELDS}
    # tensordict 0.10 returns a LinkedList: no .tolist(); the rejected row is a GRPO group of its own.
    assert list(verl.fields["uid"]) == ["gA", rejected_uid("gA", 1), "gA"]
    # Multi-turn rollout: prompt, then assistant/tool/assistant turns as one response.
    assert f["prompts"][0].tolist() == [11, 12, 13] and f["prompts"][0].dtype == torch.int64
    assert f["responses"][0].tolist() == [21, 22, 31, 32, 33, 23]
    assert f["input_ids"][0].tolist() == [11, 12, 13, 21, 22, 31, 32, 33, 23]
    assert f["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 1] and f["response_mask"][0].dtype == torch.int64
    assert torch.equal(f["loss_mask"][0], f["response_mask"][0])
    assert f["rollout_log_probs"][0].tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.25]
    assert f["rm_scores"][0].tolist() == [0.0] * 5 + [1.5] and f["rm_scores"][0].dtype == torch.float32
    assert f["attention_mask"][0].tolist() == [1] * 9 and f["position_ids"][0].tolist() == list(range(9))
    # A row whose sample_mask is 0 keeps its tokens and reward but contributes no loss.
    assert f["responses"][2].tolist() == [41, 42, 43, 44] and f["response_mask"][2].tolist() == [0, 0, 0, 0]
    assert f["rm_scores"][2].tolist() == [0.0, 0.0, 0.0, -2.0]
    assert verl.fields["sample_mask"].tolist() == [1.0, 0.0, 0.0]
    assert verl.fields["prompts"].offsets().diff().tolist() == [3, 3, 3]  # jagged, as verl reads it
    assert verl.tags[0] == {
        "status": "success",
        "prompt_len": 3,
        "response_len": 6,
        "seq_len": 9,
        "global_steps": 5,
        "min_global_steps": 5,
        "max_global_steps": 5,
        "rlstream_group_id": "gA",
        "rlstream_sample_id": meta.sample_ids[0],
    }
    assert verl.tags[2]["rlstream_sample_id"] == meta.sample_ids[2]


def test_a_rejected_rollout_is_a_row_that_weighs_nothing_in_verls_dtypes():
    meta, rows = _batch()
    verl = to_verl_rows(meta, rows, version_offset=2)
    row = {name: verl.fields[name].unbind(0)[1] for name in VERL_TOKEN_FIELDS}
    # verl's actor needs a prompt and at least one response token (no_padding_2_padding).
    assert row["prompts"].tolist() == [11, 12, 13] and row["responses"].tolist() == [0]
    assert row["input_ids"].tolist() == [11, 12, 13, 0] and row["position_ids"].tolist() == [0, 1, 2, 3]
    for name in ("response_mask", "loss_mask"):
        assert row[name].tolist() == [0] and row[name].dtype == torch.int64
    for name in ("rm_scores", "rollout_log_probs"):
        assert row[name].tolist() == [0.0] and row[name].dtype == torch.float32
    assert verl.fields["num_turns"][1] == 0
    tag = verl.tags[1]
    assert tag["is_padding"] is True and tag["rlstream_rejected"] == "timeout"
    assert (tag["prompt_len"], tag["response_len"], tag["seq_len"]) == (3, 1, 4)


def test_a_group_of_another_size_than_rollout_n_is_left_out_and_named():
    """Not raised: verl would crash on the same group after every restart (the sampler dead-letters it)."""
    meta, rows = _batch()
    verl = to_verl_rows(meta, rows, group_size=4)
    assert verl.keys == [] and verl.fields is None
    assert list(verl.unusable) == ["gA"] and "3 rows, verl's rollout.n is 4" in verl.unusable["gA"]


def test_routed_experts_get_their_row_shape_back_as_int16():
    meta, rows = _batch(experts=True)
    verl = to_verl_rows(meta, rows)
    experts = verl.fields["routed_experts"].unbind(0)
    assert experts[0].shape == (9, 2) and experts[0].dtype == torch.int16
    assert experts[0][3].tolist() == [21, 22] and experts[2][3].tolist() == [41 + 0, 41 + 1]
    # The rejected rollout's row carries the field too (TQ refuses a field on some rows only), all zero.
    assert experts[1].shape == (4, 2) and experts[1].dtype == torch.int16 and experts[1].abs().sum().item() == 0


def test_a_group_of_rejected_rows_only_still_hands_over_n_masked_rows():
    meta, rows = _batch()
    group = meta.groups[0]
    all_rejected = msgspec.structs.replace(
        group, valid_row_count=0, rejection_reasons=("a", "b", "c"), canonical_output_tokens=0
    )
    verl = to_verl_rows(BatchMeta(9, (all_rejected,), ((0, 0),), "rlstream.train"), rows, group_size=3)
    assert len(verl.keys) == 3 and verl.rejected == 3
    assert all(t["is_padding"] for t in verl.tags)
    assert all(m.sum().item() == 0 for m in verl.fields["loss_mask"].unbind(0))


def test_a_group_with_a_row_that_does_not_start_with_its_prompt_is_left_out_and_named():
    meta, rows = _batch()
    rows["input_ids"].values()[0] = 99  # the first prompt token of row 0
    verl = to_verl_rows(meta, rows, group_size=3)
    assert verl.keys == [] and verl.unusable == {
        "gA": f"row {meta.sample_ids[0]!r}: input_ids do not start with its prompt"
    }
    assert to_verl_rows(*_batch(), group_size=3).unusable == {}


def test_uids_never_contain_verls_key_separator_and_stay_distinct():
    ids = ["a_b", "a%5Fb", "a-b", "x"]
    uids = [verl_uid(g) for g in ids]
    assert all("_" not in u for u in uids) and len(set(uids)) == len(ids)
    assert verl_key("a_b", 4).split("_") == ["a%5Fb", "4", "0"]
