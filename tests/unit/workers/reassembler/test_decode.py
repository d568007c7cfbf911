"""Receipt decoding at the reassembler's boundary, and the redrive header."""

import msgpack
import msgspec
import pytest

from schemas import deadletter as dl
from schemas.receipt import Receipt
from workers.reassembler.decode import REDRIVE_HEADER, Limits, Refused, decode_receipt, redrive_count

from .fixtures import receipt


def test_a_good_receipt_decodes():
    r = receipt("g", 1)
    assert decode_receipt(r.to_bytes()) == r


@pytest.mark.parametrize("value", [None, b"", b"\x93\xff\x00garbage"])
def test_empty_or_garbage_values_are_decode_errors(value):
    got = decode_receipt(value)
    assert isinstance(got, Refused) and got.kind == dl.DECODE_ERROR
    assert got.message.startswith("receipt:")


def test_a_tensor_field_smuggled_into_a_receipt_is_a_metadata_violation():
    body = dict(msgpack.unpackb(receipt("g", 0).to_bytes()), token_ids=list(range(8)))
    got = decode_receipt(msgpack.packb(body))
    assert isinstance(got, Refused) and got.kind == dl.METADATA_VIOLATION
    assert "token_ids" in got.message
    # The schema alone would accept it: unknown fields are tolerated across minor versions.
    assert isinstance(Receipt.from_bytes(msgpack.packb(body)), Receipt)


@pytest.mark.parametrize(
    "change,field",
    [({"schema_version": [9, 0]}, "schema_version"), ({"rollout_index": 5}, "rollout_index"), ({"kind": "x"}, "kind")],
)
def test_a_receipt_failing_its_schema_is_a_validation_error(change, field):
    body = dict(msgpack.unpackb(receipt("g", 0).to_bytes()), **change)
    got = decode_receipt(msgpack.packb(body))
    assert isinstance(got, Refused) and got.kind == dl.VALIDATION_ERROR
    assert field in got.message


@pytest.mark.parametrize(
    "headers,count",
    [
        (None, 0),
        ((), 0),
        ((("other", b"3"),), 0),
        (((REDRIVE_HEADER, b"3"),), 3),
        ((("other", b"1"), (REDRIVE_HEADER, b"2")), 2),
        (((REDRIVE_HEADER, b"-4"),), 0),
        (((REDRIVE_HEADER, b"three"),), 0),
        (((REDRIVE_HEADER, None),), 0),
    ],
)
def test_redrive_count_reads_the_header_and_shrugs_off_bad_values(headers, count):
    assert redrive_count(headers) == count


def _sized(*, size: int = 2, calls: int = 1, delta: int = 4) -> Receipt:
    from schemas.receipt import CallRecord

    manifest = tuple(
        CallRecord(f"g-r0/c{i}", f"c{i}", None if i == 0 else f"c{i - 1}", i * delta, delta, (i + 1) * delta, 1, "d")
        for i in range(calls)
    )
    return msgspec.structs.replace(receipt("g", 0, size=size), manifest=manifest)


@pytest.mark.parametrize(
    "kwargs,field",
    [({"size": 2**40}, "group_size"), ({"calls": 9}, "9 calls"), ({"delta": 10**6}, "manifest[0].delta_len")],
)
def test_sizes_a_receipt_declares_past_the_configured_bounds_are_refused(kwargs, field):
    limits = Limits(max_group_size=64, max_calls_per_rollout=8, max_tokens_per_call=4096)
    assert decode_receipt(_sized().to_bytes(), limits) == _sized()
    got = decode_receipt(_sized(**kwargs).to_bytes(), limits)
    assert isinstance(got, Refused) and got.kind == dl.LIMIT_EXCEEDED
    assert field in got.message


def test_a_receipt_keyed_other_than_by_its_group_id_or_unkeyed_is_refused():
    value = receipt("g", 0).to_bytes()
    assert decode_receipt(value, key=b"g") == receipt("g", 0)
    for key in (b"other", b""):
        got = decode_receipt(value, key=key)
        assert isinstance(got, Refused) and got.kind == dl.KEY_MISMATCH
        assert "'g'" in got.message


def test_ids_longer_than_the_bound_are_refused_before_they_key_any_record():
    long_id = "g" * 300
    got = decode_receipt(receipt(long_id, 0).to_bytes(), Limits(max_id_bytes=256))
    assert isinstance(got, Refused) and got.kind == dl.LIMIT_EXCEEDED and "group_id of 300 bytes" in got.message
