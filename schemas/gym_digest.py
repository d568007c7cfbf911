"""NeMo Gym's staging digests (nemo-gym 0.7.0, `token_id_capture.staging.digest`), byte for byte.

A staged call's digest covers its metadata, token columns and extras digest; the chain hash links a
call's delta to its parent's; the cumulative hash covers a call's whole token prefix; the extras
digest covers the call's optional extras under a typed binary encoding. rlstream computes them
itself (schemas/ imports no framework); `tests/unit/schemas/test_gym_digest.py` holds them to NeMo
Gym's golden vectors and to NeMo Gym's own functions. Each function refuses what NeMo Gym's refuses,
with the same exception type (TypeError or ValueError), since verification maps those to a code.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

_CALL_DOMAIN = b"nemo-gym-staging-call-v2"
_EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
_TOKEN_DOMAIN = b"nemo-gym-staging-prefix-v2"
_CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"
_HEX = frozenset("0123456789abcdef")
_U64 = 2**64 - 1
# `x in (0.0, 1.0)` is equality: -0.0, 0, 1 and True are in, NaN is not; a set keeps that.
_MASK_VALUES = frozenset((0.0, 1.0))


def _bytes(value: bytes) -> bytes:
    return struct.pack(">Q", len(value)) + value


def _text(value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return _bytes(value.encode("utf-8"))


def _optional_text(value: str | None) -> bytes:
    return b"\x00" if value is None else b"\x01" + _text(value)


def _uint(value: int, *, field: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64:
        raise ValueError(f"{field} must be an unsigned 64-bit integer, got {value!r}")
    return struct.pack(">Q", value)


def is_digest(value: Any) -> bool:
    """A lowercase SHA-256 hex digest (64 characters of 0-9a-f)."""
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def _check_digest(value: Any, *, field: str) -> None:
    if not is_digest(value):
        raise ValueError(f"{field} must be a lowercase SHA-256 hex digest")


def _present_digest(value: Any, *, field: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a digest string")
    _check_digest(value, field=field)
    return b"\x01" + bytes.fromhex(value)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """The token ids as a u64 length and u64 big-endian values (NeMo Gym's `encode_token_ids`)."""
    n = len(token_ids)
    # NeMo Gym's checks (exact ints in [0, 2^64)), made by C-level builtins, then one pack.
    if n and (set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) > _U64):
        bad = next(t for t in token_ids if type(t) is not int or not 0 <= t <= _U64)
        raise ValueError(f"token_id must be an unsigned 64-bit integer, got {bad!r}")
    return struct.pack(f">Q{n}Q", n, *token_ids)


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """The cumulative hash of one exact token prefix."""
    return hashlib.sha256(_TOKEN_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """`H(parent chain hash || delta)`: a root chains from None, marked apart from a child."""
    if parent_chain_hash is None:
        head = b"\x00"
    else:
        _check_digest(parent_chain_hash, field="parent_chain_hash")
        head = b"\x01" + bytes.fromhex(parent_chain_hash)
    return hashlib.sha256(_CHAIN_DOMAIN + head + encode_token_ids(token_ids_delta)).hexdigest()


def _float32s(values: Sequence[float], *, field: str) -> bytes:
    if values and (set(map(type, values)) != {float} or not all(map(math.isfinite, values))):
        bad = next(v for v in values if type(v) is not float or not math.isfinite(v))
        raise ValueError(f"{field} values must be finite Python floats, got {bad!r}")
    try:
        packed = struct.pack(f">{len(values)}f", *values)
    except (OverflowError, struct.error) as error:
        raise ValueError(f"{field} value cannot be represented as float32") from error
    if not all(map(math.isfinite, struct.unpack(f">{len(values)}f", packed))):
        raise ValueError(f"{field} value overflows float32")
    return _uint(len(values), field=f"{field} length") + packed


def _extra(value: Any) -> bytes:
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B\x01" if value else b"B\x00"
    if type(value) is int:
        if not -(2**63) <= value <= 2**63 - 1:
            raise ValueError(f"extras integer is outside signed 64-bit range: {value}")
        return b"I" + struct.pack(">q", value)
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"extras floats must be finite, got {value!r}")
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        return b"S" + _text(value)
    if type(value) is list:
        return b"L" + _uint(len(value), field="extras list length") + b"".join(_extra(item) for item in value)
    if type(value) is dict:
        if any(type(key) is not str for key in value):
            raise TypeError("extras mappings must have string keys")
        keys = sorted(value, key=lambda key: key.encode("utf-8"))
        return (
            b"D" + _uint(len(keys), field="extras mapping length") + b"".join(_text(k) + _extra(value[k]) for k in keys)
        )
    raise TypeError(f"extras contain unsupported value type {type(value).__name__}")


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """The digest of a call's JSON-like extras (None, exact bool/int/float/str, lists, str-keyed dicts)."""
    if extras is None:
        normalized = None
    elif isinstance(extras, Mapping):
        normalized = dict(extras)
    else:
        raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
    return hashlib.sha256(_EXTRAS_DOMAIN + struct.pack(">B", EXTRAS_DIGEST_VERSION) + _extra(normalized)).hexdigest()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """The v2 digest of one staged call delta; ValueError/TypeError where NeMo Gym's refuses it."""
    if type(schema_version) is not int or schema_version != STAGING_SCHEMA_VERSION:
        raise ValueError(f"unsupported staging schema version {schema_version}")
    if type(digest_version) is not int or digest_version != STAGING_DIGEST_VERSION:
        raise ValueError(f"unsupported staging digest version {digest_version}")
    if type(extras_digest_version) is not int or extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise ValueError(f"unsupported extras digest version {extras_digest_version}")
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in ("text", "token_in"):
        raise ValueError(f"unsupported capture mode {mode!r}")
    if parent_call_id is None and (prev_len != 0 or mode != "text"):
        raise ValueError("a parentless call must be a text-mode root with prev_len == 0")
    if parent_call_id is not None and (prev_len == 0 or mode != "token_in"):
        raise ValueError("a child call must use token_in mode with prev_len > 0")
    if delta_len == 0:
        raise ValueError("a staged call delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError(f"delta_len {delta_len} does not match {len(token_ids_delta)} token IDs")
    if not len(token_ids_delta) == len(token_mask_delta) == len(generation_log_probs_delta):
        raise ValueError("token IDs, masks, and log probabilities must have equal lengths")
    if not set(token_mask_delta) <= _MASK_VALUES:
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if any(lp != 0.0 for m, lp in zip(token_mask_delta, generation_log_probs_delta) if m == 0.0):
        raise ValueError("prompt-carry log probabilities must be 0.0")
    if cum_len != prev_len + delta_len:
        raise ValueError(f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})")
    _check_digest(extras_digest, field="extras_digest")
    payload = bytearray(struct.pack(">BBB", schema_version, digest_version, extras_digest_version))
    payload += _text(rollout_id) + _text(model_call_id) + _optional_text(parent_call_id) + _text(mode)
    payload += _uint(prev_len, field="prev_len") + _uint(delta_len, field="delta_len")
    payload += _uint(cum_len, field="cum_len") + _uint(weight_version, field="weight_version")
    payload += _bytes(encode_token_ids(token_ids_delta))
    payload += _bytes(_float32s(token_mask_delta, field="token_mask_delta"))
    payload += _bytes(_float32s(generation_log_probs_delta, field="generation_log_probs_delta"))
    payload += bytes.fromhex(extras_digest)
    payload += _present_digest(chain_hash, field="chain_hash") + _present_digest(
        cumulative_hash, field="cumulative_hash"
    )
    return hashlib.sha256(_CALL_DOMAIN + bytes(payload)).hexdigest()
