"""`GymReceipt`: a NeMo Gym `RolloutReceipt` on the receipts topic, with the group fields rlstream needs.

NeMo Gym (nemo-gym 0.7.0, `token_id_capture.staging.records`) hands a framework one token-free
`RolloutReceipt` per rollout: its call manifest (`CallRecord` rows naming each call's staging key,
lengths, weight version, digests and chain hashes), its terminal call and how that was chosen, and
whether capture was poisoned. `GymRolloutReceipt` and `GymCallRecord` carry every field of those
models under their names, and refuse what their pydantic validators refuse (unknown fields too), so
a receipt NeMo Gym would not build is dead-lettered at the boundary as a `validation_error` naming
the field. `GymReceipt` wraps one with the prompt-group fields a NeMo Gym receipt lacks (group id,
prompt and rollout index, group size, reward, mask_sample, loss multiplier, environment) and is
read beside rlstream's own `Receipt` on the same topic (`kind` tells them apart).

Two checks are rlstream's, not NeMo Gym's: a manifest row's `staging_key` must be
`{rollout_id}/{model_call_id}` (NeMo Gym's `staging_key`, what rlstream's sink stages under), so a
receipt names only its own rollout's staged rows; and the optional violation flags name calls of
the manifest. Verification (digests, chains, the terminal) is `schemas.gym_verify`'s, at finalization.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.gym_digest import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    is_digest,
)
from schemas.validate import at_least, finite, non_empty

CaptureMode = Literal["token_in", "text"]
TerminalSelection = Literal["declared", "response_id", "content", "heuristic"]


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """NeMo Gym's default staging key of a call, the one rlstream's sink stages under."""
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"


def _versions(path: str, schema: int, digest: int, extras: int) -> None:
    for name, value, expected in (
        ("schema_version", schema, STAGING_SCHEMA_VERSION),
        ("digest_version", digest, STAGING_DIGEST_VERSION),
        ("extras_digest_version", extras, EXTRAS_DIGEST_VERSION),
    ):
        if value != expected:
            raise SchemaError(f"{path}.{name}", f"must be {expected} (NeMo Gym 0.7.0's), got {value}")


def _digest(path: str, value: str | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_digest(value):
        raise SchemaError(path, f"must be a lowercase SHA-256 hex digest, got {value!r}")


class GymCallRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One token-free manifest row: every field of NeMo Gym's `CallRecord`."""

    schema_version: int = STAGING_SCHEMA_VERSION
    digest_version: int = STAGING_DIGEST_VERSION
    extras_digest_version: int = EXTRAS_DIGEST_VERSION
    model_call_id: str
    parent_call_id: str | None = None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    extras_digest: str
    staging_key: str
    mode: CaptureMode = "token_in"
    chain_hash: str
    cumulative_hash: str
    response_id: str
    admitted_at: float | None = None
    output_fingerprint: str | None = None
    continuation_fingerprint: str | None = None
    fingerprint_version: int = 0

    def __post_init__(self) -> None:
        path = "call_record"
        _versions(path, self.schema_version, self.digest_version, self.extras_digest_version)
        non_empty(f"{path}.model_call_id", self.model_call_id)
        if self.parent_call_id is not None:
            non_empty(f"{path}.parent_call_id", self.parent_call_id)
        non_empty(f"{path}.staging_key", self.staging_key)
        non_empty(f"{path}.response_id", self.response_id)
        for name in ("prev_len", "delta_len", "cum_len", "weight_version", "fingerprint_version"):
            at_least(f"{path}.{name}", getattr(self, name), 0)
        for name in ("digest", "extras_digest", "chain_hash", "cumulative_hash"):
            _digest(f"{path}.{name}", getattr(self, name))
        for name in ("output_fingerprint", "continuation_fingerprint"):
            _digest(f"{path}.{name}", getattr(self, name), optional=True)
        if self.admitted_at is not None:
            finite(f"{path}.admitted_at", self.admitted_at)
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise SchemaError(f"{path}.cum_len", "manifest lengths must describe a non-empty contiguous delta")
        root = self.parent_call_id is None
        if root != (self.prev_len == 0):
            raise SchemaError(f"{path}.prev_len", "a parentless row must have prev_len 0, a child prev_len > 0")
        if root != (self.mode == "text"):
            raise SchemaError(f"{path}.mode", "a parentless row must use text mode, a child token_in")

    @property
    def call_id(self) -> str:
        """rlstream's name for the call id (what the pipeline's bookkeeping reads)."""
        return self.model_call_id


class GymRolloutReceipt(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every field of NeMo Gym's `RolloutReceipt`, refused where its validators refuse it."""

    schema_version: int = STAGING_SCHEMA_VERSION
    digest_version: int = STAGING_DIGEST_VERSION
    extras_digest_version: int = EXTRAS_DIGEST_VERSION
    rollout_id: str
    reward: float | None = None
    terminal_model_call_id: str | None = None
    manifest: tuple[GymCallRecord, ...] = ()
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: TerminalSelection | None = None
    terminal_attribution_reason: str | None = None

    def __post_init__(self) -> None:
        path = "rollout_receipt"
        _versions(path, self.schema_version, self.digest_version, self.extras_digest_version)
        non_empty(f"{path}.rollout_id", self.rollout_id)
        if self.terminal_model_call_id is not None:
            non_empty(f"{path}.terminal_model_call_id", self.terminal_model_call_id)
        if self.reward is not None:
            finite(f"{path}.reward", self.reward)
        ids = [r.model_call_id for r in self.manifest]
        if len(ids) != len(set(ids)):
            raise SchemaError(f"{path}.manifest", "contains duplicate model_call_id values")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in ids:
            raise SchemaError(f"{path}.terminal_model_call_id", "is absent from the receipt manifest")
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise SchemaError(f"{path}.failure_reason", "an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise SchemaError(
                    f"{path}.terminal_model_call_id",
                    "an unpoisoned receipt must name terminal_model_call_id and terminal_selection",
                )
        if self.terminal_selection is None:
            if self.terminal_model_call_id is not None:
                raise SchemaError(f"{path}.terminal_selection", "terminal_model_call_id requires a selection method")
            if self.failure_reason is None:
                raise SchemaError(
                    f"{path}.failure_reason", "a receipt with no attribution stage must be poisoned with a reason"
                )


class GymReceipt(Message, frozen=True, tag="gym_receipt"):
    """A NeMo Gym rollout receipt and the prompt-group fields rlstream finalizes it with.

    `reward` is the group's (as NeMo RL's request rewards are); NeMo Gym's own optional
    `receipt.reward` is carried as it came. `invalid_tool_call_calls` and `malformed_thinking_calls`
    name calls whose generated turn was flagged: their assistant messages carry NeMo RL's
    `is_invalid_tool_call` / `has_malformed_thinking`.
    """

    group_id: str
    prompt_idx: int
    rollout_index: int
    group_size: int
    reward: float
    mask_sample: bool
    loss_multiplier: float
    environment: str
    receipt: GymRolloutReceipt
    truncated: bool = False
    invalid_tool_call_calls: tuple[str, ...] = ()
    malformed_thinking_calls: tuple[str, ...] = ()

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id

    @property
    def manifest(self) -> tuple[GymCallRecord, ...]:
        return self.receipt.manifest

    def _validate(self) -> None:
        if not (
            self.group_id
            and 0 <= self.rollout_index < self.group_size
            and self.prompt_idx >= 0
            and math.isfinite(self.reward)
            and math.isfinite(self.loss_multiplier)
            and self.loss_multiplier >= 0
        ):
            non_empty("gym_receipt.group_id", self.group_id)
            at_least("gym_receipt.prompt_idx", self.prompt_idx, 0)
            at_least("gym_receipt.group_size", self.group_size, 1)
            at_least("gym_receipt.rollout_index", self.rollout_index, 0)
            if self.rollout_index >= self.group_size:
                raise SchemaError(
                    "gym_receipt.rollout_index", f"must be < group_size ({self.group_size}), got {self.rollout_index}"
                )
            finite("gym_receipt.reward", self.reward)
            finite("gym_receipt.loss_multiplier", self.loss_multiplier)
            at_least("gym_receipt.loss_multiplier", self.loss_multiplier, 0)
        rid = self.receipt.rollout_id
        for i, call in enumerate(self.receipt.manifest):
            if call.staging_key != f"{rid}/{call.model_call_id}":
                raise SchemaError(
                    f"gym_receipt.receipt.manifest[{i}].staging_key",
                    f"must be '{{rollout_id}}/{{model_call_id}}' ({rid}/{call.model_call_id}), got "
                    f"{call.staging_key!r}: a receipt names only its own rollout's staged rows",
                )
        ids = {c.model_call_id for c in self.receipt.manifest}
        for name in ("invalid_tool_call_calls", "malformed_thinking_calls"):
            for i, call_id in enumerate(getattr(self, name)):
                if call_id not in ids:
                    raise SchemaError(f"gym_receipt.{name}[{i}]", f"names {call_id!r}, which is not in the manifest")
