"""A pipeline record as an operator reads it: position, key, headers and the decoded message, as JSON."""

from __future__ import annotations

import base64
from typing import Any

from schemas.deadletter import DeadLetter
from schemas.errors import SchemaError
from streams.consumer import Record
from workers.topics import decode_value, message_group_id, receipt_from_bytes


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(data).decode()


def describe_record(rec: Record, role: str | None = None) -> dict[str, Any]:
    """A JSON-able view of one record: position, key, headers and the decoded message (or why not).

    A dead letter shows `error_kind` and `message` at the top level and its original receipt decoded
    when it decodes (else the original's size); `role` None sniffs the message kind (replay topics).
    """
    out: dict[str, Any] = {
        "topic": rec.topic,
        "partition": rec.partition,
        "offset": rec.offset,
        "timestamp_ms": rec.timestamp_ms,
        "key": _text(rec.key),
        "headers": {k: _text(v) for k, v in rec.headers},
    }
    try:
        msg = decode_value(rec.value, role)
    except SchemaError as exc:
        out.update(kind=None, decode_error=str(exc), value_bytes=len(rec.value or b""))
        return out
    out["kind"] = msg.kind()
    value = msg.to_dict()
    if isinstance(msg, DeadLetter):
        value.pop("original")
        value["source_key"] = _text(msg.source_key)
        out.update(error_kind=msg.error_kind, message=msg.message, redrive_count=msg.redrive_count)
        try:
            value["original_receipt"] = receipt_from_bytes(msg.original).to_dict()
        except SchemaError:
            value["original_bytes"] = msg.original_size if msg.original_truncated else len(msg.original)
    out["value"] = value
    out["group_id"] = message_group_id(msg)
    return out


def matches_group(desc: dict[str, Any], group_id: str | None) -> bool:
    return (
        group_id is None
        or desc.get("group_id") == group_id
        or (desc.get("group_id") is None and desc.get("key") == group_id)
    )
