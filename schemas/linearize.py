"""`linearize`: rebuild one rollout's message log from its receipt and its staged call segments.

Every way a rollout can be unusable maps to one reason in `REJECTION_REASONS`, checked in an order
that gives each corruption its own reason; the group keeps the row as a placeholder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from schemas.digest import token_digest
from schemas.gym_verify import VERIFICATION_CODES
from schemas.payload import INVALID_TOOL_CALL, MALFORMED_THINKING
from schemas.receipt import CallRecord, Receipt

_OWN_REASONS = (
    "missing_receipt",
    "invalid_receipt",
    "rollout_failed",
    "duplicate_staging_key",
    "missing_staging_row",
    "invalid_staging_row",
    "rebuild_failed",
    # A row whose media (a NeMo Gym call's attachments) has another dtype than its group's earlier rows'.
    "inconsistent_media",
    # A row longer than max_seq_len whose cut would fall inside the prompt its media stands in.
    "truncated_media",
)
# rlstream's own reasons, then NeMo Gym's verification codes (a NeMo Gym receipt's row is rejected
# with the code NeMo Gym's verifier gives it; `rollout_failed` and `duplicate_staging_key` are both).
REJECTION_REASONS = _OWN_REASONS + tuple(c for c in VERIFICATION_CODES if c not in _OWN_REASONS)


@dataclass(frozen=True)
class Rejection:
    """Why a rollout cannot become a training row; `reason` is one of REJECTION_REASONS."""

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {self.reason!r}")


@dataclass(frozen=True, eq=False)
class MediaSpan:
    """A call's media and where in the row lie the tokens it was fed ([start, fed_end)), which the
    media stands in (an image's placeholder tokens are among a call's input, not its output)."""

    start: int
    fed_end: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True, eq=False)
class LinearizedRollout:
    """A rollout's message log in order, its prompt, and the weight versions of its calls."""

    message_log: list[dict[str, Any]]
    prompt_ids: torch.Tensor
    weight_versions: tuple[int, ...]
    min_wv: int
    max_wv: int
    length: int
    # Packed multimodal inputs of the row (field -> segments); a NeMo Gym receipt's attachments.
    multimodal: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # The calls those segments come from, in row order (a cut row keeps only the media it keeps the tokens of).
    media_spans: tuple[MediaSpan, ...] = ()


def media_of(spans: Sequence[MediaSpan]) -> dict[str, list[torch.Tensor]]:
    """The packed multimodal inputs of a row's media spans: per field, its segments in row order."""
    out: dict[str, list[torch.Tensor]] = {}
    for span in spans:
        for name, tensor in sorted(span.tensors.items()):
            out.setdefault(name, []).append(tensor)
    return out


def linearize(receipt: Receipt, segments: Mapping[str, Mapping[str, torch.Tensor]]) -> LinearizedRollout | Rejection:
    """Check the receipt's call chain and staged segments, then split each call's delta into
    prompt/environment runs (mask False) and assistant runs (mask True, with logprobs)."""
    if receipt.failure_reason is not None:
        return Rejection("rollout_failed", receipt.failure_reason)
    manifest = receipt.manifest
    rejection = _check_chain(manifest)
    if rejection is not None:
        return rejection
    checked = []
    for i, call in enumerate(manifest):
        segment = segments.get(call.staging_key)
        if segment is None:
            detail = f"manifest[{i}]: no segment {call.staging_key!r}"
            return Rejection("missing_staging_row", detail)
        if not isinstance(segment, Mapping):
            return Rejection("invalid_staging_row", f"manifest[{i}] ({call.staging_key}): not an rlstream staged call")
        problem = _segment_problem(call, segment)
        if problem is not None:
            detail = f"manifest[{i}] ({call.staging_key}): {problem}"
            return Rejection("invalid_staging_row", detail)
        checked.append(segment)
    if int(checked[0]["token_mask"][:1].sum()) or manifest[0].delta_len == 0:
        return Rejection("rebuild_failed", "call 0 does not begin with prompt tokens")
    message_log = []
    for i, (call, segment) in enumerate(zip(manifest, checked)):
        message_log.extend(_messages(call, segment, first_call=i == 0))
    versions = tuple(call.weight_version for call in manifest)
    return LinearizedRollout(
        message_log=message_log,
        prompt_ids=message_log[0]["token_ids"],
        weight_versions=versions,
        min_wv=min(versions),
        max_wv=max(versions),
        length=manifest[-1].cum_len,
    )


def _check_chain(manifest: tuple[CallRecord, ...]) -> Rejection | None:
    # Order matters: duplicates first (they make the links ambiguous), then links, then lengths.
    keys = [call.staging_key for call in manifest]
    if len(set(keys)) != len(keys):
        duplicate = next(key for key in keys if keys.count(key) > 1)
        return Rejection("duplicate_staging_key", f"staging key {duplicate!r} appears twice")
    for i, call in enumerate(manifest):
        expected = None if i == 0 else manifest[i - 1].call_id
        if call.parent_call_id != expected:
            return Rejection(
                "rebuild_failed",
                f"manifest[{i}].parent_call_id is {call.parent_call_id!r}, expected {expected!r}",
            )
    for i, call in enumerate(manifest):
        expected = 0 if i == 0 else manifest[i - 1].cum_len
        if call.prev_len != expected:
            return Rejection("invalid_receipt", f"manifest[{i}].prev_len is {call.prev_len}, expected {expected}")
        if call.prev_len + call.delta_len != call.cum_len:
            return Rejection(
                "invalid_receipt",
                f"manifest[{i}]: prev_len {call.prev_len} + delta_len {call.delta_len} != cum_len {call.cum_len}",
            )
    return None


def _segment_problem(call: CallRecord, segment: Mapping[str, Any]) -> str | None:
    """Describe how a staged segment disagrees with its call record, or None if it matches."""
    expected = {
        "token_ids": torch.int64,
        "token_mask": torch.bool,
        "generation_logprobs": torch.float32,
    }
    for name, dtype in expected.items():
        value = segment.get(name)
        if not isinstance(value, torch.Tensor):
            return f"{name} is missing"
        if value.is_nested or value.dim() != 1 or value.dtype != dtype:
            return f"{name} must be a 1-D {dtype} tensor, got {value.dtype} {tuple(value.shape)}"
        if value.shape[0] != call.delta_len:
            return f"{name} has {value.shape[0]} entries, delta_len is {call.delta_len}"
    routed = segment.get("routed_experts")
    if routed is not None:
        if not isinstance(routed, torch.Tensor) or routed.dim() != 2:
            return "routed_experts must be a [delta_len, k] tensor"
        if routed.is_floating_point() or routed.dtype == torch.bool:
            return f"routed_experts must hold integers, got {routed.dtype}"
        if routed.shape[0] != call.delta_len:
            return f"routed_experts has {routed.shape[0]} rows, delta_len is {call.delta_len}"
    logprobs = segment["generation_logprobs"][segment["token_mask"]]
    if not bool(torch.isfinite(logprobs).all()):
        return "generation_logprobs hold NaN or inf on generated tokens"
    digest = token_digest(segment["token_ids"])
    if digest != call.digest:
        return f"digest {digest} does not match the receipt's {call.digest}"
    return None


def _messages(call: CallRecord, segment: Mapping[str, Any], *, first_call: bool) -> list[dict]:
    """Split one call's delta into maximal runs of equal token_mask, one message per run."""
    mask = segment["token_mask"]
    if mask.numel() == 0:
        return []
    starts = [0, *(torch.nonzero(mask[1:] != mask[:-1]).flatten() + 1).tolist()]
    ends = [*starts[1:], mask.numel()]
    routed = segment.get("routed_experts")
    messages = []
    for run, (start, end) in enumerate(zip(starts, ends)):
        message: dict[str, Any] = {"token_ids": segment["token_ids"][start:end]}
        if bool(mask[start]):
            message["role"] = "assistant"
            message["generation_logprobs"] = segment["generation_logprobs"][start:end]
            message[INVALID_TOOL_CALL] = call.invalid_tool_call
            message[MALFORMED_THINKING] = call.malformed_thinking
        else:
            message["role"] = "user" if first_call and run == 0 else "environment"
        if routed is not None:
            message["routed_experts"] = routed[start:end]
        messages.append(message)
    return messages
