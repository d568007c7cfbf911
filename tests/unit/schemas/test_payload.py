import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from schemas.payload import (
    _VIOLATION_COUNTS_KEY,
    VIOLATION_TAG_KEYS,
    Completion,
    PromptGroupRecord,
    _add_message_violation_masks,
    _violation_counts,
    pack_payload,
    record_to_train_batch,
    unpack_payload,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD = {"input_ids": 99}


def msg(role, ids, *, logprobs=None, **extra):
    message = {"role": role, "token_ids": torch.tensor(ids, dtype=torch.int64)}
    if logprobs is not None:
        message["generation_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
    message.update(extra)
    return message


def test_constants():
    assert VIOLATION_TAG_KEYS == (
        "num_invalid_tool_calls",
        "num_malformed_thinking",
        "num_assistant_messages",
        "num_routed_experts_backfilled",
    )
    assert _VIOLATION_COUNTS_KEY == "violation_counts"


def test_violation_counts_count_only_generated_assistant_turns():
    log = [
        msg("user", [1, 2], invalid_tool_call=True),  # not generated: ignored
        msg("assistant", [3], logprobs=[-0.1], invalid_tool_call=True, malformed_thinking=True),
        msg("assistant", [4, 5], invalid_tool_call=True),  # no logprobs: a replayed turn, ignored
        msg("environment", [6], malformed_thinking=True),
        msg("assistant", [7], logprobs=[-0.2], malformed_thinking=True, routed_experts_backfilled=True),
        msg("assistant", [8], logprobs=[-0.3]),
    ]
    assert _violation_counts(log) == {
        "num_invalid_tool_calls": 1,
        "num_malformed_thinking": 2,
        "num_assistant_messages": 3,
        "num_routed_experts_backfilled": 1,
    }


def test_violation_masks_align_with_tokens():
    log = [
        msg("user", [1, 2, 3], invalid_tool_call=True),
        msg("assistant", [4, 5], logprobs=[-0.1, -0.2], invalid_tool_call=True),
        msg("assistant", [6], malformed_thinking=True),
        msg("assistant", [7, 8, 9], logprobs=[-1.0, -1.0, -1.0], malformed_thinking=True),
    ]
    _add_message_violation_masks([log])
    assert [m["invalid_tool_call_mask"].tolist() for m in log] == [[False] * 3, [True, True], [False], [False] * 3]
    assert [m["malformed_thinking_mask"].tolist() for m in log] == [[False] * 3, [False, False], [False], [True] * 3]
    assert all(m["invalid_tool_call_mask"].dtype == torch.bool for m in log)


def _record():
    good = Completion(
        [
            msg("user", [1, 2, 3]),
            msg("assistant", [4, 5], logprobs=[-0.5, -0.25], invalid_tool_call=True),
            msg("environment", [6]),
            msg("assistant", [7], logprobs=[-2.0]),
        ],
        reward=1.5,
        truncated=False,
        mask_sample=True,
    )
    placeholder = Completion([], 0.7, False, True, rejection_reason="missing_staging_row")
    masked = Completion(
        [msg("user", [1, 2, 3]), msg("assistant", [8], logprobs=[-1.0])], reward=-1.0, truncated=True, mask_sample=False
    )
    return PromptGroupRecord(torch.tensor([1, 2, 3]), (good, placeholder, masked), 0.5)


def test_record_to_train_batch_rows():
    batch = record_to_train_batch(_record(), pad_value_dict=PAD, include_message_violation_fields=True)
    f, t = False, True
    assert torch.equal(
        batch["input_ids"],
        torch.tensor([[1, 2, 3, 4, 5, 6, 7], [99, 99, 99, 99, 99, 99, 99], [1, 2, 3, 8, 99, 99, 99]]),
    )
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_lengths"], torch.tensor([7, 1, 4]))
    assert torch.equal(
        batch["generation_logprobs"],
        torch.tensor([[0, 0, 0, -0.5, -0.25, 0, -2.0], [0] * 7, [0, 0, 0, -1.0, 0, 0, 0]], dtype=torch.float32),
    )
    assert torch.equal(batch["token_mask"], torch.tensor([[f, f, f, t, t, f, t], [f] * 7, [f, f, f, t, f, f, f]]))
    assert torch.equal(batch["invalid_tool_call_mask"], torch.tensor([[f, f, f, t, t, f, f], [f] * 7, [f] * 7]))
    assert torch.equal(batch["malformed_thinking_mask"], torch.zeros(3, 7, dtype=torch.bool))
    assert torch.equal(batch["sample_mask"], torch.tensor([0.5, 0.0, 0.0]))
    assert batch["sample_mask"].dtype == torch.float32
    assert torch.equal(batch["prompt_ids_for_adv"], torch.tensor([[1, 2, 3]] * 3))
    assert torch.equal(batch["mask_sample"], torch.tensor([t, t, f]))
    assert torch.equal(batch["truncated"], torch.tensor([f, f, t]))
    assert torch.equal(batch["total_reward"], torch.tensor([1.5, 0.0, -1.0]))
    assert batch["violation_counts"][0]["num_invalid_tool_calls"] == 1
    assert batch["violation_counts"][0]["num_assistant_messages"] == 2
    assert batch["violation_counts"][1] == dict.fromkeys(VIOLATION_TAG_KEYS, 0)
    assert "routed_experts" not in batch


def test_record_to_train_batch_leaves_the_record_untouched_and_can_skip_masks():
    record = _record()
    batch = record_to_train_batch(record, pad_value_dict={}, include_message_violation_fields=False)
    assert "invalid_tool_call_mask" not in batch
    assert all("invalid_tool_call_mask" not in m for c in record.completions for m in c.message_log)
    assert batch["input_ids"][1].tolist() == [0] * 7  # default pad is 0


def test_routed_experts_are_backfilled_with_zeros_and_counted():
    experts = torch.arange(6).reshape(3, 2).to(torch.int32)
    with_experts = Completion(
        [
            msg("user", [1, 2], routed_experts=experts[:2]),
            msg("assistant", [3], logprobs=[-1.0], routed_experts=experts[2:]),
        ],
        1.0,
        False,
        True,
    )
    without = Completion([msg("user", [1, 2]), msg("assistant", [4, 5], logprobs=[-1.0, -1.0])], 1.0, False, True)
    record = PromptGroupRecord(torch.tensor([1, 2]), (with_experts, without))
    batch = record_to_train_batch(record, pad_value_dict={}, include_message_violation_fields=False)
    routed = batch["routed_experts"]
    assert routed.shape == (2, 4, 2) and routed.dtype == torch.int32
    assert torch.equal(routed[0, :3], experts)
    assert torch.equal(routed[1], torch.zeros(4, 2, dtype=torch.int32))
    assert [c["num_routed_experts_backfilled"] for c in batch["violation_counts"]] == [0, 2]


def test_pack_payload_sample_ids_tags_and_jagged_rows():
    batch = record_to_train_batch(_record(), pad_value_dict=PAD, include_message_violation_fields=True)
    sample_ids, fields, tags = pack_payload(batch, weight_version=12, group_id="grp", prompt_idx=4)
    assert sample_ids == ["grp_g0", "grp_g1", "grp_g2"]
    assert isinstance(fields, TensorDict) and fields.batch_size == torch.Size([3])
    rows = fields.get("input_ids").unbind()
    assert [r.tolist() for r in rows] == [[1, 2, 3, 4, 5, 6, 7], [99], [1, 2, 3, 8]]
    assert fields.get("input_ids").layout == torch.jagged
    assert not fields.get("prompt_ids_for_adv").is_nested
    assert not fields.get("total_reward").is_nested
    assert tags[2] == {
        "weight_version": 12,
        "prompt_idx": 4,
        "group_id": "grp",
        "rollout_index": 2,
        "num_invalid_tool_calls": 0,
        "num_malformed_thinking": 0,
        "num_assistant_messages": 1,
        "num_routed_experts_backfilled": 0,
    }


def test_unpack_inverts_record_to_train_batch_bit_for_bit():
    batch = record_to_train_batch(_record(), pad_value_dict=PAD, include_message_violation_fields=True)
    _, fields, tags = pack_payload(batch, weight_version=1, group_id="g", prompt_idx=0)
    out = unpack_payload(fields, tags, pad_value_dict=PAD)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert set(out) == set(tensors)
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype, name
        assert torch.equal(out[name], value), name


DTYPES = [
    torch.int64,
    torch.int32,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 120, shape, generator=gen).to(dtype)


@st.composite
def train_batches(draw, max_len=64):
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.sampled_from([1, max_len]) | st.integers(1, max_len), min_size=n, max_size=n))
    width = max(lengths)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    pads = {"input_ids": draw(st.integers(0, 100))}
    batch = {"input_lengths": torch.tensor(lengths)}
    shapes = st.sampled_from([(), (1,), (3,), (2, 2)])
    extra = draw(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), max_size=3))
    for i, (dtype, rest) in enumerate([(torch.int64, ())] + extra):
        name = "input_ids" if i == 0 else f"field{i}"
        value = _random((n, width, *rest), dtype, gen)
        pad = pads.setdefault(name, draw(st.integers(0, 1)) if dtype == torch.bool else draw(st.integers(0, 100)))
        value[~mask] = pad  # padding carries the pad value, as record_to_train_batch writes it
        batch[name] = value
    batch["prompt_ids_for_adv"] = _random((n, draw(st.integers(1, width))), torch.int64, gen)
    batch["scalar"] = _random((n,), draw(st.sampled_from(DTYPES)), gen)
    return batch, pads


@SETTINGS
@given(train_batches())
def test_pack_then_unpack_round_trips(case):
    batch, pads = case
    lengths = batch["input_lengths"].tolist()
    _, fields, tags = pack_payload(batch, weight_version=3, group_id="g", prompt_idx=9)
    for name, value in batch.items():
        packed = fields.get(name)
        if value.dim() >= 2 and name != "prompt_ids_for_adv":
            rows = packed.unbind()
            for i, row in enumerate(rows):  # each row is the padded row cut to its length
                assert torch.equal(row, value[i, : lengths[i]].reshape(-1))
            if value.dim() > 2:
                assert [t[f"{name}__row_shapes"] for t in tags] == [[length, *value.shape[2:]] for length in lengths]
        else:
            assert not packed.is_nested
    out = unpack_payload(fields, tags, pad_value_dict=pads)
    for name, value in batch.items():
        assert out[name].dtype == value.dtype
        assert torch.equal(out[name], value), name


def _group_batch(group, lengths, prompt):
    completions = tuple(
        Completion(
            [
                msg("user", prompt),
                msg(
                    "assistant",
                    list(range(100, 100 + n - len(prompt))),
                    logprobs=[-0.5] * (n - len(prompt)),
                    routed_experts=torch.ones(n - len(prompt), 2, dtype=torch.int16),
                ),
            ],
            float(group),
            False,
            True,
        )
        if n
        else Completion([], 0.0, False, False, rejection_reason="missing_receipt")
        for n in lengths
    )
    record = PromptGroupRecord(torch.tensor(prompt), completions)
    return record_to_train_batch(record, pad_value_dict=PAD, include_message_violation_fields=True)


def _like_tq(packed_rows):
    """Rows of several groups as TQ's get returns them: per-sample tensors regrouped per field,
    jagged for non-scalar rows and stacked for scalars."""
    fields = {}
    for name in packed_rows[0][0]:
        rows = [row[name] for row, _ in packed_rows]
        if rows[0].dim() == 0:
            fields[name] = torch.stack(rows)
        else:
            fields[name] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return TensorDict(fields, batch_size=[len(packed_rows)]), [tag for _, tag in packed_rows]


def test_unpack_rows_of_several_groups_fetched_from_tq():
    batches = [_group_batch(0, [5, 0, 9], [1, 2, 3]), _group_batch(1, [4, 6], [7, 8])]
    rows = []
    for g, batch in enumerate(batches):
        _, fields, tags = pack_payload(batch, weight_version=g, group_id=f"g{g}", prompt_idx=g)
        for i, tag in enumerate(tags):
            row = {k: v.unbind()[i] if v.is_nested else v[i] for k, v in fields.items()}
            rows.append((row, tag))
    rows = [rows[3], rows[0], rows[4], rows[2], rows[1]]  # TQ may hand rows back in any order
    fields, tags = _like_tq(rows)
    out = unpack_payload(fields, tags, pad_value_dict=PAD)
    width = max(n for b in batches for n in b["input_lengths"].tolist())
    assert out["input_ids"].shape == (5, width)
    assert out["routed_experts"].shape == (5, width, 2)
    for position, tag in enumerate(tags):
        batch, i = batches[int(tag["group_id"][1:])], tag["rollout_index"]
        length = int(batch["input_lengths"][i])
        for name in ("input_ids", "generation_logprobs", "token_mask", "routed_experts", "invalid_tool_call_mask"):
            own = batch[name][i]
            assert torch.equal(out[name][position, : own.shape[0]], own), name
            assert not out[name][position, length:].any() or name == "input_ids"
        assert set(out["input_ids"][position, length:].tolist()) <= {99}
        prompt = batch["prompt_ids_for_adv"][i]
        assert torch.equal(out["prompt_ids_for_adv"][position, : prompt.shape[0]], prompt)
        assert set(out["prompt_ids_for_adv"][position, prompt.shape[0] :].tolist()) <= {99}
        assert out["total_reward"][position] == batch["total_reward"][i]


def test_pack_rejects_a_non_tensor_field():
    batch = record_to_train_batch(_record(), pad_value_dict=PAD, include_message_violation_fields=False)
    batch["notes"] = ["a", "b", "c"]
    with pytest.raises(TypeError):
        pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)


def test_pack_without_input_ids_uses_the_longest_row_as_width():
    batch = {"input_lengths": torch.tensor([2, 3]), "scores": torch.tensor([[1.0, 2.0, -1.0], [3.0, 4.0, 5.0]])}
    _, fields, tags = pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)
    assert [r.tolist() for r in fields.get("scores").unbind()] == [[1.0, 2.0], [3.0, 4.0, 5.0]]
    out = unpack_payload(fields, tags, pad_value_dict={"scores": -1})
    assert torch.equal(out["scores"], batch["scores"])


def test_pack_views_the_batch_but_keeps_its_own_row_lengths():
    batch = {"input_lengths": torch.tensor([2, 3]), "input_ids": torch.arange(6).reshape(2, 3)}
    _, fields, _ = pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)
    batch["input_lengths"][0] = 3  # the caller reusing its tensor must not change packed rows
    assert [r.tolist() for r in fields.get("input_ids").unbind()] == [[0, 1], [3, 4, 5]]


def test_pack_rejects_violation_counts_for_another_number_of_rows():
    batch = {
        "input_lengths": torch.tensor([2, 1]),
        "input_ids": torch.zeros(2, 2, dtype=torch.int64),
        "violation_counts": [{"num_invalid_tool_calls": 1}],
    }
    with pytest.raises(ValueError, match=r"\['violation_counts'\] has 1 rows, not 2"):
        pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_unpack_measures_each_field_of_the_older_nested_layout_on_its_own():
    # Strided nested tensors are read row by row into temporary offsets; none may be taken for
    # another field's even if Python reuses its address.
    gen = torch.Generator().manual_seed(3)
    expected, fields = {}, {}
    for f in range(8):
        lengths = torch.randint(1, 7, (2,), generator=gen).tolist()
        rows = [torch.arange(n) + 10 * f for n in lengths]
        fields[f"f{f}"] = torch.nested.nested_tensor(rows)
        expected[f"f{f}"] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    out = unpack_payload(fields, [{}, {}], pad_value_dict={})
    for name, value in expected.items():
        assert torch.equal(out[name], value), name


def test_unpack_accepts_row_shapes_tags_as_tuples_or_lists():
    batch = {"input_lengths": torch.tensor([1, 2]), "experts": torch.arange(8, dtype=torch.int16).reshape(2, 2, 2)}
    _, fields, tags = pack_payload(batch, weight_version=0, group_id="g", prompt_idx=0)
    tags[1]["experts__row_shapes"] = tuple(tags[1]["experts__row_shapes"])
    out = unpack_payload(fields, tags, pad_value_dict={})
    assert out["experts"].tolist() == [[[0, 1], [0, 0]], [[4, 5], [6, 7]]]
