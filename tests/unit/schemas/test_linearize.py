import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.gym_verify import VERIFICATION_CODES
from schemas.linearize import REJECTION_REASONS, LinearizedRollout, Rejection, linearize
from tests.unit.schemas.chains import make_rollout

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# calls[i] = (non-generated tokens, generated tokens); call 0 needs a prompt.
chains = st.tuples(st.integers(1, 12), st.integers(0, 12)).flatmap(
    lambda first: st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=4).map(lambda rest: [first, *rest])
)


def replace_call(receipt, i, **changes):
    manifest = list(receipt.manifest)
    manifest[i] = msgspec.structs.replace(manifest[i], **changes)
    return msgspec.structs.replace(receipt, manifest=tuple(manifest))


@SETTINGS
@given(chains, st.integers(0, 1000))
def test_valid_chains_rebuild_the_message_log(calls, seed):
    versions = [3 + (7 * i) % 5 for i in range(len(calls))]
    receipt, segments = make_rollout(
        calls, seed=seed, weight_versions=versions, experts_k=2, flags={len(calls) - 1: {"invalid_tool_call": True}}
    )
    result = linearize(receipt, segments)
    assert isinstance(result, LinearizedRollout)

    # The expected roles come from the description of the calls, not from the code under test.
    expected_roles = []
    for i, (observed, generated) in enumerate(calls):
        if observed:
            expected_roles.append("user" if i == 0 else "environment")
        if generated:
            expected_roles.append("assistant")
    assert [m["role"] for m in result.message_log] == expected_roles

    all_ids = torch.cat([segments[c.staging_key]["token_ids"] for c in receipt.manifest])
    assert torch.equal(torch.cat([m["token_ids"] for m in result.message_log]), all_ids)
    assert result.length == sum(a + b for a, b in calls) == all_ids.numel()
    assert torch.equal(result.prompt_ids, segments["r0/c0"]["token_ids"][: calls[0][0]])
    assert result.weight_versions == tuple(versions)
    assert (result.min_wv, result.max_wv) == (min(versions), max(versions))
    for message in result.message_log:
        n = message["token_ids"].numel()
        assert message["routed_experts"].shape == (n, 2)
        if message["role"] == "assistant":
            assert message["generation_logprobs"].shape == (n,)
        else:
            assert "generation_logprobs" not in message
    last_call_assistant = calls[-1][1] > 0
    flagged = [m for m in result.message_log if m.get("is_invalid_tool_call")]
    assert len(flagged) == (1 if last_call_assistant else 0)


CORRUPTIONS = {
    "rollout_failed": lambda r, s, i: (msgspec.structs.replace(r, failure_reason="env crashed"), s),
    "duplicate_staging_key": lambda r, s, i: (
        replace_call(r, i, staging_key=r.manifest[i - 1].staging_key, call_id=r.manifest[i - 1].call_id),
        s,
    ),
    "rebuild_failed": lambda r, s, i: (replace_call(r, i, parent_call_id="stranger"), s),
    "invalid_receipt": lambda r, s, i: (
        replace_call(r, i, prev_len=r.manifest[i].prev_len + 1, cum_len=r.manifest[i].cum_len + 1),
        s,
    ),
    "missing_staging_row": lambda r, s, i: (r, {k: v for k, v in s.items() if k != r.manifest[i].staging_key}),
    "invalid_staging_row": lambda r, s, i: (replace_call(r, i, digest="0" * 16), s),
}


@SETTINGS
@given(chains.filter(lambda c: len(c) >= 2), st.sampled_from(sorted(CORRUPTIONS)), st.data())
def test_each_corruption_yields_its_own_reason(calls, reason, data):
    receipt, segments = make_rollout(calls, seed=len(calls))
    index = data.draw(st.integers(1, len(calls) - 1))
    receipt, segments = CORRUPTIONS[reason](receipt, segments, index)
    result = linearize(receipt, segments)
    assert isinstance(result, Rejection)
    assert result.reason == reason, result.detail


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda seg: seg.update(token_ids=seg["token_ids"][:-1]),
        lambda seg: seg.update(token_mask=seg["token_mask"].to(torch.int64)),
        lambda seg: seg.update(generation_logprobs=seg["generation_logprobs"].double()),
        lambda seg: seg.pop("token_mask"),
        lambda seg: seg.update(token_ids=seg["token_ids"].reshape(1, -1)),
        lambda seg: seg.update(routed_experts=torch.zeros(2, 2)),
        lambda seg: seg["generation_logprobs"].__setitem__(-1, float("nan")),
        lambda seg: seg["token_ids"].__setitem__(0, seg["token_ids"][0] + 1),  # digest differs
    ],
)
def test_segments_that_disagree_with_their_record_are_invalid_staging_rows(corrupt):
    receipt, segments = make_rollout([(3, 2), (1, 2)])
    corrupt(segments["r0/c1"])
    result = linearize(receipt, segments)
    assert isinstance(result, Rejection) and result.reason == "invalid_staging_row"


def test_call_zero_with_a_parent_is_a_broken_link():
    receipt, segments = make_rollout([(3, 2)])
    result = linearize(replace_call(receipt, 0, parent_call_id="c9"), segments)
    assert result.reason == "rebuild_failed"


def test_call_zero_without_a_prompt_cannot_be_rebuilt():
    receipt, segments = make_rollout([(0, 4)])
    assert linearize(receipt, segments).reason == "rebuild_failed"


def test_rejection_reasons_are_the_documented_set():
    own = (
        "missing_receipt",
        "invalid_receipt",
        "rollout_failed",
        "duplicate_staging_key",
        "missing_staging_row",
        "invalid_staging_row",
        "rebuild_failed",
        "inconsistent_media",
        "truncated_media",
    )
    assert REJECTION_REASONS[: len(own)] == own
    # Then NeMo Gym's verification codes, each once.
    assert set(REJECTION_REASONS[len(own) :]) | {"rollout_failed", "duplicate_staging_key"} == set(VERIFICATION_CODES)
    assert len(set(REJECTION_REASONS)) == len(REJECTION_REASONS)
    with pytest.raises(ValueError):
        Rejection("bad_vibes", "")
