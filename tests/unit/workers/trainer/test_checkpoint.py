"""The trainer's checkpoint state: validated on the way in, positions from a mark."""

import json

import pytest

from schemas.errors import InvalidArgument
from workers.trainer.checkpoint import (
    STATE_VERSION,
    ConsumerState,
    PartitionMark,
    decode_state,
    encode_state,
)
from workers.trainer.position import PartitionPosition


def _state(**kw) -> dict:
    base = ConsumerState(STATE_VERSION, "t", "g", 3, 2, {0: PartitionMark(5, [(7, 9)])}, "run-a")
    data = encode_state(base)
    data.update(kw)
    return data


def test_a_state_survives_json_and_comes_back_equal():
    data = json.loads(json.dumps(_state()))  # partition keys become strings
    state = decode_state(data, topic="t", consumer_group="g")
    assert state.partitions == {0: PartitionMark(5, [(7, 9)])} and state.cut == 2 and state.version == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_state(version="x"), r"\$\.version"),
        (_state(schema_version=99), "schema_version 99"),
        (_state(topic="other"), "topic 'other'"),
        (_state(partitions={"0": {"offset": 5, "trained": [[3, 4]]}}), "partitions.0"),
        (_state(surprise=1), "surprise"),
    ],
)
def test_a_bad_state_is_refused_naming_what_is_wrong(data, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_state(data, topic="t", consumer_group="g")


def test_a_position_from_a_mark_starts_there_and_knows_the_trained_records_past_it():
    position = PartitionPosition.from_state(5, [(7, 9)])
    assert position.snapshot([]) == (5, [(7, 9)])  # nothing read yet: the mark itself
    assert not position.read(5) and not position.read(6)
    assert position.read(7) and position.read(8)
    position.resolve(5)
    assert position.snapshot([6]) == (6, [(7, 9)])


@pytest.mark.parametrize("trained", [[[30, 40], [10, 20]], [[10, 20], [15, 25]], [[6, 5]]])
def test_trained_ranges_out_of_order_or_overlapping_are_refused(trained):
    data = _state(partitions={"0": {"offset": 5, "trained": trained}})
    with pytest.raises(InvalidArgument, match=r"partitions\.0\.trained"):
        decode_state(data, topic="t", consumer_group="g")
