"""From an engine's per-turn generation output to a `StagedRollout` ready for a publisher.

`staged_rollout(turns, ...)` builds the receipt (manifest with call ids, parent links, lengths and
digests, from `schemas.turns`) and the call segments to stage under `{rollout_id}/{call_id}`;
`failed_rollout(...)` builds the receipt of a rollout that produced nothing usable. A rollout
worker fills `Turn`s from its engine and never computes `prev_len`, `cum_len` or digests itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.receipt import Receipt
from schemas.turns import Turn, turns_to_calls
from workers.rollout.publisher import StagedRollout

__all__ = ["Turn", "failed_rollout", "staged_rollout"]


def staged_rollout(
    turns: Sequence[Turn],
    *,
    rollout_id: str,
    group_id: str,
    prompt_idx: int,
    rollout_index: int,
    group_size: int,
    reward: float,
    environment: str,
    mask_sample: bool = True,
    loss_multiplier: float = 1.0,
    truncated: bool = False,
) -> StagedRollout:
    """The receipt and staged segments of one finished rollout; SchemaError names a bad turn's field."""
    segments, calls = turns_to_calls(rollout_id, turns)
    receipt = Receipt(
        rollout_id=rollout_id,
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=rollout_index,
        group_size=group_size,
        reward=reward,
        mask_sample=mask_sample,
        loss_multiplier=loss_multiplier,
        environment=environment,
        failure_reason=None,
        manifest=tuple(calls),
        truncated=truncated,
    )
    return StagedRollout(receipt, segments)


def failed_rollout(
    *,
    rollout_id: str,
    group_id: str,
    prompt_idx: int,
    rollout_index: int,
    group_size: int,
    environment: str,
    failure_reason: str,
    reward: float = 0.0,
) -> StagedRollout:
    """The receipt of a rollout that failed before producing a usable turn (no calls, nothing staged)."""
    receipt = Receipt(
        rollout_id=rollout_id,
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=rollout_index,
        group_size=group_size,
        reward=reward,
        mask_sample=True,
        loss_multiplier=1.0,
        environment=environment,
        failure_reason=failure_reason,
        manifest=(),
    )
    return StagedRollout(receipt, [])
