"""A prompt group's training rows straight from its rollouts' checked call segments, without message logs.

`record_to_train_batch` then `pack_payload` (`schemas/payload.py`) make the same rows from message
logs: a dict per message, token-aligned masks per message, rows padded to the group's width, then
viewed jagged again, dozens of tensor operations per call. But every field of a row is just its
calls' deltas one after the other (cut at `max_seq_len`), so here each field of the whole group is
ONE concatenation of segment slices, and its rows are jagged views of it: the same rows, the same
fields in the same order, the same tags and counts, at a handful of tensor operations per group.
A message of the log is a maximal run of equal `token_mask` within one call; the counts that
depend on messages (assistant turns, flagged turns, backfilled routed experts) are counted from
the run starts, within what truncation keeps. `tests/unit/schemas/test_train_rows.py` holds the
two paths side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from schemas.jagged import jagged_views, offsets_from_lengths, per_token_items
from schemas.payload import VIOLATION_TAG_KEYS
from schemas.receipt import Receipt

INVALID_MASK = "invalid_tool_call_mask"
MALFORMED_MASK = "malformed_thinking_mask"
ROUTED = "routed_experts"


@dataclass(frozen=True, eq=False)
class CheckedRollout:
    """A rollout that passed `linearize.check_rollout`: its receipt and its segments in call order."""

    receipt: Receipt
    segments: Sequence[Mapping[str, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class GroupRows:
    """The group's fields in `record_to_train_batch`'s order, each row's length, and its violation counts."""

    fields: dict[str, torch.Tensor]
    lengths: list[int]
    counts: list[dict[str, int]]
    routed_rest: tuple[int, ...] | None  # per-token shape of routed experts, if the rows carry them


@dataclass
class _Pieces:
    """Slices of the group's rows, in order: one per call kept (a row's prefix), one per placeholder."""

    ids: list[torch.Tensor]
    mask: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    experts: list[torch.Tensor]
    lengths: list[int]
    invalid: list[bool]
    malformed: list[bool]
    backfilled: list[bool]  # the piece's call was staged without routed experts (zeros stand in)
    slot: list[int]  # the row each piece belongs to


def group_rows(
    slots: Sequence[CheckedRollout | None],
    *,
    pad_token_id: int,
    max_seq_len: int,
    router_replay: bool,
    loss_multiplier: float,
) -> GroupRows:
    """The rows of a group whose slot i is rollout i, checked, or None for a placeholder row.

    Placeholder rows hold one pad token, zero reward and sample_mask 0. A row longer than
    `max_seq_len` is cut to it and marked truncated. With `router_replay`, routed experts take the
    dtype and per-token shape of the first kept call that has them (zeros, counted as backfilled,
    for calls staged without), and a call of another per-token shape, or a per-token shape of no
    item, raises `ValueError`, as the message-log path does.
    """
    n = len(slots)
    kept = [_kept(s, max_seq_len) for s in slots]
    like = _experts_like(slots, kept) if router_replay else None
    per_token = per_token_items(ROUTED, like[1]) if like is not None else 0  # raises as record_to_train_batch does
    p = _Pieces([], [], [], [], [], [], [], [], [])
    lengths: list[int] = []
    for i, (slot, keep) in enumerate(zip(slots, kept)):
        if slot is None:
            _placeholder(p, i, pad_token_id, like)
            lengths.append(1)
            continue
        for call, segment, k in zip(slot.receipt.manifest, slot.segments, keep):
            if k:
                _call_piece(p, i, call, segment, k, like)
        lengths.append(sum(keep))
    mask = torch.cat(p.mask)
    logprobs = torch.cat(p.logprobs).masked_fill_(~mask, 0.0)
    piece_lengths = torch.tensor(p.lengths, dtype=torch.int64)
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    token_fields = {
        "input_ids": torch.cat(p.ids),
        "generation_logprobs": logprobs,
        "token_mask": mask,
        INVALID_MASK: mask & torch.tensor(p.invalid).repeat_interleave(piece_lengths),
        MALFORMED_MASK: mask & torch.tensor(p.malformed).repeat_interleave(piece_lengths),
    }
    jagged = jagged_views(token_fields, offsets)
    valid = [s is not None for s in slots]
    receipts = [s.receipt if s is not None else None for s in slots]
    fields = {
        "input_ids": jagged["input_ids"],
        "input_lengths": torch.tensor(lengths, dtype=torch.int64),
        "generation_logprobs": jagged["generation_logprobs"],
        "token_mask": jagged["token_mask"],
        "sample_mask": torch.tensor(
            [float(loss_multiplier) if r is not None and r.mask_sample else 0.0 for r in receipts], dtype=torch.float32
        ),
        "prompt_ids_for_adv": _prompt(slots, pad_token_id).reshape(1, -1).repeat(n, 1),
        "mask_sample": torch.tensor([r is not None and r.mask_sample for r in receipts], dtype=torch.bool),
        "truncated": torch.tensor(
            [r is not None and (r.truncated or sum(c.delta_len for c in r.manifest) > max_seq_len) for r in receipts],
            dtype=torch.bool,
        ),
        "total_reward": torch.tensor(
            [float(r.reward) if r is not None else 0.0 for r in receipts], dtype=torch.float32
        ),
        INVALID_MASK: jagged[INVALID_MASK],
        MALFORMED_MASK: jagged[MALFORMED_MASK],
    }
    rest = None
    if like is not None:
        rest = tuple(like[1])
        experts = torch.cat([e.reshape(-1) for e in p.experts])
        fields[ROUTED] = jagged_views({ROUTED: experts}, offsets * per_token)[ROUTED]
    counts = _counts(p, mask, n, valid, like is not None)
    return GroupRows(fields, lengths, counts, rest)


def _kept(slot: CheckedRollout | None, limit: int) -> list[int]:
    """Tokens of each call within the first `limit` of the row (a prefix)."""
    if slot is None:
        return []
    out, left = [], limit
    for call in slot.receipt.manifest:
        out.append(max(0, min(call.delta_len, left)))
        left -= call.delta_len
    return out


def _experts_like(slots, kept) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and per-token shape of the first kept call's routed experts (the log's first message with them)."""
    for slot, keep in zip(slots, kept):
        if slot is None:
            continue
        for segment, k in zip(slot.segments, keep):
            routed = segment.get(ROUTED)
            if k and routed is not None:
                return routed.dtype, tuple(routed.shape[1:])
    return None


def _placeholder(p: _Pieces, slot: int, pad_id: int, like) -> None:
    p.ids.append(torch.tensor([pad_id], dtype=torch.int64))
    p.mask.append(torch.zeros(1, dtype=torch.bool))
    p.logprobs.append(torch.zeros(1, dtype=torch.float32))
    if like is not None:
        p.experts.append(torch.zeros((1, *like[1]), dtype=like[0]))
    _note(p, slot, 1, False, False, False)


def _call_piece(p: _Pieces, slot: int, call, segment, k: int, like) -> None:
    p.ids.append(segment["token_ids"][:k])
    p.mask.append(segment["token_mask"][:k])
    p.logprobs.append(segment["generation_logprobs"][:k])
    backfilled = False
    if like is not None:
        routed = segment.get(ROUTED)
        if routed is None:
            routed, backfilled = torch.zeros((k, *like[1]), dtype=like[0]), True
        elif tuple(routed.shape[1:]) != like[1]:
            run = _first_run(segment["token_mask"][:k])
            raise ValueError(
                f"routed_experts shape {(run, *tuple(routed.shape[1:]))} does not fit {run} tokens x {like[1]}"
            )
        p.experts.append(routed[:k].to(like[0]))
    _note(p, slot, k, call.invalid_tool_call, call.malformed_thinking, backfilled)


def _note(p: _Pieces, slot: int, length: int, invalid: bool, malformed: bool, backfilled: bool) -> None:
    p.lengths.append(length)
    p.invalid.append(bool(invalid))
    p.malformed.append(bool(malformed))
    p.backfilled.append(backfilled)
    p.slot.append(slot)


def _first_run(mask: torch.Tensor) -> int:
    """The length of the first maximal run of equal values of `mask`: a call's first message."""
    changes = torch.nonzero(mask[1:] != mask[:-1])
    return int(changes[0]) + 1 if changes.numel() else int(mask.numel())


def _counts(p: _Pieces, mask: torch.Tensor, n: int, valid: list[bool], experts: bool) -> list[dict[str, int]]:
    """Per row: the messages (runs of one call) that are generated turns, flagged ones, and backfilled ones."""
    pieces = len(p.lengths)
    piece_lengths = torch.tensor(p.lengths, dtype=torch.int64)
    piece_of = torch.arange(pieces).repeat_interleave(piece_lengths)
    starts = torch.ones_like(mask)
    starts[1:] = mask[1:] != mask[:-1]
    starts[offsets_from_lengths(piece_lengths)[:-1]] = True  # a message never spans two calls
    generated = torch.bincount(piece_of[starts & mask], minlength=pieces).tolist()
    messages = torch.bincount(piece_of[starts], minlength=pieces).tolist() if experts else [0] * pieces
    counts = [dict.fromkeys(VIOLATION_TAG_KEYS, 0) for _ in range(n)]
    for j in range(pieces):
        row = p.slot[j]
        if not valid[row]:
            continue
        c = counts[row]
        c["num_assistant_messages"] += generated[j]
        c["num_invalid_tool_calls"] += generated[j] if p.invalid[j] else 0
        c["num_malformed_thinking"] += generated[j] if p.malformed[j] else 0
        c["num_routed_experts_backfilled"] += messages[j] if p.backfilled[j] else 0
    return counts


def _prompt(slots: Sequence[CheckedRollout | None], pad_id: int) -> torch.Tensor:
    """The first valid rollout's prompt (call 0's tokens before its first generated one), else one pad token."""
    slot = next((s for s in slots if s is not None), None)
    if slot is None:
        return torch.tensor([pad_id], dtype=torch.int64)
    first = slot.segments[0]
    generated = torch.nonzero(first["token_mask"])
    end = int(generated[0]) if generated.numel() else int(first["token_mask"].numel())
    return first["token_ids"][:end].to(torch.int64)
