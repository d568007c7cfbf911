"""The state topic's two message kinds, and how the state role decodes them."""

import msgspec
import pytest

from schemas.errors import SchemaError
from schemas.state import CLOSED, OPEN, PROGRESS_KEY, GroupState, PartitionProgress, decode_state_entry
from workers.topics import STATE_ROLE, decode_value

from .fixtures import closed

# A closed entry as encoded before `staging_cleared` existed (the group_state golden vector of then).
BEFORE_STAGING_CLEARED = bytes.fromhex(
    "8ba46b696e64ab67726f75705f7374617465a867726f75705f6964ac67726f75702d303030303432a6737461747573a6636c6f736564"
    "a9706172746974696f6e03ac66697273745f6f6666736574cd04b0ab6c6173745f6f6666736574cd04b1ad66697273745f7365656e5f"
    "6d73cf0000019ab697e418a76f7574636f6d65a966696e616c697a6564af66696e616c697a65645f61745f6d73cf0000019ab697e800"
    "ac73746167696e675f6b65797392b3726f6c6c6f75742d376633612f63616c6c2d30b3726f6c6c6f75742d376633612f63616c6c2d31"
    "ae736368656d615f76657273696f6e920100"
)


def test_progress_round_trips():
    p = PartitionProgress(partition=2, emitted_through=41, time_ms=7)
    assert PartitionProgress.from_bytes(p.to_bytes()) == p


@pytest.mark.parametrize(
    "fields,path",
    [
        ({"partition": -1, "emitted_through": 0, "time_ms": 0}, "partition_progress.partition"),
        ({"partition": 0, "emitted_through": -2, "time_ms": 0}, "partition_progress.emitted_through"),
        ({"partition": 0, "emitted_through": 0, "time_ms": 0, "horizon_ms": -1}, "partition_progress.horizon_ms"),
        ({"partition": 0, "emitted_through": 0, "time_ms": 0, "restore_from": -1}, "partition_progress.restore_from"),
        ({"partition": 0, "emitted_through": 0, "time_ms": -1}, "partition_progress.time_ms"),
    ],
)
def test_progress_checks(fields, path):
    with pytest.raises(SchemaError) as info:
        PartitionProgress(**fields)
    assert info.value.path == path


def test_an_entry_written_before_staging_cleared_existed_decodes_as_not_cleared():
    entry = GroupState.from_bytes(BEFORE_STAGING_CLEARED)
    assert entry.status == CLOSED and entry.staging_keys and entry.staging_cleared is False
    assert entry.staging_to_clear == entry.staging_keys


def test_staging_to_clear_is_empty_once_cleared_and_for_open_groups():
    assert closed("g", 0, 1, keys=("k",)).staging_to_clear == ("k",)
    assert closed("g", 0, 1, keys=("k",), cleared=True).staging_to_clear == ()
    assert GroupState("g", OPEN, 0, 0, 0, 0, staging_keys=("k",)).staging_to_clear == ()


def test_an_open_group_cannot_have_cleared_staging():
    with pytest.raises(SchemaError) as info:
        GroupState("g", OPEN, 0, 0, 0, 0, staging_cleared=True)
    assert info.value.path == "group_state.staging_cleared"


def test_the_state_role_decodes_either_kind_by_its_kind():
    progress = PartitionProgress(partition=1, emitted_through=3, time_ms=0)
    entry = closed("g", 0, 1, keys=("k",), cleared=True)
    assert decode_value(progress.to_bytes(), STATE_ROLE) == progress
    assert decode_value(entry.to_bytes(), STATE_ROLE) == entry
    with pytest.raises(SchemaError) as info:
        decode_value(b"\x81\xa4kind\xa7receipt", STATE_ROLE)
    assert info.value.path.startswith("group_state")


def test_no_prompt_group_key_can_collide_with_the_progress_key():
    with pytest.raises(UnicodeDecodeError):
        PROGRESS_KEY.decode("utf-8")


def test_decode_state_entry_takes_either_kind_and_names_the_bad_field():
    entry = GroupState("g", OPEN, 0, 1, 1, 5)
    progress = PartitionProgress(partition=0, emitted_through=3, time_ms=0, restore_from=9)
    assert decode_state_entry(entry.to_bytes()) == entry
    assert decode_state_entry(progress.to_bytes()) == progress
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(progress), "restore_from": -5})
    with pytest.raises(SchemaError) as info:
        decode_state_entry(bad)
    assert info.value.path == "partition_progress.restore_from"
    with pytest.raises(SchemaError):
        decode_state_entry(b"\xc1garbage")
