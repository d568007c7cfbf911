"""The Ray face's request → group: one rollout may not fill two slots (it would be trained twice)."""

import pytest

from schemas.errors import SchemaError
from schemas.request import ReassemblyRequest
from workers.actors.reassembler import request_group
from workers.rollout.synthetic import SyntheticShape, make_group

SHAPE = SyntheticShape(group_size=3, calls=(1, 1), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))


def _request(rollout_ids, receipts):
    n = len(rollout_ids)
    return ReassemblyRequest(
        group_id="g", rollout_ids=tuple(rollout_ids), canonical_sample_ids=tuple(f"g_g{i}" for i in range(n)),
        receipts=tuple(receipts), rewards=(1.0,) * n, fallback_weight_version=0, prompt_idx=0, mask_sample=(True,) * n,
    )  # fmt: skip


def test_a_group_from_distinct_rollouts():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    group = request_group(_request([r.receipt.rollout_id for r in rollouts], [r.receipt.to_dict() for r in rollouts]))
    assert sorted(group.receipts) == [0, 1, 2] and group.group_size == 3


def test_a_rollout_id_named_twice_is_refused_naming_it_and_its_slots():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    ids = [rollouts[0].receipt.rollout_id, rollouts[1].receipt.rollout_id, rollouts[0].receipt.rollout_id]
    with pytest.raises(SchemaError, match=r"rpc\.rollout_ids: .*'g-r0'.*slots 0 and 2"):
        request_group(_request(ids, [r.receipt.to_dict() for r in rollouts]))


def test_one_rlstream_receipt_in_two_slots_is_refused_naming_both():
    rollouts = make_group("g", 0, 1, shape=SHAPE)
    receipts = [rollouts[0].receipt.to_dict(), rollouts[1].receipt.to_dict(), rollouts[0].receipt.to_dict()]
    with pytest.raises(SchemaError, match=r"rpc\.receipts\[2\]\.rollout_id: .*'g-r0'.*receipts\[0\]"):
        request_group(_request(["a", "b", "c"], receipts))


# --- NeMo Gym receipt dicts: accepted and coerced exactly as NeMo Gym's pydantic model does ---------------------------

LAX = {
    "reward_as_text": (lambda d: d.update(reward="0.5"), ("reward", 0.5)),
    "reward_as_bool": (lambda d: d.update(reward=True), ("reward", 1.0)),
    "poisoned_as_int": (lambda d: d.update(capture_poisoned=1, failure_reason="env"), ("capture_poisoned", True)),
    "poisoned_as_text": (lambda d: d.update(capture_poisoned="false"), ("capture_poisoned", False)),
    "schema_version_as_float": (lambda d: d.update(schema_version=2.0), ("schema_version", 2)),
}
REFUSED = {
    "reward_not_a_number": (lambda d: d.update(reward="half"), "reward"),
    "reward_huge": (lambda d: d.update(reward=10**400), "reward"),
    "schema_version_as_bool": (lambda d: d.update(schema_version=True), "schema_version"),
    "unknown_field": (lambda d: d.update(extra=1), "extra"),
    "negative_delta": (lambda d: d["manifest"][0].update(delta_len=-1), "manifest.0.delta_len"),
}


def _gym_request(change):
    import random

    from tests.unit.schemas.gym_cases import valid_case

    receipt, _, _ = valid_case(random.Random(4), "g_g0", top_token=2**63 - 1)
    change(receipt)
    return _request(["g_g0"], [receipt]), receipt


@pytest.mark.parametrize("name", sorted(LAX))
def test_a_nemo_gym_dict_is_coerced_as_nemo_gyms_model_coerces_it(name):
    staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
    change, (field, value) = LAX[name]
    request, receipt = _gym_request(change)
    theirs = staging.RolloutReceipt.model_validate(receipt)
    (got,) = request_group(request).receipts.values()
    assert getattr(got.receipt, field) == getattr(theirs, field) == value
    assert type(getattr(got.receipt, field)) is type(getattr(theirs, field))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_nemo_gym_dict_its_model_refuses_is_refused_naming_the_field(name):
    staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
    pydantic = pytest.importorskip("pydantic")
    change, field = REFUSED[name]
    request, receipt = _gym_request(change)
    with pytest.raises(pydantic.ValidationError):
        staging.RolloutReceipt.model_validate(receipt)
    with pytest.raises(SchemaError, match=rf"rpc\.receipts\[0\]\.{field}"):
        request_group(request)
