"""`build_group`: the pure heart of finalization, from a group's receipts and staged segments to
packed rows, tags and counts; every rollout yields a row, failed ones as placeholders.

Each rollout is checked as `linearize` checks it (`check_rollout`), then the group's rows are
assembled straight from the checked segments (`schemas/train_rows.py`): the rows, tags and counts
that `record_to_train_batch` and `pack_payload` make from message logs, without building them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from schemas.linearize import Rejection, check_rollout
from schemas.payload import _row_tags, _tensordict
from schemas.receipt import Receipt
from schemas.request import RolloutReassemblerActorConfig
from schemas.train_rows import CheckedRollout, group_rows


@dataclass(frozen=True, eq=False)
class GroupBuild:
    """Packed rows of one prompt group (sample IDs, TQ fields, tags) and what the record reports."""

    sample_ids: list[str]
    fields: TensorDict
    tags: list[dict[str, Any]]
    rejection_reasons: tuple[str | None, ...]
    group_min_wv: int
    group_max_wv: int
    valid_row_count: int
    total_row_count: int
    canonical_output_tokens: int
    all_failed: bool


def build_group(
    *,
    group_id: str,
    prompt_idx: int,
    group_size: int,
    receipts: Sequence[Receipt | None],
    segments: Mapping[str, Mapping[str, torch.Tensor]],
    config: RolloutReassemblerActorConfig,
    fallback_weight_version: int = 0,
    loss_multiplier: float = 1.0,
) -> GroupBuild:
    """Check each rollout (receipts indexed by rollout_index; None = missing), keep failures as
    placeholder rows, and pack the group stamped with its lowest weight version.

    A row longer than `config.max_seq_len` is cut to that length and marked truncated (not
    rejected): its prefix is still on-policy data. Routed experts are kept only when
    `config.router_replay_enabled`. The prompt is the first valid rollout's (one pad token if none).
    """
    if len(receipts) != group_size:
        raise ValueError(f"got {len(receipts)} receipt slots for a group of {group_size}")
    slots: list[CheckedRollout | None] = []
    reasons: list[str | None] = []
    for index, receipt in enumerate(receipts):
        result = _check_slot(index, receipt, group_id, prompt_idx, group_size, segments)
        if isinstance(result, Rejection):
            slots.append(None)
            reasons.append(result.reason)
        else:
            slots.append(CheckedRollout(receipt, result))
            reasons.append(None)
    rows = group_rows(
        slots,
        pad_token_id=config.pad_token_id,
        max_seq_len=config.max_seq_len,
        router_replay=config.router_replay_enabled,
        loss_multiplier=loss_multiplier,
    )
    versions = [c.weight_version for s in slots if s is not None for c in s.receipt.manifest]
    min_wv = min(versions, default=fallback_weight_version)
    max_wv = max(versions, default=fallback_weight_version)
    shapes = {"routed_experts": list(rows.routed_rest)} if rows.routed_rest is not None else {}
    counts = {"violation_counts": rows.counts}
    tags = _row_tags(counts, group_size, rows.lengths, shapes, min_wv, group_id, prompt_idx)
    valid = sum(s is not None for s in slots)
    return GroupBuild(
        sample_ids=[f"{group_id}_g{i}" for i in range(group_size)],
        fields=_tensordict(rows.fields, group_size),
        tags=tags,
        rejection_reasons=tuple(reasons),
        group_min_wv=min_wv,
        group_max_wv=max_wv,
        valid_row_count=valid,
        total_row_count=group_size,
        canonical_output_tokens=sum(n for n, s in zip(rows.lengths, slots) if s is not None),
        all_failed=not valid,
    )


def _check_slot(
    index: int,
    receipt: Receipt | None,
    group_id: str,
    prompt_idx: int,
    group_size: int,
    segments: Mapping[str, Mapping[str, torch.Tensor]],
) -> list[Mapping[str, torch.Tensor]] | Rejection:
    if receipt is None:
        return Rejection("missing_receipt", f"no receipt for rollout {index}")
    expected = (group_id, index, group_size, prompt_idx)
    got = (receipt.group_id, receipt.rollout_index, receipt.group_size, receipt.prompt_idx)
    if got != expected:
        # A receipt in the wrong slot would silently swap rewards between rows.
        return Rejection(
            "invalid_receipt",
            f"slot {index}: (group_id, rollout_index, group_size, prompt_idx) is {got}, expected {expected}",
        )
    return check_rollout(receipt, segments)
