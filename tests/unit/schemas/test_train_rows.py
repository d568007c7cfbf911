"""`build_group` assembles a group's rows straight from its checked segments (`schemas/train_rows.py`);
`linearize` + `record_to_train_batch` + `pack_payload` make them from message logs. The two must agree
row for row: the packed bytes TQ would store, the tags, the counts and the record's figures, and the
errors, on random groups with placeholders, truncation, flagged turns, routed experts (some calls
staged without them) and corrupt rows.

The reference below is the message-log path as `build_group` ran it before issue 33, kept here as
the oracle: truncation of the message log, routed experts dropped without router replay, then the
library's own `record_to_train_batch` and `pack_payload`.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.group_build import build_group
from schemas.linearize import Rejection, linearize
from schemas.payload import Completion, PromptGroupRecord, pack_payload, record_to_train_batch
from schemas.request import RolloutReassemblerActorConfig
from schemas.rowpack import pack_rows
from tests.unit.schemas.chains import make_rollout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD = 3


def _config(max_seq_len: int, router_replay: bool) -> RolloutReassemblerActorConfig:
    return RolloutReassemblerActorConfig(
        partition_id="train",
        staging_partition="staging",
        pad_token_id=PAD,
        router_replay_enabled=router_replay,
        defer_routed_experts_to_policy=False,
        max_seq_len=max_seq_len,
    )


def _truncate(log, limit):
    total = sum(int(m["token_ids"].shape[0]) for m in log)
    if total <= limit:
        return log, False
    out, remaining = [], limit
    for message in log:
        length = int(message["token_ids"].shape[0])
        if remaining <= 0:
            break
        if length <= remaining:
            out.append(message)
        else:
            out.append(
                {k: v[:remaining] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v for k, v in message.items()}
            )
        remaining -= length
    return out, True


def reference_build(*, group_id, prompt_idx, group_size, receipts, segments, config, loss_multiplier):
    """The message-log path: (sample ids, fields, tags, reasons, min/max wv, valid, canonical tokens)."""
    completions, rollouts = [], []
    for index, receipt in enumerate(receipts):
        if receipt is None:
            result = Rejection("missing_receipt", "")
        elif (receipt.group_id, receipt.rollout_index, receipt.group_size, receipt.prompt_idx) != (
            group_id,
            index,
            group_size,
            prompt_idx,
        ):
            result = Rejection("invalid_receipt", "")
        else:
            result = linearize(receipt, segments)
        if isinstance(result, Rejection):
            completions.append(Completion([], 0.0, False, False, rejection_reason=result.reason))
            rollouts.append(None)
            continue
        log, cut = _truncate(result.message_log, config.max_seq_len)
        if not config.router_replay_enabled:
            log = [{k: v for k, v in m.items() if k != "routed_experts"} for m in log]
        completions.append(Completion(log, receipt.reward, receipt.truncated or cut, receipt.mask_sample))
        rollouts.append(result)
    valid = [r for r in rollouts if r is not None]
    prompt = valid[0].prompt_ids if valid else torch.tensor([config.pad_token_id])
    batch = record_to_train_batch(
        PromptGroupRecord(prompt, tuple(completions), loss_multiplier),
        pad_value_dict={"input_ids": config.pad_token_id},
        include_message_violation_fields=True,
    )
    if not config.router_replay_enabled:
        batch.pop("routed_experts", None)
    min_wv = min((r.min_wv for r in valid), default=0)
    max_wv = max((r.max_wv for r in valid), default=0)
    ids, fields, tags = pack_payload(batch, weight_version=min_wv, group_id=group_id, prompt_idx=prompt_idx)
    lengths = batch["input_lengths"].tolist()
    canonical = sum(n for n, r in zip(lengths, rollouts) if r is not None)
    reasons = tuple(c.rejection_reason for c in completions)
    return ids, fields, tags, reasons, (min_wv, max_wv), len(valid), canonical


calls = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4).map(
    lambda cs: [(max(1, cs[0][0]), cs[0][1]), *cs[1:]]  # call 0 begins with a prompt
)
rollout = st.fixed_dictionaries(
    {
        "calls": calls,
        "fate": st.sampled_from(["ok"] * 6 + ["missing_receipt", "failed", "missing_row", "bad_digest", "nan"]),
        "flags": st.dictionaries(
            st.integers(0, 3),
            st.fixed_dictionaries({"invalid_tool_call": st.booleans(), "malformed_thinking": st.booleans()}),
        ),
        "experts": st.sampled_from(["all", "all", "some", "none", "uint8", "wide"]),
        "mask_sample": st.booleans(),
        "truncated": st.booleans(),
    }
)


def _group(specs, seed):
    receipts, segments = [], {}
    for i, spec in enumerate(specs):
        flags = {k: v for k, v in spec["flags"].items() if k < len(spec["calls"])}
        experts_k = None if spec["experts"] == "none" else (3 if spec["experts"] == "wide" else 2)
        receipt, segs = make_rollout(
            spec["calls"],
            rollout_id=f"r{i}",
            rollout_index=i,
            group_size=len(specs),
            prompt_idx=1,
            reward=0.5 + i,
            weight_versions=[4 + (i + j) % 3 for j in range(len(spec["calls"]))],
            experts_k=experts_k,
            flags=flags,
            seed=seed + i,
        )
        if spec["experts"] == "some":
            segs[f"r{i}/c0"].pop("routed_experts")
        if spec["experts"] == "uint8":
            for seg in segs.values():
                seg["routed_experts"] = seg["routed_experts"].to(torch.uint8)
        receipt = msgspec.structs.replace(receipt, mask_sample=spec["mask_sample"], truncated=spec["truncated"])
        last = f"r{i}/c{len(spec['calls']) - 1}"
        if spec["fate"] == "missing_receipt":
            receipts.append(None)
            continue
        if spec["fate"] == "failed":
            receipt = msgspec.structs.replace(receipt, failure_reason="env")
        elif spec["fate"] == "missing_row":
            segs.pop(last)
        elif spec["fate"] == "bad_digest":
            segs[last]["token_ids"] = segs[last]["token_ids"] + 1 if segs[last]["token_ids"].numel() else None
            if segs[last]["token_ids"] is None:
                segs.pop(last)
        elif spec["fate"] == "nan" and segs[last]["token_mask"].any():
            segs[last]["generation_logprobs"][segs[last]["token_mask"].nonzero()[0]] = float("nan")
        receipts.append(receipt)
        segments.update(segs)
    return receipts, segments


def _packed(ids, fields) -> torch.Tensor:
    packed = pack_rows("rlstream.train", ids, dict(fields.items()))
    return packed.values()


@SETTINGS
@given(
    st.lists(rollout, min_size=1, max_size=4),
    st.integers(1, 30),
    st.booleans(),
    st.sampled_from([1.0, 0.5]),
    st.integers(0, 10_000),
)
def test_rows_assembled_from_segments_are_the_message_log_paths_byte_for_byte(
    specs, max_seq_len, router_replay, multiplier, seed
):
    receipts, segments = _group(specs, seed)
    config = _config(max_seq_len, router_replay)
    kw = dict(group_id="g", prompt_idx=1, group_size=len(specs), receipts=receipts, segments=segments, config=config)
    try:
        want = reference_build(**kw, loss_multiplier=multiplier)
    except ValueError as exc:  # routed experts of another width: both refuse the group, alike
        with pytest.raises(ValueError) as got:
            build_group(**kw, loss_multiplier=multiplier)
        assert str(got.value) == str(exc)
        return
    got = build_group(**kw, loss_multiplier=multiplier)
    ids, fields, tags, reasons, versions, valid, canonical = want
    assert got.sample_ids == ids
    assert list(got.fields.keys()) == list(fields.keys())
    assert torch.equal(_packed(got.sample_ids, got.fields), _packed(ids, fields)), "the bytes TQ would hold differ"
    assert got.tags == tags
    assert got.rejection_reasons == reasons
    assert (got.group_min_wv, got.group_max_wv) == versions
    assert (got.valid_row_count, got.canonical_output_tokens, got.all_failed) == (valid, canonical, valid == 0)


def test_a_group_of_routed_experts_of_two_widths_is_refused_naming_the_first_message_that_does_not_fit():
    specs = [
        {"calls": [(2, 2)], "fate": "ok", "flags": {}, "experts": e, "mask_sample": True, "truncated": False}
        for e in ("all", "wide")
    ]
    receipts, segments = _group(specs, 0)
    with pytest.raises(ValueError, match=r"routed_experts shape \(2, 3\) does not fit 2 tokens x \(2,\)"):
        build_group(
            group_id="g", prompt_idx=1, group_size=2, receipts=receipts, segments=segments, config=_config(64, True)
        )
