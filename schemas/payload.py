"""Producer-side payload helpers: violation counts and masks, `record_to_train_batch`, and the
jagged `pack_payload` / `unpack_payload` pair that moves rows through TQ.

The message keys are NeMo RL's (`nemo_rl.experience.payload`): a generated assistant turn is flagged
by `is_invalid_tool_call` and `has_malformed_thinking`. rlstream's earlier spellings
(`invalid_tool_call`, `malformed_thinking`) are still read, never counted as 0; a message carrying
both spellings with different values is refused, naming both. Rows are tagged with NeMo RL's
`rollout_environment` (unless it is "unknown") and carry packed multimodal inputs
(`schemas.multimodal`) with their `<field>__row_shapes` tags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from schemas.jagged import JaggedLayout, JaggedRows, is_nested, jagged_rows, pad_rows, per_token_items, stack_padded
from schemas.multimodal import ROW_SHAPES_SUFFIX, PackedRows, packed_fields
from schemas.row_fields import ROLLOUT_ENVIRONMENT, taken_by_row
from schemas.violations import (
    _INVALID_MASK,
    _MALFORMED_MASK,
    _VIOLATION_COUNTS_KEY,
    INVALID_TOOL_CALL,
    MALFORMED_THINKING,
    VIOLATION_TAG_KEYS,
    _add_message_violation_masks,
    _is_generated,
    _violation_counts,
)

# NeMo RL's `nemo_rl.experience.payload` names, re-exported where its users look for them.
__all__ = [
    "INVALID_TOOL_CALL",
    "ROW_SHAPES_SUFFIX",
    "MALFORMED_THINKING",
    "VIOLATION_TAG_KEYS",
    "_VIOLATION_COUNTS_KEY",
    "Completion",
    "PromptGroupRecord",
    "_add_message_violation_masks",
    "_violation_counts",
    "pack_payload",
    "record_to_train_batch",
    "unpack_payload",
]

_UNKNOWN_ENVIRONMENT = "unknown"
# Per-row fields that are never token-aligned, even when their width happens to equal L.
_PER_ROW_FIELDS = frozenset({"prompt_ids_for_adv"})


@dataclass(frozen=True, eq=False)
class Completion:
    """One rollout of a prompt group; one with a `rejection_reason` is a placeholder row."""

    message_log: list[dict[str, Any]]
    reward: float
    truncated: bool
    mask_sample: bool
    rejection_reason: str | None = None
    # Packed multimodal inputs of this row: field -> its segments (e.g. one pixel tensor per image).
    multimodal: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class PromptGroupRecord:
    """A prompt group ready to become training rows (holds tensors; never sent over the wire)."""

    prompt_ids: torch.Tensor
    completions: tuple[Completion, ...]
    loss_multiplier: float = 1.0
    # NeMo RL's `record.metadata["rollout_environment"]`: stamped on every row's tags unless "unknown".
    rollout_environment: str = _UNKNOWN_ENVIRONMENT


def record_to_train_batch(
    record: PromptGroupRecord,
    *,
    pad_value_dict: Mapping[str, int],
    include_message_violation_fields: bool,
) -> dict[str, Any]:
    """Convert one prompt group's record into N rows padded to the group's longest row.

    Token-aligned fields are padded with `pad_value_dict.get(field, 0)`. A placeholder row holds
    one pad token, a zero reward and sample_mask 0. The caller's message dicts are not modified.
    """
    completions = record.completions
    if not completions:
        raise ValueError("a prompt group needs at least one completion")
    pad_id = int(pad_value_dict.get("input_ids", 0))
    # Shallow copies: the violation masks land on these, not on the caller's messages.
    logs = [None if c.rejection_reason is not None else [dict(m) for m in c.message_log] for c in completions]
    if include_message_violation_fields:
        _add_message_violation_masks([log for log in logs if log is not None])
    experts_like = next((m["routed_experts"] for log in logs if log for m in log if "routed_experts" in m), None)
    rows: dict[str, list[torch.Tensor]] = {"input_ids": [], "generation_logprobs": [], "token_mask": []}
    if include_message_violation_fields:
        rows[_INVALID_MASK], rows[_MALFORMED_MASK] = [], []
    if experts_like is not None:
        per_token_items("routed_experts", tuple(experts_like.shape[1:]))  # the group is refused, not packed
        rows["routed_experts"] = []
    counts: list[dict[str, int]] = []
    for _completion, log in zip(completions, logs):
        if log is None:
            _append_placeholder(rows, pad_id, experts_like)
            counts.append(dict.fromkeys(VIOLATION_TAG_KEYS, 0))
            continue
        if not log or sum(int(m["token_ids"].shape[0]) for m in log) == 0:
            raise ValueError("a completion that is not a placeholder must hold at least one token")
        row_counts = _violation_counts(log)
        row_counts["num_routed_experts_backfilled"] += _append_row(rows, log, experts_like)
        counts.append(row_counts)

    return _train_rows(record, rows, counts, pad_value_dict)


def _train_rows(
    record: PromptGroupRecord,
    rows: dict[str, list[torch.Tensor]],
    counts: list[dict[str, int]],
    pad_value_dict: Mapping[str, int],
) -> dict[str, Any]:
    """The padded batch and the per-row scalars of a group whose token rows are gathered."""
    completions = record.completions
    n = len(completions)
    length_list = [int(r.shape[0]) for r in rows["input_ids"]]
    lengths = torch.tensor(length_list, dtype=torch.int64)
    width = max(length_list)
    batch: dict[str, Any] = {
        name: stack_padded(parts, width, pad_value_dict.get(name, 0)) for name, parts in rows.items()
    }
    valid = [c.rejection_reason is None for c in completions]
    multiplier = float(record.loss_multiplier)
    prompt = record.prompt_ids.to(torch.int64).reshape(1, -1)
    out = {
        "input_ids": batch["input_ids"],
        "input_lengths": lengths,
        "generation_logprobs": batch["generation_logprobs"],
        "token_mask": batch["token_mask"],
        "sample_mask": torch.tensor(
            [multiplier if ok and c.mask_sample else 0.0 for ok, c in zip(valid, completions)],
            dtype=torch.float32,
        ),
        "prompt_ids_for_adv": prompt.repeat(n, 1),
        "mask_sample": torch.tensor([c.mask_sample for c in completions], dtype=torch.bool),
        "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
        "total_reward": torch.tensor(
            [float(c.reward) if ok else 0.0 for ok, c in zip(valid, completions)],
            dtype=torch.float32,
        ),
        _VIOLATION_COUNTS_KEY: counts,
    }
    for name in (_INVALID_MASK, _MALFORMED_MASK, "routed_experts"):
        if name in batch:
            out[name] = batch[name]
    out[ROLLOUT_ENVIRONMENT] = record.rollout_environment
    out.update(_multimodal(completions))
    return out


def _multimodal(completions: Sequence[Completion]) -> dict[str, PackedRows]:
    """Each packed multimodal field of the group, one row per completion (none for a placeholder)."""
    names = sorted({name for c in completions if c.rejection_reason is None for name in c.multimodal})
    out = {}
    for name in names:
        if taken_by_row(name):
            raise ValueError(f"multimodal input {name!r} would take the name of a row field")
        rows = [list(c.multimodal.get(name, ())) if c.rejection_reason is None else [] for c in completions]
        out[name] = PackedRows(rows)
    return out


def _append_placeholder(rows: dict[str, list[torch.Tensor]], pad_id: int, experts_like: torch.Tensor | None) -> None:
    # One pad token, so that every row has input_length >= 1 and nothing is learned from it.
    rows["input_ids"].append(torch.tensor([pad_id], dtype=torch.int64))
    rows["generation_logprobs"].append(torch.zeros(1, dtype=torch.float32))
    for name in ("token_mask", _INVALID_MASK, _MALFORMED_MASK):
        if name in rows:
            rows[name].append(torch.zeros(1, dtype=torch.bool))
    if experts_like is not None:
        rows["routed_experts"].append(experts_like.new_zeros((1, *experts_like.shape[1:])))


def _append_row(
    rows: dict[str, list[torch.Tensor]],
    log: list[dict[str, Any]],
    experts_like: torch.Tensor | None,
) -> int:
    """Append one completion's concatenated messages; return how many messages were backfilled."""
    backfilled = 0
    ids, logprobs, token_mask, experts = [], [], [], []
    for message in log:
        tokens = message["token_ids"]
        if tokens.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(tokens.shape)}")
        length = int(tokens.shape[0])
        ids.append(tokens.to(torch.int64))
        generated = _is_generated(message)
        if generated:
            lp = message["generation_logprobs"]
            if lp.shape != tokens.shape:
                raise ValueError(f"generation_logprobs shape {tuple(lp.shape)} != {length} tokens")
            logprobs.append(lp.to(torch.float32))
        else:
            logprobs.append(torch.zeros(length, dtype=torch.float32))
        token_mask.append(torch.full((length,), generated))
        if experts_like is not None:
            routed = message.get("routed_experts")
            if routed is None:
                routed = experts_like.new_zeros((length, *experts_like.shape[1:]))
                backfilled += 1
            elif routed.shape[0] != length or routed.shape[1:] != experts_like.shape[1:]:
                raise ValueError(
                    f"routed_experts shape {tuple(routed.shape)} does not fit {length} tokens "
                    f"x {tuple(experts_like.shape[1:])}"
                )
            experts.append(routed.to(experts_like.dtype))
    rows["input_ids"].append(torch.cat(ids))
    rows["generation_logprobs"].append(torch.cat(logprobs))
    rows["token_mask"].append(torch.cat(token_mask))
    for name in (_INVALID_MASK, _MALFORMED_MASK):
        if name in rows:
            rows[name].append(torch.cat([m[name] for m in log]))
    if experts_like is not None:
        rows["routed_experts"].append(torch.cat(experts))
    return backfilled


def group_sample_ids(group_id: str, n: int) -> list[str]:
    """The sample ids of a group's `n` training rows: `{group_id}_g{i}`, the same for every attempt at it."""
    return [f"{group_id}_g{i}" for i in range(n)]


def pack_payload(
    train_batch: Mapping[str, Any],
    *,
    weight_version: int,
    group_id: str,
    prompt_idx: int,
) -> tuple[list[str], TensorDict, list[dict[str, Any]]]:
    """Pack N padded rows into (sample_ids, fields, tags) for a TQ put.

    Token-aligned fields (dim 1 == the padded width) become jagged nested tensors whose rows are
    the padded rows cut to their input lengths, flattened to 1-D with the row shape in the tag
    `<field>__row_shapes` when a row has more than one dim. They are views of `train_batch`'s
    memory, not copies: TQ's put copies each row once when it serializes it, so a cut here would
    only copy the group twice. Other tensors stay as they are.
    """
    # A copy: the jagged views keep it as their row lengths, apart from the caller's tensor.
    lengths = torch.as_tensor(train_batch["input_lengths"]).to(torch.int64).reshape(-1).clone()
    length_list = lengths.tolist()
    n = len(length_list)
    input_ids = train_batch.get("input_ids")
    if input_ids is not None:
        width = int(input_ids.shape[1])
    else:
        width = max(length_list, default=0)
    if n and (max(length_list) > width or min(length_list) < 0):
        raise ValueError(f"input_lengths {length_list} do not fit the padded width {width}")
    layout = JaggedLayout(lengths, width, full=not n or min(length_list) == width)

    fields: dict[str, torch.Tensor] = {}
    row_shapes: dict[str, list[int]] = {}
    geometry: list[list[dict[str, Any]]] = []
    for name, value in train_batch.items():
        if name in (_VIOLATION_COUNTS_KEY, ROLLOUT_ENVIRONMENT):
            continue
        if isinstance(value, PackedRows):
            if len(value) != n:
                raise ValueError(f"train_batch[{name!r}] holds {len(value)} rows, not {n}")
            wire = value.to_wire()
            if wire is not None:  # every row empty: the field is not sent (NeMo RL omits it too)
                fields[name] = wire
                geometry.append(value.row_tags(name))
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"train_batch[{name!r}] is a {type(value).__name__}, not a tensor")
        shape = value.shape
        if not shape or shape[0] != n:
            raise ValueError(f"train_batch[{name!r}] has shape {tuple(shape)}, not [{n}, ...]")
        if len(shape) >= 2 and shape[1] == width and name not in _PER_ROW_FIELDS:
            fields[name] = layout.view(value)
            if len(shape) > 2:
                row_shapes[name] = list(shape[2:])
        else:
            fields[name] = value

    tags = _row_tags(train_batch, n, length_list, row_shapes, weight_version, group_id, prompt_idx)
    environment = train_batch.get(ROLLOUT_ENVIRONMENT, _UNKNOWN_ENVIRONMENT)
    for i, tag in enumerate(tags):
        if environment != _UNKNOWN_ENVIRONMENT:
            tag[ROLLOUT_ENVIRONMENT] = environment
        for per_field in geometry:
            tag.update(per_field[i])
    sample_ids = group_sample_ids(group_id, n)
    return sample_ids, _tensordict(fields, n), tags


def _row_tags(
    train_batch: Mapping[str, Any],
    n: int,
    length_list: list[int],
    row_shapes: dict[str, list[int]],
    weight_version: int,
    group_id: str,
    prompt_idx: int,
) -> list[dict[str, Any]]:
    counts = train_batch.get(_VIOLATION_COUNTS_KEY)
    if counts is None:
        counts = [{}] * n
    elif len(counts) != n:
        raise ValueError(f"train_batch[{_VIOLATION_COUNTS_KEY!r}] has {len(counts)} rows, not {n}")
    shape_tags = [(name + ROW_SHAPES_SUFFIX, rest) for name, rest in row_shapes.items()]
    tags = []
    for i, row_counts in enumerate(counts):
        tag = {"weight_version": weight_version, "prompt_idx": prompt_idx, "group_id": group_id, "rollout_index": i}
        for key in VIOLATION_TAG_KEYS:
            tag[key] = int(row_counts.get(key, 0))
        for key, rest in shape_tags:
            tag[key] = [length_list[i], *rest]
        tags.append(tag)
    return tags


def unpack_payload(
    fields: Mapping[str, torch.Tensor] | TensorDictBase,
    tags: Sequence[Mapping[str, Any]],
    *,
    pad_value_dict: Mapping[str, int],
) -> dict[str, torch.Tensor]:
    """Turn jagged rows (of one or several groups) back into padded tensors for the trainer.

    Each jagged field is padded to its longest row with `pad_value_dict.get(field, 0)`
    (`prompt_ids_for_adv` falls back to the input_ids pad); regular tensors pass through, and so do
    packed multimodal fields, jagged as they came (`schemas.multimodal.PackedRows.from_wire` gives
    their segments back).
    """
    out: dict[str, torch.Tensor] = {}
    packed = packed_fields(tags)
    # Fields packed together share their offsets and lengths tensors: measure those rows once.
    # Each entry holds its rows, so that no id() in a key can be reused within this call.
    measured: dict[tuple[int, int, int], tuple[list[int], int, JaggedRows]] = {}
    for name, value in fields.items():
        if not is_nested(value) or name in packed:
            out[name] = value
            continue
        rows = jagged_rows(value)
        key = (id(rows.offsets), id(rows.lengths), rows.scale)
        if key not in measured:
            lengths = rows.item_lengths()
            measured[key] = lengths, max(lengths, default=0), rows
        lengths, longest, _ = measured[key]
        rest = _tagged_row_rest(name, tags) or list(rows.rest)
        per_token = math.prod(rest)
        if per_token == 0:
            raise ValueError(f"rows of {name!r} have an empty per-token shape {rest}")
        if per_token != 1 and any(length % per_token for length in lengths):
            raise ValueError(f"rows of {name!r} are not whole tokens of shape {rest}")
        width = longest // per_token
        fill = pad_value_dict.get(name, 0)
        if name in _PER_ROW_FIELDS:
            fill = pad_value_dict.get(name, pad_value_dict.get("input_ids", 0))
        padded = pad_rows(rows, width * per_token, fill)
        out[name] = padded.view(len(lengths), width, *rest) if rest else padded
    return out


def _tagged_row_rest(name: str, tags: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per-token shape of a packed field's rows from its `__row_shapes` tags, which must agree."""
    shape_key = name + ROW_SHAPES_SUFFIX
    if not tags or shape_key not in tags[0]:
        return []
    rest = [int(d) for d in tags[0][shape_key][1:]]
    first = tags[0][shape_key][1:]
    for i, tag in enumerate(tags):
        # Raw comparison first (tags of one group are alike); normalize only when it fails.
        shape = tag[shape_key][1:]
        if shape != first and [int(d) for d in shape] != rest:
            raise ValueError(f"rows of {name!r} disagree on their shape: row {i} {tag[shape_key]}")
    return rest


def _tensordict(fields: dict[str, torch.Tensor], n: int) -> TensorDict:
    # Every value was built here with first dim n; the checked constructor costs ~60 us a group.
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)
    if new_unsafe is not None:
        return new_unsafe(fields, batch_size=torch.Size([n]))
    return TensorDict(fields, batch_size=[n])  # pragma: no cover
