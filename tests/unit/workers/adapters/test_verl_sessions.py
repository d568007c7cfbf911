"""verl agent-loop sessions as rlstream rollouts: turns from the response mask, ids, versions, failures."""

from __future__ import annotations

import pytest

from schemas.linearize import linearize
from tests.unit.workers.adapters.verl_outputs import agent_output
from workers.adapters.verl_sessions import (
    failed_group,
    failed_session,
    group_rollouts,
    reaches_trainer,
    rollout_id,
    session_rollout,
    session_turns,
)


def _calls(turns):
    return [(list(map(int, t.input_ids)), list(map(int, t.output_ids)), t.weight_version) for t in turns]


def test_a_single_turn_session_is_one_call():
    turns = session_turns([1, 2], [5, 6, 7], [1, 1, 1], [-0.1, -0.2, -0.3], first_version=3, last_version=3)
    assert _calls(turns) == [([1, 2], [5, 6, 7], 3)]
    assert list(turns[0].output_logprobs) == [-0.1, -0.2, -0.3]


def test_mask_runs_give_the_calls_back_and_observations_feed_the_next_call():
    # output 5 6, tool 8 9, output 7, trailing tool 4
    turns = session_turns([1, 2], [5, 6, 8, 9, 7, 4], [1, 1, 0, 0, 1, 0], None, first_version=2, last_version=4)
    assert _calls(turns) == [([1, 2], [5, 6], 2), ([8, 9], [7], 4), ([4], [], 4)]
    assert list(turns[1].output_logprobs) == [0.0]  # verl computed none


def test_an_observation_before_any_output_leaves_the_prompt_alone_in_turn_0():
    turns = session_turns([1, 2], [8, 5], [0, 1], None, first_version=0, last_version=0)
    assert _calls(turns) == [([1, 2], [], 0), ([8], [5], 0)]


def test_misaligned_masks_are_refused():
    with pytest.raises(ValueError, match="response_mask"):
        session_turns([1], [5, 6], [1], None, first_version=0, last_version=0)
    with pytest.raises(ValueError, match="response_logprobs"):
        session_turns([1], [5, 6], [1, 1], [0.0], first_version=0, last_version=0)


def test_a_session_is_a_receipt_and_its_staged_calls_that_linearize_back():
    output = {
        "prompt_ids": [1, 2, 3],
        "response_ids": [5, 6, 8, 7],
        "response_mask": [1, 1, 0, 1],
        "response_logprobs": [-1.0, -1.0, 0.0, -0.5],
        "reward_score": 1.0,
        "extra_fields": {"min_global_steps": 4, "max_global_steps": 5},
    }
    staged = session_rollout("u1", 2, 4, output, prompt_idx=7, environment="gsm8k", version_offset=10)
    r = staged.receipt
    assert (r.group_id, r.rollout_id, r.rollout_index, r.group_size, r.prompt_idx) == ("u1", "u1-s2", 2, 4, 7)
    assert (r.reward, r.environment, r.failure_reason, r.truncated) == (1.0, "gsm8k", None, False)
    assert [c.staging_key for c in r.manifest] == ["u1-s2/c0", "u1-s2/c1"]
    assert [c.weight_version for c in r.manifest] == [14, 15]
    row = linearize(r, {c.staging_key: seg for c, seg in zip(r.manifest, staged.segments)})
    assert row.prompt_ids.tolist() == [1, 2, 3] and (row.min_wv, row.max_wv) == (14, 15)
    assert [m["token_ids"].tolist() for m in row.message_log] == [[1, 2, 3], [5, 6], [8], [7]]
    assert session_rollout("u1", 0, 4, output, prompt_idx=0, environment="x", max_response_length=4).receipt.truncated


def test_a_failed_session_still_closes_its_group():
    r = failed_session("u1", 3, 4, prompt_idx=-1, environment="gsm8k", reason="RuntimeError: boom").receipt
    assert (r.rollout_id, r.rollout_index, r.prompt_idx, r.failure_reason, r.manifest) == (
        rollout_id("u1", 3),
        3,
        0,
        "RuntimeError: boom",
        (),
    )


OUTPUT = agent_output(step=3)
WHERE = {"prompt_idx": 2, "environment": "gsm8k"}


def test_a_group_is_always_rollout_n_rollouts_whatever_verl_asked_for():
    """verl lets a prompt ask for its own n (__rollout_n__); verl's trainer sizes mini-batches by rollout.n."""
    staged = group_rollouts("u1", 3, [OUTPUT], asked=1, **WHERE)
    receipts = [s.receipt for s in staged]
    assert [r.rollout_index for r in receipts] == [0, 1, 2] and {r.group_size for r in receipts} == {3}
    assert receipts[0].failure_reason is None
    assert all("__rollout_n__" in r.failure_reason and "rollout.n is 3" in r.failure_reason for r in receipts[1:])
    assert reaches_trainer(staged)


def test_a_session_that_cannot_be_converted_fails_alone_instead_of_leaving_its_group_open():
    broken = {**OUTPUT, "response_mask": [1]}  # misaligned: session_turns raises
    staged = group_rollouts("u1", 3, [OUTPUT, RuntimeError("server died"), broken], **WHERE)
    reasons = [s.receipt.failure_reason for s in staged]
    assert reasons[0] is None and reasons[1] == "RuntimeError: server died"
    assert reasons[2].startswith("ValueError: response_mask has 1 entries")


def test_a_group_without_a_usable_rollout_never_reaches_the_trainer():
    staged = failed_group("u1", 2, reason="publish failed", **WHERE)
    assert [s.receipt.rollout_id for s in staged] == ["u1-s0", "u1-s1"]
    assert not reaches_trainer(staged) and not reaches_trainer(group_rollouts("u1", 2, [], asked=0, **WHERE))
