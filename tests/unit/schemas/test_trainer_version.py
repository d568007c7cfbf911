"""`TrainerVersion`: round trip, validation by field, and its topic decodes it by role."""

import msgspec
import pytest

from schemas.errors import SchemaError
from schemas.trainer_version import TrainerVersion
from workers.topics import TopicNames, decode_value, pipeline_topics, topic_role

FIELDS = dict(trainer_id="t", consumer_group="cg", version=3, batch_groups=24, time_ms=1)


def test_round_trip_and_the_topic_role():
    msg = TrainerVersion(**FIELDS)
    assert TrainerVersion.from_bytes(msg.to_bytes()) == msg
    topic = TopicNames("p").trainer_version
    assert topic_role(topic) == "trainer_version" and decode_value(msg.to_bytes(), topic_role(topic)) == msg
    spec = {s.name: s for s in pipeline_topics(TopicNames("p"), 4)}[topic]
    assert spec.partitions == 1 and spec.config["cleanup.policy"] == "compact"


@pytest.mark.parametrize(
    "field,value",
    [
        ("trainer_id", ""),
        ("consumer_group", ""),
        ("version", -1),
        ("batch_groups", 0),
        ("time_ms", -1),
        ("lost_groups", -1),
    ],
)
def test_bad_fields_are_named(field, value):
    with pytest.raises(SchemaError) as err:
        TrainerVersion(**{**FIELDS, field: value})
    assert err.value.path == f"trainer_version.{field}"


def test_a_record_from_a_1_0_writer_without_losses_decodes_with_none_known():
    old = msgspec.msgpack.encode({"kind": "trainer_version", "schema_version": [1, 0], **FIELDS})
    msg = TrainerVersion.from_bytes(old)
    assert (msg.lost_groups, msg.run) == (0, "") and msg.version == 3


def test_a_newer_minor_with_fields_this_reader_does_not_know_still_decodes():
    newer = msgspec.msgpack.encode(
        {"kind": "trainer_version", "schema_version": [1, 9], **FIELDS, "lost_groups": 4, "run": "r", "later": 1}
    )
    assert TrainerVersion.from_bytes(newer).lost_groups == 4
