"""Receipt records at the reassembler's boundary: decoded and checked, or refused with a dead-letter kind."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from schemas import deadletter as dl
from schemas.errors import SchemaError
from schemas.metadata_guard import MetadataViolation, assert_metadata_only
from schemas.receipt import Receipt

# Header `rlstream deadletter redrive` puts on a re-published record: how many times it was redriven.
REDRIVE_HEADER = "rlstream.redrive_count"


@dataclass(frozen=True)
class Refused:
    """A record that is not a usable receipt: the dead-letter kind and a message naming the cause."""

    kind: str
    message: str


def decode_receipt(value: bytes | None) -> Receipt | Refused:
    """The receipt a record value holds, or why it is refused (decode, metadata or validation error)."""
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
    try:
        return Receipt.from_bytes(value)
    except SchemaError as exc:
        return Refused(dl.VALIDATION_ERROR, str(exc))


def redrive_count(headers: Iterable[tuple[str, bytes | None]] | None) -> int:
    """The redrive count a record carries in its headers (0 when it was never redriven or the header is bad)."""
    for key, value in headers or ():
        if key == REDRIVE_HEADER:
            try:
                return max(0, int(bytes(value or b"0").decode()))
            except ValueError:
                return 0
    return 0
