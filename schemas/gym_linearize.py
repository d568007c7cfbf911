"""`gym_linearize`: a NeMo Gym receipt and its staged calls as one rollout's message log, or its rejection.

The same steps, and the same reasons, as NeMo RL's `RolloutReassembler.finalize_rollout` for one
rollout: a failed or poisoned receipt is rejected before any staged row is looked at; a manifest
row whose staged call is missing is `missing_staging_row`, one that cannot be read as a NeMo Gym
call `invalid_staging_row`; everything else is `verify_and_linearize`'s, and a refusal is the code
NeMo Gym gives it. The row it verified becomes messages: per call of the terminal chain, its carried
tokens (the prompt for the root, a tool or environment observation after it) and its generated
tokens as an assistant turn with the call's logprobs and NeMo RL's violation flags. The
attachments of the chain's calls (media a VLM call ran on) become the row's packed multimodal
inputs, one segment per call, in chain order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from schemas.errors import ReceiptVerificationError
from schemas.gym_receipt import GymReceipt
from schemas.gym_verify import LinearizedRow, verify_and_linearize, verify_receipt
from schemas.linearize import LinearizedRollout, MediaSpan, Rejection, media_of
from schemas.payload import INVALID_TOOL_CALL, MALFORMED_THINKING
from schemas.staged_rows import GymStagedRow

_INT64_MAX = 2**63 - 1


def gym_linearize(receipt: GymReceipt, rows: Mapping[str, Any]) -> LinearizedRollout | Rejection:
    """`rows[staging_key]` is that call's `GymStagedRow` (absent: missing; anything else: not readable)."""
    inner = receipt.receipt
    try:
        verify_receipt(inner)
    except ReceiptVerificationError as exc:
        return Rejection(exc.code, exc.detail)
    staged: list[GymStagedRow] = []
    for i, record in enumerate(inner.manifest):
        row = rows.get(record.staging_key)
        if row is None:
            return Rejection("missing_staging_row", f"manifest[{i}]: no staged call {record.staging_key!r}")
        if not isinstance(row, GymStagedRow):
            detail = row if isinstance(row, str) else "not a NeMo Gym staged call"
            return Rejection("invalid_staging_row", f"manifest[{i}] ({record.staging_key}): {detail}")
        staged.append(row)
    try:
        verified = verify_and_linearize(inner, [r.call for r in staged])
    except ReceiptVerificationError as exc:
        return Rejection(exc.code, exc.detail)
    if max(verified.token_ids) > _INT64_MAX:
        # NeMo Gym's ids are u64; a training row's are int64 (no tokenizer comes near either bound).
        return Rejection("invalid_staging_row", f"a token id of {max(verified.token_ids)} does not fit int64")
    by_call = {r.call.model_call_id: r for r in staged}
    versions = [record.weight_version for record in inner.manifest]
    messages = _messages(receipt, verified)
    spans = _media_spans(verified, by_call)
    return LinearizedRollout(
        message_log=messages,
        prompt_ids=torch.tensor(verified.token_ids[: verified.prompt_len], dtype=torch.int64),
        weight_versions=tuple(verified.weight_versions),
        # Over the whole manifest, as NeMo RL's finalizer takes them (off-chain calls too).
        min_wv=min(versions),
        max_wv=max(versions),
        length=len(verified.token_ids),
        multimodal=media_of(spans),
        media_spans=spans,
    )


def _messages(receipt: GymReceipt, row: LinearizedRow) -> list[dict[str, Any]]:
    ids = torch.tensor(row.token_ids, dtype=torch.int64)
    logprobs = torch.tensor(row.logprobs, dtype=torch.float32)
    invalid, malformed = set(receipt.invalid_tool_call_calls), set(receipt.malformed_thinking_calls)
    messages: list[dict[str, Any]] = []
    at = 0
    for index, (call_id, carried, generated) in enumerate(row.link_spans):
        if carried:
            role = "user" if index == 0 else "environment"
            messages.append({"role": role, "token_ids": ids[at : at + carried]})
        at += carried
        messages.append(
            {
                "role": "assistant",
                "token_ids": ids[at : at + generated],
                "generation_logprobs": logprobs[at : at + generated],
                INVALID_TOOL_CALL: call_id in invalid,
                MALFORMED_THINKING: call_id in malformed,
            }
        )
        at += generated
    return messages


def _media_spans(row: LinearizedRow, by_call: Mapping[str, GymStagedRow]) -> tuple[MediaSpan, ...]:
    """The chain's calls with attachments, each with the row span of the tokens it was fed."""
    out, at = [], 0
    for call_id, carried, generated in row.link_spans:
        attachments = by_call[call_id].attachments
        if attachments:
            out.append(MediaSpan(at, at + carried, dict(attachments)))
        at += carried + generated
    return tuple(out)
