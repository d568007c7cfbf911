import base64

import pytest

from schemas import deadletter
from schemas.deadletter import DeadLetter
from schemas.errors import SchemaError


def letter(**changes):
    fields = dict(
        source_topic="rollout.receipts",
        source_partition=2,
        source_offset=17,
        source_key=b"g-1",
        original=b"\x00\xff not msgpack",
        error_kind="decode_error",
        message="boom",
        worker_id="w0",
        time_ms=5,
    )
    fields.update(changes)
    return DeadLetter(**fields)


def test_error_kind_constants():
    assert (
        deadletter.DECODE_ERROR,
        deadletter.VALIDATION_ERROR,
        deadletter.METADATA_VIOLATION,
        deadletter.DUPLICATE_RECEIPT,
        deadletter.LATE_RECEIPT,
        deadletter.ALL_ROLLOUTS_FAILED,
        deadletter.GROUP_TIMEOUT,
        deadletter.INCONSISTENT_GROUP,
    ) == (
        "decode_error",
        "validation_error",
        "metadata_violation",
        "duplicate_receipt",
        "late_receipt",
        "all_rollouts_failed",
        "group_timeout",
        "inconsistent_group",
    )
    assert len(deadletter.ERROR_KINDS) == 10


def test_original_bytes_survive_untouched():
    original = bytes(range(256))
    back = DeadLetter.from_bytes(letter(original=original, source_key=None).to_bytes())
    assert back.original == original
    assert back.source_key is None
    assert back.redrive_count == 0


def test_to_dict_shows_bytes_as_base64():
    data = letter().to_dict()
    assert data["original"] == base64.b64encode(b"\x00\xff not msgpack").decode()
    assert data["source_key"] == "Zy0x"


@pytest.mark.parametrize(
    "changes,path",
    [
        ({"error_kind": ""}, "dead_letter.error_kind"),
        ({"source_offset": -1}, "dead_letter.source_offset"),
        ({"redrive_count": -1}, "dead_letter.redrive_count"),
        ({"worker_id": ""}, "dead_letter.worker_id"),
    ],
)
def test_dead_letter_checks(changes, path):
    with pytest.raises(SchemaError) as info:
        letter(**changes)
    assert info.value.path == path


def test_an_error_kind_from_a_newer_writer_still_decodes():
    assert DeadLetter.from_bytes(letter(error_kind="quota_exceeded").to_bytes()).error_kind == "quota_exceeded"


def test_an_original_too_large_to_copy_keeps_a_prefix_its_size_and_its_hash():
    import hashlib

    from schemas.deadletter import MAX_ORIGINAL_BYTES, bounded_original

    small = b"x" * 100
    assert bounded_original(small) == {"original": small}
    big = bytes(range(256)) * 4000  # ~1 MB: a letter copying it whole would not fit one Kafka message
    kept = bounded_original(big)
    assert len(kept["original"]) == MAX_ORIGINAL_BYTES and big.startswith(kept["original"])
    assert kept["original_size"] == len(big) and kept["original_sha256"] == hashlib.sha256(big).hexdigest()
    letter = deadletter.DeadLetter(
        source_topic="t", source_partition=0, source_offset=1, source_key=None, error_kind="decode_error",
        message="m", worker_id="w", time_ms=1, **kept,
    )  # fmt: skip
    assert len(letter.to_bytes()) < 600_000  # librdkafka refuses messages over 1,000,000 bytes
    assert deadletter.DeadLetter.from_bytes(letter.to_bytes()) == letter


def test_a_truncated_original_must_say_its_size_and_hash():
    with pytest.raises(SchemaError, match="original_sha256"):
        deadletter.DeadLetter(
            source_topic="t", source_partition=0, source_offset=1, source_key=None, original=b"ab",
            error_kind="decode_error", message="m", worker_id="w", time_ms=1,
            original_truncated=True, original_size=10,
        )  # fmt: skip


def test_a_letter_written_before_truncation_existed_still_decodes_whole():
    import msgpack

    old = {
        "kind": "dead_letter", "schema_version": [1, 0], "source_topic": "t", "source_partition": 0,
        "source_offset": 3, "source_key": None, "original": b"abc", "error_kind": "decode_error",
        "message": "m", "worker_id": "w", "time_ms": 5, "redrive_count": 0,
    }  # fmt: skip
    letter = deadletter.DeadLetter.from_bytes(msgpack.packb(old))
    assert letter.original == b"abc" and not letter.original_truncated
