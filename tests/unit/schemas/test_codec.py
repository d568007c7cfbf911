import json
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import MAX_MESSAGE_BYTES, SCHEMA_VERSION, decode, encode
from schemas.deadletter import ERROR_KINDS, DeadLetter
from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup, SourceRange
from schemas.receipt import CallRecord, Receipt
from schemas.request import ReassemblyRequest, RolloutReassemblerActorConfig
from schemas.state import GroupState

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ids = st.text(min_size=1, max_size=12)
naturals = st.integers(0, 2**62)
finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def call_records(draw):
    return CallRecord(
        staging_key=draw(ids),
        call_id=draw(ids),
        parent_call_id=draw(st.none() | ids),
        prev_len=draw(naturals),
        delta_len=draw(naturals),
        cum_len=draw(naturals),
        weight_version=draw(naturals),
        digest=draw(st.text(max_size=16)),
        invalid_tool_call=draw(st.booleans()),
        malformed_thinking=draw(st.booleans()),
    )


@st.composite
def receipts(draw):
    group_size = draw(st.integers(1, 64))
    failure = draw(st.none() | ids)
    rollout_id = draw(ids)
    drawn = draw(st.lists(call_records(), min_size=0 if failure else 1, max_size=5))
    # A receipt's staging keys are `{rollout_id}/{call_id}` (checked on decode).
    manifest = [msgspec.structs.replace(c, staging_key=f"{rollout_id}/{c.call_id}") for c in drawn]
    return Receipt(
        rollout_id=rollout_id,
        group_id=draw(ids),
        prompt_idx=draw(naturals),
        rollout_index=draw(st.integers(0, group_size - 1)),
        group_size=group_size,
        reward=draw(finite),
        mask_sample=draw(st.booleans()),
        loss_multiplier=draw(st.floats(0, 1e6)),
        environment=draw(st.text(max_size=8)),
        failure_reason=failure,
        manifest=tuple(manifest),
        truncated=draw(st.booleans()),
    )


tag_values = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | finite
    | st.text(max_size=6)
    | st.lists(naturals, max_size=3)
)


@st.composite
def finalized_groups(draw):
    n = draw(st.integers(0, 6))
    reason = st.none() | st.sampled_from(["missing_receipt", "rebuild_failed"])
    reasons = tuple(draw(st.lists(reason, min_size=n, max_size=n)))
    dropped = draw(st.booleans())
    min_wv = draw(naturals)
    first = draw(naturals)
    return FinalizedGroup(
        group_id=draw(ids),
        prompt_idx=draw(naturals),
        partition_id=draw(ids),
        sample_ids=tuple(f"g_g{i}" for i in range(n)),
        tags=tuple(draw(st.dictionaries(st.text(max_size=8), tag_values, max_size=4)) for _ in range(n)),
        group_min_wv=min_wv,
        group_max_wv=min_wv + draw(st.integers(0, 5)),
        canonical_output_tokens=draw(naturals),
        valid_row_count=sum(r is None for r in reasons),
        total_row_count=n,
        rejection_reasons=reasons,
        dropped=dropped,
        drop_reason=draw(ids) if dropped else None,
        metrics=draw(st.dictionaries(st.text(max_size=8), finite, max_size=3)),
        source=draw(
            st.none() | st.builds(SourceRange, ids, st.integers(0, 99), st.just(first), st.integers(first, first + 100))
        ),
        finalized_at_ms=draw(naturals),
    )


dead_letters = st.builds(
    DeadLetter,
    source_topic=ids,
    source_partition=naturals,
    source_offset=naturals,
    source_key=st.none() | st.binary(max_size=20),
    original=st.binary(max_size=200),
    error_kind=st.sampled_from(sorted(ERROR_KINDS)),
    message=st.text(max_size=30),
    worker_id=ids,
    time_ms=naturals,
    redrive_count=naturals,
)


@st.composite
def group_states(draw):
    first = draw(naturals)
    status = draw(st.sampled_from(["open", "closed"]))
    return GroupState(
        group_id=draw(ids),
        status=status,
        partition=draw(st.integers(0, 999)),
        first_offset=first,
        last_offset=first + draw(st.integers(0, 1000)),
        first_seen_ms=draw(naturals),
        outcome=None if status == "open" else draw(st.sampled_from(["finalized", "dead_lettered"])),
        finalized_at_ms=draw(naturals),
        staging_keys=tuple(draw(st.lists(ids, max_size=3))),
    )


@st.composite
def requests(draw):
    n = draw(st.integers(0, 5))
    return ReassemblyRequest(
        group_id=draw(ids),
        rollout_ids=tuple(draw(st.lists(ids, min_size=n, max_size=n))),
        canonical_sample_ids=tuple(f"g_g{i}" for i in range(n)),
        receipts=tuple(draw(st.lists(st.none() | receipts().map(Receipt.to_dict), min_size=n, max_size=n))),
        rewards=tuple(draw(st.lists(finite, min_size=n, max_size=n))),
        fallback_weight_version=draw(naturals),
        prompt_idx=draw(naturals),
        mask_sample=tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
        loss_multiplier=draw(st.floats(0, 10)),
    )


configs = st.builds(
    RolloutReassemblerActorConfig,
    partition_id=ids,
    staging_partition=ids,
    pad_token_id=naturals,
    router_replay_enabled=st.booleans(),
    defer_routed_experts_to_policy=st.booleans(),
    max_seq_len=st.integers(1, 2**20),
)

ALL = [
    (Receipt, receipts()),
    (FinalizedGroup, finalized_groups()),
    (DeadLetter, dead_letters),
    (GroupState, group_states()),
    (ReassemblyRequest, requests()),
    (RolloutReassemblerActorConfig, configs),
]


@pytest.mark.parametrize("cls,strategy", ALL, ids=[c.__name__ for c, _ in ALL])
def test_round_trip(cls, strategy):
    @SETTINGS
    @given(strategy)
    def check(message):
        data = message.to_bytes()
        assert encode(message) == data
        assert cls.from_bytes(data) == message
        assert decode(data, cls) == message
        # The wire form is one map carrying the kind and the version.
        raw = msgspec.msgpack.decode(data)
        assert raw["kind"] == cls.kind()
        assert raw["schema_version"] == list(SCHEMA_VERSION)
        json.dumps(message.to_dict())  # JSON-able for CLI printing

    check()


def _receipt_map(**changes):
    receipt = Receipt(
        rollout_id="r",
        group_id="g",
        prompt_idx=0,
        rollout_index=0,
        group_size=2,
        reward=1.0,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="e",
        failure_reason=None,
        manifest=tuple(CallRecord(f"r/c{i}", f"c{i}", None, 0, 1, 1, 0, "d") for i in range(3)),
    )
    raw = msgspec.msgpack.decode(receipt.to_bytes())
    raw.update(changes)
    return raw


def _decode_receipt(raw):
    return Receipt.from_bytes(msgspec.msgpack.encode(raw))


def test_nan_reward_is_rejected_with_its_path():
    with pytest.raises(SchemaError) as info:
        _decode_receipt(_receipt_map(reward=math.nan))
    assert info.value.path == "receipt.reward"
    assert str(info.value).startswith("receipt.reward: ")


@pytest.mark.parametrize("field", ["loss_multiplier", "reward"])
def test_infinite_floats_are_rejected(field):
    with pytest.raises(SchemaError) as info:
        _decode_receipt(_receipt_map(**{field: -math.inf}))
    assert info.value.path == f"receipt.{field}"


def test_wrong_type_deep_in_the_manifest_names_the_field():
    raw = _receipt_map()
    raw["manifest"][2]["cum_len"] = "seven"
    with pytest.raises(SchemaError) as info:
        _decode_receipt(raw)
    assert info.value.path == "receipt.manifest[2].cum_len"


def test_invalid_value_deep_in_the_manifest_names_the_field():
    raw = _receipt_map()
    raw["manifest"][1]["delta_len"] = -1
    with pytest.raises(SchemaError) as info:
        _decode_receipt(raw)
    assert info.value.path == "receipt.manifest[1].delta_len"


def test_missing_field_is_named():
    raw = _receipt_map()
    del raw["manifest"][0]["digest"]
    with pytest.raises(SchemaError) as info:
        _decode_receipt(raw)
    assert info.value.path == "receipt.manifest[0].digest"


def test_unknown_major_version_is_rejected_even_when_fields_changed():
    with pytest.raises(SchemaError) as info:
        _decode_receipt(_receipt_map(schema_version=[2, 0]))
    assert info.value.path == "receipt.schema_version"
    raw = _receipt_map(schema_version=[2, 0], reward="a string in v2")
    with pytest.raises(SchemaError) as info:
        _decode_receipt(raw)
    assert info.value.path == "receipt.schema_version"


def test_higher_minor_version_and_unknown_fields_are_tolerated():
    receipt = _decode_receipt(_receipt_map(schema_version=[1, 9], added_in_1_9={"x": [1, 2]}))
    assert receipt.schema_version == (1, 9)
    assert receipt.reward == 1.0


@pytest.mark.parametrize("missing", ["kind", "schema_version"])
def test_missing_kind_or_version_is_rejected(missing):
    raw = _receipt_map()
    del raw[missing]
    with pytest.raises(SchemaError) as info:
        _decode_receipt(raw)
    assert info.value.path == f"receipt.{missing}"


def test_a_message_of_another_kind_is_rejected():
    data = GroupState("g", "open", 0, 0, 0, 0).to_bytes()
    with pytest.raises(SchemaError) as info:
        Receipt.from_bytes(data)
    assert info.value.path == "receipt.kind"


def test_oversize_payload_is_rejected_before_parsing():
    with pytest.raises(SchemaError, match="exceeds"):
        Receipt.from_bytes(b"\xc1" * (MAX_MESSAGE_BYTES + 1))  # 0xc1 is never valid msgpack
    data = msgspec.msgpack.encode(_receipt_map())
    with pytest.raises(SchemaError, match="exceeds"):
        Receipt.from_bytes(data, max_bytes=len(data) - 1)
    assert Receipt.from_bytes(data, max_bytes=len(data)).reward == 1.0


def test_non_bytes_input_is_a_schema_error():
    with pytest.raises(SchemaError):
        Receipt.from_bytes("not bytes")  # type: ignore[arg-type]


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_schema_error(data):
    for cls, _ in ALL:
        try:
            cls.from_bytes(data)
        except SchemaError:
            pass


@SETTINGS
@given(receipts(), st.data())
def test_truncated_bytes_only_raise_schema_error(receipt, data):
    encoded = receipt.to_bytes()
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(SchemaError):
        Receipt.from_bytes(encoded[:cut])


@SETTINGS
@given(receipts(), st.data())
def test_corrupted_bytes_decode_or_raise_schema_error(receipt, data):
    encoded = bytearray(receipt.to_bytes())
    position = data.draw(st.integers(0, len(encoded) - 1))
    encoded[position] = data.draw(st.integers(0, 255))
    try:
        Receipt.from_bytes(bytes(encoded))
    except SchemaError:
        pass


def test_constructors_validate_like_the_decoder():
    with pytest.raises(SchemaError) as info:
        Receipt(
            rollout_id="r",
            group_id="g",
            prompt_idx=0,
            rollout_index=0,
            group_size=1,
            reward=math.nan,
            mask_sample=True,
            loss_multiplier=1.0,
            environment="e",
            failure_reason="oom",
            manifest=(),
        )
    assert info.value.path == "receipt.reward"


def test_schema_error_is_a_value_error_with_path_and_reason():
    error = SchemaError("receipt.manifest[2].cum_len", "must be >= 0")
    assert isinstance(error, ValueError)
    assert str(error) == "receipt.manifest[2].cum_len: must be >= 0"
    assert (error.path, error.reason) == ("receipt.manifest[2].cum_len", "must be >= 0")
