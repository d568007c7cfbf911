"""`assert_metadata_only`: refuse tensors and per-token fields anywhere in a control-plane value."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import torch
from tensordict import TensorDictBase

from schemas.errors import MetadataViolation

# Token-aligned row fields and their per-call staging deltas: heavy, so they belong in TQ.
# Per-row scalars such as input_lengths are metadata and stay allowed.
_FORBIDDEN_RPC_KEYS: frozenset[str] = frozenset(
    {
        "input_ids",
        "token_ids",
        "token_mask",
        "generation_logprobs",
        "logprobs",
        "prev_logprobs",
        "routed_experts",
        "prompt_ids_for_adv",
        "invalid_tool_call_mask",
        "malformed_thinking_mask",
        "token_ids_delta",
        "token_mask_delta",
        "generation_logprobs_delta",
        "generation_log_probs_delta",
        "routed_experts_delta",
        # Packed multimodal inputs (NeMo RL's names): media stays in TQ like tokens do.
        "pixel_values",
        "pixel_values_videos",
        "input_features",
    }
)

_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 64


def assert_metadata_only(value: Any, *, path: str = "rpc") -> None:
    """Raise MetadataViolation unless `value` is built only of None/str/int/float/bool,
    lists, tuples, dicts with scalar keys, dataclasses and msgspec Structs, with no forbidden key.

    Paths read like Python: `rpc.receipts[3]["manifest"][0]` (attributes with `.`, indices with
    `[i]`, dict keys with `["key"]`).
    """
    _walk(value, path, set())


def _walk(value: Any, path: str, active: set[int]) -> None:
    if isinstance(value, _SCALARS):
        return
    if len(active) >= _MAX_DEPTH:
        raise MetadataViolation(path, f"nested deeper than {_MAX_DEPTH} levels")
    if id(value) in active:
        raise MetadataViolation(path, "reference cycle")
    active.add(id(value))
    try:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _walk(item, f"{path}[{i}]", active)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, _SCALARS):
                    raise MetadataViolation(f"{path}[<key>]", f"dict key: {_describe(key)} is not metadata")
                key_path = f'{path}["{key}"]' if isinstance(key, str) else f"{path}[{key!r}]"
                if key in _FORBIDDEN_RPC_KEYS:
                    raise MetadataViolation(key_path, f"per-token field {key!r} belongs in TQ")
                _walk(item, key_path, active)
        elif isinstance(value, msgspec.Struct) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            names = (
                value.__struct_fields__
                if isinstance(value, msgspec.Struct)
                else [f.name for f in dataclasses.fields(value)]
            )
            for name in names:
                if name in _FORBIDDEN_RPC_KEYS:
                    raise MetadataViolation(f"{path}.{name}", f"per-token field {name!r} belongs in TQ")
                _walk(getattr(value, name), f"{path}.{name}", active)
        else:
            raise MetadataViolation(path, f"{_describe(value)} is not metadata")
    finally:
        active.discard(id(value))


def _describe(value: Any) -> str:
    """Name a rejected value so that the message says what leaked (with its shape for arrays)."""
    if isinstance(value, TensorDictBase):
        return f"TensorDict with batch size {tuple(value.batch_size)}"
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return f"nested tensor with {value.size(0)} rows"
        return f"tensor of shape {tuple(value.shape)}"
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"array of shape {tuple(shape)} ({type(value).__module__}.{type(value).__name__})"
    return f"value of type {type(value).__module__}.{type(value).__name__}"
