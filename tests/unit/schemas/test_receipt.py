import math

import msgspec
import pytest

from schemas.errors import SchemaError
from schemas.receipt import CallRecord, Receipt


def call(i=0, **changes):
    fields = dict(
        staging_key=f"r/c{i}",
        call_id=f"c{i}",
        parent_call_id=None,
        prev_len=0,
        delta_len=4,
        cum_len=4,
        weight_version=1,
        digest="d",
    )
    fields.update(changes)
    return CallRecord(**fields)


def receipt(**changes):
    fields = dict(
        rollout_id="r",
        group_id="g",
        prompt_idx=3,
        rollout_index=1,
        group_size=4,
        reward=0.5,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="math",
        failure_reason=None,
        manifest=(call(),),
    )
    fields.update(changes)
    return Receipt(**fields)


@pytest.mark.parametrize(
    "changes,path",
    [
        ({"rollout_id": ""}, "receipt.rollout_id"),
        ({"group_id": ""}, "receipt.group_id"),
        ({"rollout_index": 4}, "receipt.rollout_index"),
        ({"rollout_index": -1}, "receipt.rollout_index"),
        ({"group_size": 0, "rollout_index": 0}, "receipt.group_size"),
        ({"prompt_idx": -1}, "receipt.prompt_idx"),
        ({"reward": math.inf}, "receipt.reward"),
        ({"loss_multiplier": math.nan}, "receipt.loss_multiplier"),
        ({"loss_multiplier": -0.5}, "receipt.loss_multiplier"),
        ({"manifest": ()}, "receipt.manifest"),
        ({"failure_reason": "", "manifest": ()}, "receipt.failure_reason"),
    ],
)
def test_receipt_boundary_checks(changes, path):
    with pytest.raises(SchemaError) as info:
        receipt(**changes)
    assert info.value.path == path


@pytest.mark.parametrize(
    "changes,path",
    [
        ({"staging_key": ""}, "call_record.staging_key"),
        ({"call_id": ""}, "call_record.call_id"),
        ({"parent_call_id": ""}, "call_record.parent_call_id"),
        ({"prev_len": -1}, "call_record.prev_len"),
        ({"delta_len": -1}, "call_record.delta_len"),
        ({"cum_len": -1}, "call_record.cum_len"),
        ({"weight_version": -1}, "call_record.weight_version"),
    ],
)
def test_call_record_boundary_checks(changes, path):
    with pytest.raises(SchemaError) as info:
        call(**changes)
    assert info.value.path == path


def test_failed_rollout_may_have_an_empty_manifest():
    failed = receipt(failure_reason="env_timeout", manifest=())
    assert Receipt.from_bytes(failed.to_bytes()).failure_reason == "env_timeout"


def test_a_broken_chain_still_decodes():
    # Chain consistency is linearization's job: a broken chain becomes a placeholder row.
    broken = receipt(
        manifest=(
            call(0, parent_call_id="nobody", prev_len=3, cum_len=99, digest="not-a-digest"),
            call(1, parent_call_id="c7", prev_len=0, delta_len=2, cum_len=1),
            call(2, call_id="c1", staging_key="r/c1"),
        )
    )
    assert Receipt.from_bytes(broken.to_bytes()) == broken


def test_bool_is_not_accepted_for_an_int_field_on_the_wire():
    raw = msgspec.msgpack.decode(receipt().to_bytes())
    raw["prompt_idx"] = True
    with pytest.raises(SchemaError) as info:
        Receipt.from_bytes(msgspec.msgpack.encode(raw))
    assert info.value.path == "receipt.prompt_idx"


def test_receipt_to_dict_is_plain_json_data():
    data = receipt().to_dict()
    assert data["kind"] == "receipt"
    assert data["schema_version"] == [1, 0]
    assert data["manifest"] == [
        {
            "staging_key": "r/c0",
            "call_id": "c0",
            "parent_call_id": None,
            "prev_len": 0,
            "delta_len": 4,
            "cum_len": 4,
            "weight_version": 1,
            "digest": "d",
            "invalid_tool_call": False,
            "malformed_thinking": False,
        }
    ]


@pytest.mark.parametrize("key", ["other-rollout/c0", "r/c9", "r", "rx/c0"])
def test_a_receipt_naming_another_rollouts_staging_is_refused_with_the_call_path(key):
    with pytest.raises(SchemaError) as info:
        receipt(manifest=(call(0), call(1, staging_key=key)))
    assert info.value.path == "receipt.manifest[1].staging_key"
    assert key in info.value.reason
