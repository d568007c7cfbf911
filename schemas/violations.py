"""NeMo RL's violation flags of generated assistant turns: counts per row and token-aligned masks.

A generated turn (an assistant message with `generation_logprobs`) is flagged by NeMo RL's keys
`is_invalid_tool_call` and `has_malformed_thinking` (`nemo_rl.experience.payload`); rlstream's earlier
spellings `invalid_tool_call` / `malformed_thinking` are still read, never counted as 0, and a message
carrying both spellings with different values is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

VIOLATION_TAG_KEYS = (
    "num_invalid_tool_calls",
    "num_malformed_thinking",
    "num_assistant_messages",
    "num_routed_experts_backfilled",
)
_VIOLATION_COUNTS_KEY = "violation_counts"
_INVALID_MASK = "invalid_tool_call_mask"
_MALFORMED_MASK = "malformed_thinking_mask"
# NeMo RL's message keys for a flagged generated turn, and the names rlstream used before them.
INVALID_TOOL_CALL = "is_invalid_tool_call"
MALFORMED_THINKING = "has_malformed_thinking"
_OLD_NAMES = {INVALID_TOOL_CALL: "invalid_tool_call", MALFORMED_THINKING: "malformed_thinking"}


def _is_generated(message: Mapping[str, Any]) -> bool:
    # Field presence is the marker: only turns the model sampled carry generation_logprobs.
    return message.get("role") == "assistant" and "generation_logprobs" in message


def _flag(message: Mapping[str, Any], key: str) -> bool:
    """A violation flag under NeMo RL's key, or rlstream's earlier one; both, disagreeing, is refused."""
    old = _OLD_NAMES[key]
    if key in message and old in message and bool(message[key]) != bool(message[old]):
        raise ValueError(
            f"message flags {key}={message[key]!r} and {old}={message[old]!r} disagree "
            f"({old} is rlstream's earlier name for NeMo RL's {key}; give one)"
        )
    return bool(message.get(key, message.get(old, False)))


def _violation_counts(message_log: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Count invalid tool calls / malformed thinking over flagged generated assistant turns."""
    counts = dict.fromkeys(VIOLATION_TAG_KEYS, 0)
    for message in message_log:
        if _is_generated(message):
            counts["num_assistant_messages"] += 1
            counts["num_invalid_tool_calls"] += _flag(message, INVALID_TOOL_CALL)
            counts["num_malformed_thinking"] += _flag(message, MALFORMED_THINKING)
            counts["num_routed_experts_backfilled"] += bool(message.get("routed_experts_backfilled", False))
    return counts


def _add_message_violation_masks(message_logs: Sequence[list[dict[str, Any]]]) -> None:
    """Attach token-aligned masks for generated assistant violations to every message.

    Must run before anything fills missing generation_logprobs on prompt and environment
    messages: the presence of that field is what marks a turn as generated.
    """
    for message_log in message_logs:
        for message in message_log:
            length = int(message["token_ids"].shape[0])
            generated = _is_generated(message)
            message[_INVALID_MASK] = torch.full((length,), generated and _flag(message, INVALID_TOOL_CALL))
            message[_MALFORMED_MASK] = torch.full((length,), generated and _flag(message, MALFORMED_THINKING))
