"""`DeadLetter`: an input the pipeline could not use, kept byte for byte with where it came from."""

from __future__ import annotations

import hashlib

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

DECODE_ERROR = "decode_error"
VALIDATION_ERROR = "validation_error"
METADATA_VIOLATION = "metadata_violation"
DUPLICATE_RECEIPT = "duplicate_receipt"
LATE_RECEIPT = "late_receipt"
ALL_ROLLOUTS_FAILED = "all_rollouts_failed"
GROUP_TIMEOUT = "group_timeout"
INCONSISTENT_GROUP = "inconsistent_group"
# A receipt keyed by something other than its group_id: its group could be split across partitions.
KEY_MISMATCH = "key_mismatch"
# A receipt declaring sizes past the reassembler's configured bounds (group size, calls, tokens).
LIMIT_EXCEEDED = "limit_exceeded"

ERROR_KINDS = frozenset(
    {
        DECODE_ERROR,
        VALIDATION_ERROR,
        METADATA_VIOLATION,
        DUPLICATE_RECEIPT,
        LATE_RECEIPT,
        ALL_ROLLOUTS_FAILED,
        GROUP_TIMEOUT,
        INCONSISTENT_GROUP,
        KEY_MISMATCH,
        LIMIT_EXCEEDED,
    }
)


class DeadLetter(Message, frozen=True, tag="dead_letter"):
    """The untouched `original` bytes, their source record position, and why they were refused.

    `error_kind` is normally one of `ERROR_KINDS`; `to_dict()` shows the bytes fields as base64.
    """

    source_topic: str
    source_partition: int
    source_offset: int
    source_key: bytes | None
    original: bytes
    error_kind: str
    message: str
    worker_id: str
    time_ms: int
    redrive_count: int = 0
    # Set when `original` holds only the first bytes of a record too large to copy whole: a letter
    # must always fit in one Kafka message, or its transaction fails and the partition loops.
    original_truncated: bool = False
    original_size: int = 0
    original_sha256: str = ""
    # The source record's timestamp (ms): a redrive carries it on, so a late receipt stays late.
    source_timestamp_ms: int = 0

    def _validate(self) -> None:
        non_empty("dead_letter.source_topic", self.source_topic)
        at_least("dead_letter.source_partition", self.source_partition, 0)
        at_least("dead_letter.source_offset", self.source_offset, 0)
        # Any non-empty kind is accepted: a newer writer may add kinds in a minor version, and a
        # reader must still be able to show and re-drive those letters.
        non_empty("dead_letter.error_kind", self.error_kind)
        non_empty("dead_letter.worker_id", self.worker_id)
        at_least("dead_letter.time_ms", self.time_ms, 0)
        at_least("dead_letter.redrive_count", self.redrive_count, 0)
        at_least("dead_letter.source_timestamp_ms", self.source_timestamp_ms, 0)
        if self.original_truncated:
            at_least("dead_letter.original_size", self.original_size, len(self.original) + 1)
            if len(self.original_sha256) != 64:
                raise SchemaError("dead_letter.original_sha256", "a truncated original needs its SHA-256 (hex)")


# What a dead letter keeps of its original record, and of its message, at most.
MAX_ORIGINAL_BYTES = 512 * 1024
MAX_KEY_BYTES = 1024
MAX_MESSAGE_CHARS = 2000


def bounded_original(value: bytes, limit: int = MAX_ORIGINAL_BYTES) -> dict[str, object]:
    """The `original*` fields of a dead letter for `value`: whole when it fits, else a prefix, size and hash."""
    if len(value) <= limit:
        return {"original": value}
    return {
        "original": value[:limit],
        "original_truncated": True,
        "original_size": len(value),
        "original_sha256": hashlib.sha256(value).hexdigest(),
    }


def bounded_key(key: bytes | None) -> bytes | None:
    """A record key as a dead letter keeps it (and is keyed by): at most MAX_KEY_BYTES."""
    return key if key is None or len(key) <= MAX_KEY_BYTES else key[:MAX_KEY_BYTES]


def bounded_message(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 1] + "…"
