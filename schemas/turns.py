"""From an engine's per-turn generation output to the call chain a receipt carries, with its staged deltas.

A rollout is a list of `Turn`s: turn 0's `input_ids` are the prompt, a later turn's are the
observation (tool result, environment message) appended since the previous turn's output; each
turn's `output_ids` are what the model generated, with their logprobs. `turns_to_calls` turns them
into the segments to stage (token ids, a mask that is True exactly on output ids, logprobs that are
0 on input ids) and the matching `CallRecord`s: call ids `c0, c1, ...`, parent links, `prev_len`,
`delta_len`, `cum_len` and digests, so no caller computes them by hand. What it returns passes
`schemas.linearize`'s checks; bad input raises `SchemaError` naming the turn and field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from schemas.digest import token_digest
from schemas.errors import SchemaError
from schemas.receipt import CallRecord

TokenSeq = torch.Tensor | Sequence[int]


@dataclass(frozen=True, eq=False)
class Turn:
    """One model call of a rollout: the tokens fed since the last output, and what the model generated.

    `routed_experts`, when given, has one row per token of input + output ([len, k] integers).
    """

    input_ids: TokenSeq
    output_ids: TokenSeq
    output_logprobs: torch.Tensor | Sequence[float]
    weight_version: int
    invalid_tool_call: bool = False
    malformed_thinking: bool = False
    routed_experts: torch.Tensor | None = None


def _ids(path: str, value: Any) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(list(value), dtype=torch.int64)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise SchemaError(path, f"must be a 1-D sequence of integer token ids, got {t.dtype} {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise SchemaError(path, f"token ids must be >= 0, got {int(t.min())}")
    return t.detach().to(device="cpu", dtype=torch.int64)


def _logprobs(path: str, value: Any, n: int) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(list(value), dtype=torch.float32)
    if t.dim() != 1 or not t.is_floating_point():
        raise SchemaError(path, f"must be a 1-D sequence of floats, got {t.dtype} {tuple(t.shape)}")
    if t.shape[0] != n:
        raise SchemaError(path, f"has {t.shape[0]} entries, output_ids has {n}")
    if not bool(torch.isfinite(t).all()):
        raise SchemaError(path, "holds NaN or inf")
    return t.detach().to(device="cpu", dtype=torch.float32)


def turn_segment(index: int, turn: Turn) -> dict[str, torch.Tensor]:
    """The staged delta of one turn: input then output ids, the mask True on outputs, logprobs 0 on inputs."""
    path = f"turns[{index}]"
    if not isinstance(turn, Turn):
        raise SchemaError(path, f"must be a Turn, got {type(turn).__name__}")
    if not isinstance(turn.weight_version, int) or turn.weight_version < 0:
        raise SchemaError(f"{path}.weight_version", f"must be an int >= 0, got {turn.weight_version!r}")
    inputs = _ids(f"{path}.input_ids", turn.input_ids)
    outputs = _ids(f"{path}.output_ids", turn.output_ids)
    if index == 0 and inputs.numel() == 0:
        raise SchemaError(f"{path}.input_ids", "turn 0 must begin with the prompt (got no input ids)")
    logprobs = _logprobs(f"{path}.output_logprobs", turn.output_logprobs, outputs.numel())
    n_in, n_out = inputs.numel(), outputs.numel()
    segment = {
        "token_ids": torch.cat([inputs, outputs]),
        "token_mask": torch.cat([torch.zeros(n_in, dtype=torch.bool), torch.ones(n_out, dtype=torch.bool)]),
        "generation_logprobs": torch.cat([torch.zeros(n_in, dtype=torch.float32), logprobs]),
    }
    if turn.routed_experts is not None:
        routed = turn.routed_experts
        if not isinstance(routed, torch.Tensor) or routed.dim() != 2:
            raise SchemaError(f"{path}.routed_experts", "must be a [input + output, k] tensor")
        if routed.is_floating_point() or routed.dtype == torch.bool:
            raise SchemaError(f"{path}.routed_experts", f"must hold integers, got {routed.dtype}")
        if routed.shape[0] != n_in + n_out:
            raise SchemaError(
                f"{path}.routed_experts", f"has {routed.shape[0]} rows, input + output ids are {n_in + n_out}"
            )
        segment["routed_experts"] = routed
    return segment


def call_record(rollout_id: str, index: int, turn: Turn, segment: dict[str, torch.Tensor], prev_len: int) -> CallRecord:
    """The manifest entry of turn `index`, whose staged delta is `segment`, after `prev_len` tokens."""
    call_id = f"c{index}"
    n = int(segment["token_ids"].numel())
    return CallRecord(
        staging_key=f"{rollout_id}/{call_id}",
        call_id=call_id,
        parent_call_id=None if index == 0 else f"c{index - 1}",
        prev_len=prev_len,
        delta_len=n,
        cum_len=prev_len + n,
        weight_version=turn.weight_version,
        digest=token_digest(segment["token_ids"]),
        invalid_tool_call=bool(turn.invalid_tool_call),
        malformed_thinking=bool(turn.malformed_thinking),
    )


def turns_to_calls(rollout_id: str, turns: Sequence[Turn]) -> tuple[list[dict[str, torch.Tensor]], list[CallRecord]]:
    """Segments to stage and their `CallRecord`s, in turn order; SchemaError names a bad turn's field."""
    if not rollout_id:
        raise SchemaError("rollout_id", "must be a non-empty string")
    if not turns:
        raise SchemaError("turns", "must hold at least one turn (a failed rollout has a failure_reason instead)")
    segments: list[dict[str, torch.Tensor]] = []
    calls: list[CallRecord] = []
    cum = 0
    for i, turn in enumerate(turns):
        segment = turn_segment(i, turn)
        call = call_record(rollout_id, i, turn, segment, cum)
        segments.append(segment)
        calls.append(call)
        cum = call.cum_len
    return segments, calls
