"""Receipt records at the reassembler's boundary: decoded and checked, or refused with a dead-letter kind.

The receipts topic carries two kinds, told apart by their `kind`: rlstream's `Receipt` and
`GymReceipt` (a NeMo Gym `RolloutReceipt` with its group fields). Both pass the same checks here
and join prompt groups alike; a group may even hold both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from schemas import deadletter as dl
from schemas.errors import MetadataViolation, SchemaError
from schemas.gym_receipt import GymReceipt
from schemas.metadata_guard import assert_metadata_only
from schemas.receipt import Receipt

AnyReceipt = Receipt | GymReceipt

# Header `rlstream deadletter redrive` puts on a re-published record: how many times it was redriven.
REDRIVE_HEADER = "rlstream.redrive_count"
# Header a redriven record carries: its original record's timestamp (ms). The redriven group's
# deadline starts when the redrive arrives, but its age against the horizon is the original one.
SOURCE_TIMESTAMP_HEADER = "rlstream.source_timestamp_ms"


@dataclass(frozen=True)
class Refused:
    """A record that is not a usable receipt: the dead-letter kind and a message naming the cause."""

    kind: str
    message: str


@dataclass(frozen=True)
class Limits:
    """Bounds on the sizes a receipt declares (see ReassemblerConfig)."""

    max_group_size: int = 1024
    max_calls_per_rollout: int = 1024
    max_tokens_per_call: int = 1 << 20
    # Ids key Kafka records (receipts, finalized records, state entries): a huge one would make
    # those records outgrow one Kafka message.
    max_id_bytes: int = 256


def decode_receipt(value: bytes | None, limits: Limits = Limits(), key: bytes | None = None) -> AnyReceipt | Refused:
    """The receipt a record value holds, or why it is refused.

    Refused: not MessagePack, a tensor in the metadata, a schema violation, sizes past `limits`, or
    (when `key` is given; an unkeyed record passes b"") a record key other than the receipt's group_id.
    """
    receipt = _decode(value)
    if isinstance(receipt, Refused):
        return receipt
    return _beyond_limits(receipt, limits) or _wrong_key(receipt, key) or receipt


def _beyond_limits(r: AnyReceipt, limits: Limits) -> Refused | None:
    for name, value in (("group_id", r.group_id), ("rollout_id", r.rollout_id)):
        if len(value.encode()) > limits.max_id_bytes:
            return Refused(
                dl.LIMIT_EXCEEDED, f"receipt: {name} of {len(value.encode())} bytes > {limits.max_id_bytes} bytes"
            )
    where = f"receipt {r.rollout_id} of group {r.group_id}"
    if r.group_size > limits.max_group_size:
        return Refused(
            dl.LIMIT_EXCEEDED, f"{where}: group_size {r.group_size} > max_group_size {limits.max_group_size}"
        )
    if len(r.manifest) > limits.max_calls_per_rollout:
        return Refused(
            dl.LIMIT_EXCEEDED,
            f"{where}: {len(r.manifest)} calls > max_calls_per_rollout {limits.max_calls_per_rollout}",
        )
    for i, call in enumerate(r.manifest):
        if call.delta_len > limits.max_tokens_per_call:
            return Refused(
                dl.LIMIT_EXCEEDED,
                f"{where}: manifest[{i}].delta_len {call.delta_len} > max_tokens_per_call {limits.max_tokens_per_call}",
            )
    return None


def _wrong_key(r: AnyReceipt, key: bytes | None) -> Refused | None:
    # Receipts are keyed by group_id so that a group's receipts share a partition; a receipt keyed
    # otherwise would open a second copy of its group elsewhere, and both would finalize halves.
    if key is None or key == r.group_id.encode():
        return None
    shown = key[:64].decode(errors="replace")
    return Refused(
        dl.KEY_MISMATCH,
        f"receipt {r.rollout_id}: record key {shown!r} is not its group_id {r.group_id!r} (receipts must be keyed "
        f"by group_id)",
    )


def _decode(value: bytes | None) -> AnyReceipt | Refused:
    if value is None:
        return Refused(dl.DECODE_ERROR, "receipt: empty record value")
    try:
        raw = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - any garbage is a poison receipt, not a worker failure
        return Refused(dl.DECODE_ERROR, f"receipt: not MessagePack ({type(exc).__name__}: {exc})"[:500])
    # Checked on the raw map before the schema: a tensor smuggled into an unknown field would
    # otherwise be dropped silently by the tolerant decoder instead of reported.
    try:
        assert_metadata_only(raw, path="receipt")
    except MetadataViolation as exc:
        return Refused(dl.METADATA_VIOLATION, str(exc))
    cls = GymReceipt if isinstance(raw, dict) and raw.get("kind") == GymReceipt.kind() else Receipt
    try:
        return cls.from_bytes(value)
    except SchemaError as exc:
        return Refused(dl.VALIDATION_ERROR, str(exc))


def redrive_count(headers: Iterable[tuple[str, bytes | None]] | None) -> int:
    """The redrive count a record carries in its headers (0 when it was never redriven or the header is bad)."""
    return _int_header(headers, REDRIVE_HEADER)


def source_timestamp(headers: Iterable[tuple[str, bytes | None]] | None) -> int:
    """The original timestamp a redriven record carries (0 when none, or the header is bad)."""
    return _int_header(headers, SOURCE_TIMESTAMP_HEADER)


def _int_header(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> int:
    for key, value in headers or ():
        if key == name:
            try:
                return max(0, int(bytes(value or b"0").decode()))
            except ValueError:
                return 0
    return 0
