"""`Receipt`: the metadata a rollout worker publishes once a rollout's tensors are staged in TQ."""

from __future__ import annotations

import math

import msgspec

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, finite, non_empty, optional_non_empty


class CallRecord(msgspec.Struct, frozen=True):
    """One model call of a rollout: where its staged delta lives, how long it is, and its digest.

    Chain consistency (parent links, `prev_len + delta_len == cum_len`, digests) is deliberately
    not checked here: `linearize` turns a broken chain into a placeholder row, not a dead letter.
    """

    staging_key: str
    call_id: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    invalid_tool_call: bool = False
    malformed_thinking: bool = False

    def __post_init__(self) -> None:
        # One combined test keeps the common (valid) case cheap at 100k receipts/s.
        if (
            self.staging_key
            and self.call_id
            and self.parent_call_id != ""
            and self.prev_len >= 0
            and self.delta_len >= 0
            and self.cum_len >= 0
            and self.weight_version >= 0
        ):
            return
        non_empty("call_record.staging_key", self.staging_key)
        non_empty("call_record.call_id", self.call_id)
        optional_non_empty("call_record.parent_call_id", self.parent_call_id)
        for name in ("prev_len", "delta_len", "cum_len", "weight_version"):
            at_least(f"call_record.{name}", getattr(self, name), 0)


class Receipt(Message, frozen=True, tag="receipt"):
    """Metadata-only record of one finished rollout; its tensors stay in TQ under manifest keys."""

    rollout_id: str
    group_id: str
    prompt_idx: int
    rollout_index: int
    group_size: int
    reward: float
    mask_sample: bool
    loss_multiplier: float
    environment: str
    failure_reason: str | None
    manifest: tuple[CallRecord, ...]
    truncated: bool = False

    def _validate(self) -> None:
        if (
            self.rollout_id
            and self.group_id
            and 0 <= self.rollout_index < self.group_size
            and self.prompt_idx >= 0
            and math.isfinite(self.reward)
            and math.isfinite(self.loss_multiplier)
            and self.loss_multiplier >= 0
            and (self.manifest if self.failure_reason is None else self.failure_reason)
            and self._owns_its_staging()
        ):
            return
        non_empty("receipt.rollout_id", self.rollout_id)
        non_empty("receipt.group_id", self.group_id)
        at_least("receipt.prompt_idx", self.prompt_idx, 0)
        at_least("receipt.group_size", self.group_size, 1)
        at_least("receipt.rollout_index", self.rollout_index, 0)
        if self.rollout_index >= self.group_size:
            raise SchemaError(
                "receipt.rollout_index",
                f"must be < group_size ({self.group_size}), got {self.rollout_index}",
            )
        finite("receipt.reward", self.reward)
        finite("receipt.loss_multiplier", self.loss_multiplier)
        at_least("receipt.loss_multiplier", self.loss_multiplier, 0)
        optional_non_empty("receipt.failure_reason", self.failure_reason)
        if not self.manifest:
            raise SchemaError("receipt.manifest", "must be non-empty unless failure_reason is set")
        for i, call in enumerate(self.manifest):
            if call.staging_key != f"{self.rollout_id}/{call.call_id}":
                raise SchemaError(
                    f"receipt.manifest[{i}].staging_key",
                    f"must be '{{rollout_id}}/{{call_id}}' ({self.rollout_id}/{call.call_id}), "
                    f"got {call.staging_key!r}: a receipt names only its own rollout's staged rows",
                )

    def _owns_its_staging(self) -> bool:
        # Staging keys are `{rollout_id}/{call_id}`: a receipt naming another rollout's rows would
        # take that rollout's tokens and have them cleared under their owner.
        prefix = self.rollout_id + "/"
        return all(
            c.staging_key.startswith(prefix) and c.staging_key[len(prefix) :] == c.call_id for c in self.manifest
        )
