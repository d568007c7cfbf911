"""`build_group` assembles a group's rows straight from its checked segments (`schemas/train_rows.py`);
`linearize` + `record_to_train_batch` + `pack_payload` make them from message logs. The two must agree
row for row: the packed bytes TQ would store, the tags, the counts and the record's figures, and the
errors, on random groups with placeholders, truncation, flagged turns, routed experts of widths 0 to 3
(some calls staged without them, some rollouts one wider) and corrupt rows.

The reference is the message-log path, `build_group_from_logs` (`build_group` before issue 33, and
still the path of a group with a NeMo Gym receipt): linearize, truncation of the message log, routed
experts dropped without router replay, then the library's own `record_to_train_batch` and
`pack_payload`, which also stamp NeMo RL's `rollout_environment` tag.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.group_build import build_group, build_group_from_logs
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


def reference_build(*, group_id, prompt_idx, group_size, receipts, segments, config, loss_multiplier):
    """The message-log path: (sample ids, fields, tags, reasons, min/max wv, valid, canonical tokens)."""
    b = build_group_from_logs(
        group_id=group_id,
        prompt_idx=prompt_idx,
        group_size=group_size,
        receipts=receipts,
        segments=segments,
        config=config,
        loss_multiplier=loss_multiplier,
    )
    versions = (b.group_min_wv, b.group_max_wv)
    return b.sample_ids, b.fields, b.tags, b.rejection_reasons, versions, b.valid_row_count, b.canonical_output_tokens


calls = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4).map(
    lambda cs: [(max(1, cs[0][0]), cs[0][1]), *cs[1:]]  # call 0 begins with a prompt
)
rollout = st.fixed_dictionaries(
    {
        "calls": calls,
        "fate": st.sampled_from(
            ["ok"] * 6 + ["missing_receipt", "failed", "missing_row", "bad_digest", "nan", "not_mapping"]
        ),
        "flags": st.dictionaries(
            st.integers(0, 3),
            st.fixed_dictionaries({"invalid_tool_call": st.booleans(), "malformed_thinking": st.booleans()}),
        ),
        "experts": st.sampled_from(["all", "all", "some", "none", "uint8", "wide"]),
        "mask_sample": st.booleans(),
        "truncated": st.booleans(),
    }
)


def _group(specs, seed, environment="math", experts_k=2):
    receipts, segments = [], {}
    for i, spec in enumerate(specs):
        flags = {k: v for k, v in spec["flags"].items() if k < len(spec["calls"])}
        k = None if spec["experts"] == "none" else experts_k + (spec["experts"] == "wide")
        receipt, segs = make_rollout(
            spec["calls"],
            rollout_id=f"r{i}",
            rollout_index=i,
            group_size=len(specs),
            prompt_idx=1,
            reward=0.5 + i,
            weight_versions=[4 + (i + j) % 3 for j in range(len(spec["calls"]))],
            experts_k=k,
            flags=flags,
            seed=seed + i,
        )
        if spec["experts"] == "some":
            segs[f"r{i}/c0"].pop("routed_experts")
        if spec["experts"] == "uint8":
            for seg in segs.values():
                seg["routed_experts"] = seg["routed_experts"].to(torch.uint8)
        receipt = msgspec.structs.replace(
            receipt, mask_sample=spec["mask_sample"], truncated=spec["truncated"], environment=environment
        )
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
        elif spec["fate"] == "not_mapping":
            segs[last] = list(segs[last].values())  # not an rlstream staged call
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
    st.sampled_from(["math", "unknown", ""]),
    st.sampled_from([2, 2, 1, 0]),  # routed experts per token; 0 names none: both refuse the group
)
def test_rows_assembled_from_segments_are_the_message_log_paths_byte_for_byte(
    specs, max_seq_len, router_replay, multiplier, seed, environment, experts_k
):
    receipts, segments = _group(specs, seed, environment, experts_k)
    config = _config(max_seq_len, router_replay)
    kw = dict(group_id="g", prompt_idx=1, group_size=len(specs), receipts=receipts, segments=segments, config=config)
    try:
        want = reference_build(**kw, loss_multiplier=multiplier)
    except ValueError as exc:  # routed experts of another width, or of none: both refuse the group, alike
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
