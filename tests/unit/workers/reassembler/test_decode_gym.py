"""NeMo Gym receipts at the reassembler's boundary: decoded beside rlstream's, refused by the same rules."""

import json
from pathlib import Path

import msgpack

from schemas import deadletter as dl
from schemas.gym_receipt import GymReceipt
from workers.reassembler.decode import Limits, Refused, decode_receipt

from .fixtures import receipt

GOLDEN = Path(__file__).resolve().parents[4] / "schemas" / "golden" / "gym_receipt.json"


def body() -> dict:
    return json.loads(GOLDEN.read_text())


def test_both_kinds_decode_from_one_topic():
    got = decode_receipt(msgpack.packb(body()), key=b"group-000042")
    assert isinstance(got, GymReceipt) and got.rollout_id == "group-000042_g2"
    assert [c.call_id for c in got.manifest] == ["call-0", "call-1"]
    assert decode_receipt(receipt("g", 1).to_bytes(), key=b"g") == receipt("g", 1)


def test_a_tensor_smuggled_into_a_nemo_gym_receipt_is_a_metadata_violation():
    value = body()
    value["receipt"]["manifest"][0]["token_ids_delta"] = [1, 2, 3]
    got = decode_receipt(msgpack.packb(value))
    assert isinstance(got, Refused) and got.kind == dl.METADATA_VIOLATION and "token_ids_delta" in got.message


def test_a_receipt_nemo_gym_would_not_build_is_a_validation_error_naming_the_field():
    value = body()
    value["receipt"]["manifest"][1]["parent_call_id"] = None  # a root that starts after 5 tokens
    got = decode_receipt(msgpack.packb(value))
    assert isinstance(got, Refused) and got.kind == dl.VALIDATION_ERROR
    assert "gym_receipt.receipt.manifest[1].prev_len" in got.message


def test_limits_and_keys_apply_to_nemo_gym_receipts_too():
    data = msgpack.packb(body())
    got = decode_receipt(data, Limits(max_calls_per_rollout=1))
    assert isinstance(got, Refused) and got.kind == dl.LIMIT_EXCEEDED and "2 calls" in got.message
    got = decode_receipt(data, Limits(max_tokens_per_call=4))
    assert isinstance(got, Refused) and got.kind == dl.LIMIT_EXCEEDED and "delta_len 5" in got.message
    got = decode_receipt(data, key=b"another-group")
    assert isinstance(got, Refused) and got.kind == dl.KEY_MISMATCH
