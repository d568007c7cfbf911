"""`build_group`: the pure heart of finalization, from a group's receipts and staged segments to
packed rows, tags and counts; every rollout yields a row, failed ones as placeholders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from schemas.gym_linearize import gym_linearize
from schemas.gym_receipt import GymReceipt
from schemas.linearize import LinearizedRollout, Rejection, linearize, media_of
from schemas.payload import Completion, PromptGroupRecord, pack_payload, record_to_train_batch
from schemas.receipt import Receipt
from schemas.request import RolloutReassemblerActorConfig
from schemas.row_fields import taken_by_row

AnyReceipt = Receipt | GymReceipt


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
    receipts: Sequence[AnyReceipt | None],
    segments: Mapping[str, Any],
    config: RolloutReassemblerActorConfig,
    fallback_weight_version: int = 0,
    loss_multiplier: float = 1.0,
    gym_rows: Mapping[str, Any] | None = None,
) -> GroupBuild:
    """Linearize each rollout (receipts indexed by rollout_index; None = missing), keep failures
    as placeholder rows, and pack the group stamped with its lowest weight version.

    Receipts may be rlstream's (`segments[key]`: the call's staged tensors) or NeMo Gym's
    (`gym_rows[key]`: its `schemas.staged_rows.GymStagedRow`, or why it cannot be read), even
    within one group; `gym_rows` defaults to `segments` (one mapping holding both kinds).

    A row longer than `config.max_seq_len` is cut to that length and marked truncated (not
    rejected): its prefix is still on-policy data. Media rides only with all the tokens it stands in
    (`_media_cut`: a cut inside a media call's fed tokens moves back to that call's start). Routed
    experts are kept only when `config.router_replay_enabled`. The prompt is the first valid
    rollout's (one pad token if none).
    """
    if len(receipts) != group_size:
        raise ValueError(f"got {len(receipts)} receipt slots for a group of {group_size}")
    completions: list[Completion] = []
    rollouts: list[LinearizedRollout | None] = []
    media_dtypes: dict[str, torch.dtype] = {}
    for index, receipt in enumerate(receipts):
        rows = segments if gym_rows is None or not isinstance(receipt, GymReceipt) else gym_rows
        result = _linearize_slot(index, receipt, group_id, prompt_idx, group_size, rows)
        kept = _kept(result, config.max_seq_len, media_dtypes) if not isinstance(result, Rejection) else result
        if isinstance(kept, Rejection):
            completions.append(Completion([], 0.0, False, False, rejection_reason=kept.reason))
            rollouts.append(None)
            continue
        limit, media = kept
        log, cut = _truncate(result.message_log, limit)
        if not config.router_replay_enabled:
            log = [{k: v for k, v in m.items() if k != "routed_experts"} for m in log]
        completions.append(
            Completion(log, receipt.reward, receipt.truncated or cut, receipt.mask_sample, multimodal=media)
        )
        rollouts.append(result)

    valid = [r for r in rollouts if r is not None]
    # NeMo RL's placeholder prompt too: one pad token when no rollout has a prompt to lend.
    prompt = valid[0].prompt_ids if valid and valid[0].prompt_ids.numel() else torch.tensor([config.pad_token_id])
    environment = next((r.environment for r in receipts if r is not None), "unknown") or "unknown"
    record = PromptGroupRecord(prompt, tuple(completions), loss_multiplier, rollout_environment=environment)
    batch = record_to_train_batch(
        record,
        pad_value_dict={"input_ids": config.pad_token_id},
        include_message_violation_fields=True,
    )
    if not config.router_replay_enabled:
        batch.pop("routed_experts", None)
    min_wv = min((r.min_wv for r in valid), default=fallback_weight_version)
    max_wv = max((r.max_wv for r in valid), default=fallback_weight_version)
    sample_ids, fields, tags = pack_payload(batch, weight_version=min_wv, group_id=group_id, prompt_idx=prompt_idx)
    lengths = batch["input_lengths"].tolist()
    return GroupBuild(
        sample_ids=sample_ids,
        fields=fields,
        tags=tags,
        rejection_reasons=tuple(c.rejection_reason for c in completions),
        group_min_wv=min_wv,
        group_max_wv=max_wv,
        valid_row_count=len(valid),
        total_row_count=group_size,
        canonical_output_tokens=sum(n for n, r in zip(lengths, rollouts) if r is not None),
        all_failed=not valid,
    )


def _linearize_slot(
    index: int,
    receipt: AnyReceipt | None,
    group_id: str,
    prompt_idx: int,
    group_size: int,
    segments: Mapping[str, Any],
) -> LinearizedRollout | Rejection:
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
    if isinstance(receipt, GymReceipt):
        return gym_linearize(receipt, segments)
    return linearize(receipt, segments)


def _kept(
    rollout: LinearizedRollout, max_seq_len: int, dtypes: dict[str, torch.dtype]
) -> tuple[int, dict[str, list[torch.Tensor]]] | Rejection:
    """Where the row is cut and the media it keeps, or why it cannot be kept."""
    limit, media = _media_cut(rollout, max_seq_len)
    if limit == 0:
        return Rejection(
            "truncated_media", f"its prompt, which its media stands in, is longer than max_seq_len {max_seq_len}"
        )
    return _media_rejection(media, dtypes) or (limit, media)


def _media_rejection(media: Mapping[str, list[torch.Tensor]], dtypes: dict[str, torch.dtype]) -> Rejection | None:
    """Why a row's media cannot join its group's (None when they can; `dtypes` then learns its fields).

    A packed field has one dtype per group: the first valid row's that carries it, in rollout order.
    A later row whose segments of it have another dtype (or whose own calls disagree) is rejected
    alone, `inconsistent_media`; a field named like a row field, `invalid_staging_row` (the sink
    refuses both names, so only a row staged around it gets here).
    """
    for name, parts in sorted(media.items()):
        if taken_by_row(name):
            return Rejection("invalid_staging_row", f"media {name!r} takes the name of a training row field")
        kinds = {p.dtype for p in parts}
        want = dtypes.get(name)
        if len(kinds) > 1 or (want is not None and kinds and kinds != {want}):
            shown = sorted(str(k).removeprefix("torch.") for k in kinds)
            first = f"; the group's earlier rows carry {str(want).removeprefix('torch.')}" if want is not None else ""
            return Rejection("inconsistent_media", f"media {name!r} in {', '.join(shown)}{first}")
    for name, parts in media.items():
        if parts:
            dtypes.setdefault(name, parts[0].dtype)
    return None


def _media_cut(rollout: LinearizedRollout, max_seq_len: int) -> tuple[int, dict[str, list[torch.Tensor]]]:
    """Where a row is cut (`max_seq_len`, or earlier) and the media it keeps.

    A call's media stands in for tokens it was fed (an image's placeholders), so the media rides only
    with all of them: a cut inside a media call's fed tokens moves back to where that call begins
    (the call, its media and its generated tokens go; a cut row is on-policy up to there), and the
    media of a call the cut leaves nothing of goes. 0 when even the root call's prompt, with its
    media, does not fit: the row is rejected (`truncated_media`).
    """
    if rollout.length <= max_seq_len:
        return max_seq_len, rollout.multimodal
    limit = max_seq_len
    for span in reversed(rollout.media_spans):
        if span.start < limit < span.fed_end:
            limit = span.start
    return limit, media_of([s for s in rollout.media_spans if s.start < limit and s.fed_end <= limit])


def _truncate(log: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], bool]:
    """Cut a message log to at most `limit` tokens; say whether anything was cut."""
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
