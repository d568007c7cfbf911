"""`ReassemblyRequest` and `RolloutReassemblerActorConfig`: what a reassembler worker is handed."""

from __future__ import annotations

from typing import Any

from schemas.codec import Message
from schemas.validate import at_least, finite, non_empty, same_length

_PARALLEL = ("rollout_ids", "canonical_sample_ids", "receipts", "rewards", "mask_sample")


class ReassemblyRequest(Message, frozen=True, tag="reassembly_request"):
    """Metadata-only input for one prompt group's finalization; the tuples run parallel by rollout.

    `receipts[i]` is rollout i's receipt as a `Receipt.to_dict()` mapping, or None when missing.
    """

    group_id: str
    rollout_ids: tuple[str, ...]
    canonical_sample_ids: tuple[str, ...]
    receipts: tuple[dict[str, Any] | None, ...]
    rewards: tuple[float, ...]
    fallback_weight_version: int
    prompt_idx: int
    mask_sample: tuple[bool, ...]
    loss_multiplier: float = 1.0

    def _validate(self) -> None:
        non_empty("reassembly_request.group_id", self.group_id)
        same_length("reassembly_request", _PARALLEL, [getattr(self, n) for n in _PARALLEL])
        at_least("reassembly_request.fallback_weight_version", self.fallback_weight_version, 0)
        at_least("reassembly_request.prompt_idx", self.prompt_idx, 0)
        for i, reward in enumerate(self.rewards):
            finite(f"reassembly_request.rewards[{i}]", reward)
        finite("reassembly_request.loss_multiplier", self.loss_multiplier)
        at_least("reassembly_request.loss_multiplier", self.loss_multiplier, 0)


class RolloutReassemblerActorConfig(Message, frozen=True, tag="reassembler_config"):
    """Constructor values shared by every reassembler worker (TQ partitions, padding, routing)."""

    partition_id: str
    staging_partition: str
    pad_token_id: int
    router_replay_enabled: bool
    defer_routed_experts_to_policy: bool
    max_seq_len: int

    def _validate(self) -> None:
        non_empty("reassembler_config.partition_id", self.partition_id)
        non_empty("reassembler_config.staging_partition", self.staging_partition)
        at_least("reassembler_config.pad_token_id", self.pad_token_id, 0)
        at_least("reassembler_config.max_seq_len", self.max_seq_len, 1)
