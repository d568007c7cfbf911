"""`GymReceipt`: NeMo Gym's receipt on Kafka, refused where NeMo Gym's models refuse it, with field paths."""

import copy
import json
from pathlib import Path

import msgspec
import pytest

from schemas.codec import decode
from schemas.errors import SchemaError
from schemas.gym_receipt import GymReceipt, GymRolloutReceipt
from schemas.receipt import Receipt

GOLDEN = Path(__file__).resolve().parents[3] / "schemas" / "golden" / "gym_receipt.json"


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_the_golden_receipt_is_one_nemo_gym_accepts_and_round_trips():
    staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
    inner = golden()["receipt"]
    theirs = staging.RolloutReceipt.model_validate(inner)
    # Every field NeMo Gym's model defines is carried, under its name, with the value it gave.
    assert theirs.model_dump(mode="json") == inner
    assert set(staging.RolloutReceipt.model_fields) == set(GymRolloutReceipt.__struct_fields__)
    assert set(staging.CallRecord.model_fields) == set(inner["manifest"][0])


def test_rlstream_and_nemo_gym_receipts_are_told_apart_by_kind():
    data = msgspec.msgpack.encode(golden())
    assert decode(data, GymReceipt).rollout_id == "group-000042_g2"
    with pytest.raises(SchemaError, match="receipt.kind: expected 'receipt', got 'gym_receipt'"):
        Receipt.from_bytes(data)


def _refusal(mutate) -> str:
    value = golden()
    mutate(value)
    with pytest.raises(SchemaError) as err:
        GymReceipt.from_bytes(msgspec.msgpack.encode(value))
    return str(err.value)


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda v: v["receipt"]["manifest"][1].update(staging_key="someone-else/call-1"), "manifest[1].staging_key"),
        (lambda v: v.update(invalid_tool_call_calls=["call-9"]), "invalid_tool_call_calls[0]"),
        (lambda v: v.update(rollout_index=4), "rollout_index"),
        (lambda v: v["receipt"]["manifest"][0].update(cum_len=6), "cum_len"),
        (lambda v: v["receipt"]["manifest"][0].update(digest="A" * 64), "digest"),
        (lambda v: v["receipt"].update(terminal_model_call_id="call-9"), "terminal_model_call_id"),
        (lambda v: v["receipt"].update(schema_version=3), "schema_version"),
    ],
)
def test_refusals_name_the_field(mutate, path):
    assert path in _refusal(mutate)


def test_a_number_sent_as_text_is_refused_where_pydantic_would_parse_it():
    """The one known difference: NeMo Gym's `reward: float` is pydantic's lax float, which parses
    "0.5"; msgpack carries types, and rlstream refuses a reward that is not a number."""
    value = golden()
    value["receipt"]["reward"] = "0.5"
    with pytest.raises(SchemaError, match=r"gym_receipt.receipt.reward"):
        GymReceipt.from_bytes(msgspec.msgpack.encode(value))


# (path into the inner receipt, value): each a change NeMo Gym's pydantic models judge one way or the other.
MUTATIONS = [
    (("reward",), None),
    (("reward",), 1),
    (("reward",), float("inf")),
    (("rollout_id",), ""),
    (("rollout_id",), 7),
    (("capture_poisoned",), True),
    (("failure_reason",), "x"),
    (("terminal_selection",), None),
    (("terminal_selection",), "guess"),
    (("terminal_model_call_id",), None),
    (("terminal_attribution_reason",), None),
    (("digest_version",), 1),
    (("extras_digest_version",), 2),
    (("unknown_field",), 1),
    (("manifest", 0, "mode"), "token_in"),
    (("manifest", 0, "prev_len"), -1),
    (("manifest", 0, "prev_len"), True),
    (("manifest", 0, "delta_len"), 0),
    (("manifest", 0, "weight_version"), -1),
    (("manifest", 0, "response_id"), ""),
    (("manifest", 0, "admitted_at"), None),
    (("manifest", 0, "admitted_at"), float("nan")),
    (("manifest", 0, "output_fingerprint"), "x"),
    (("manifest", 0, "fingerprint_version"), -1),
    (("manifest", 0, "extras_digest"), "b" * 63),
    (("manifest", 0, "parent_call_id"), ""),
    (("manifest", 0, "unknown_field"), 1),
    (("manifest", 1, "parent_call_id"), None),
    (("manifest", 1, "model_call_id"), "call-0"),
    (("manifest", 1, "schema_version"), 1),
]


@pytest.mark.parametrize(("path", "value"), MUTATIONS)
def test_accepts_and_refuses_what_nemo_gyms_models_do(path, value):
    staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
    import pydantic

    inner = copy.deepcopy(golden()["receipt"])
    target = inner
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    try:
        staging.RolloutReceipt.model_validate(inner)
        theirs = True
    except pydantic.ValidationError:
        theirs = False
    try:
        msgspec.convert(inner, GymRolloutReceipt)
        ours = True
    except (msgspec.ValidationError, SchemaError):
        ours = False
    assert ours == theirs
