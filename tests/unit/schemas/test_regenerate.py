"""`Regenerate`: round trip, validation by field, derived group ids, and its topic decodes it by role."""

import pytest

from schemas.errors import SchemaError
from schemas.regenerate import STAGING_LOST, Regenerate, regenerated_group_id, regeneration_of
from workers.topics import TopicNames, decode_value, message_group_id, pipeline_topics, topic_role

FIELDS = dict(
    prompt_idx=5,
    group_id="g5",
    new_group_id="g5~r1",
    group_size=4,
    weight_version=2,
    reason=STAGING_LOST,
    source="p.rollout.receipts[0]@7",
    worker_id="w",
    time_ms=1,
)


def test_round_trip_and_the_topic_role():
    msg = Regenerate(**FIELDS)
    assert Regenerate.from_bytes(msg.to_bytes()) == msg
    topic = TopicNames("p").regenerate
    assert topic == "p.rollout.regenerate"
    assert topic_role(topic) == "regenerate" and decode_value(msg.to_bytes(), topic_role(topic)) == msg
    assert message_group_id(msg) == "g5"
    spec = {s.name: s for s in pipeline_topics(TopicNames("p"), 4)}[topic]
    assert spec.partitions == 4 and "cleanup.policy" not in spec.config


@pytest.mark.parametrize(
    "field,value",
    [
        ("prompt_idx", -1),
        ("group_id", ""),
        ("new_group_id", ""),
        ("new_group_id", "g5"),
        ("group_size", 0),
        ("weight_version", -1),
        ("reason", ""),
        ("source", ""),
        ("worker_id", ""),
        ("time_ms", -1),
    ],
)
def test_bad_fields_are_named(field, value):
    with pytest.raises(SchemaError) as err:
        Regenerate(**{**FIELDS, field: value})
    assert err.value.path == f"regenerate.{field}"


def test_regenerated_ids_are_derived_and_never_collide_with_the_original():
    assert regenerated_group_id("g") == "g~r1"
    assert regenerated_group_id("g~r1") == "g~r2"
    assert regenerated_group_id(regenerated_group_id("g~r9")) == "g~r11"
    assert regeneration_of("g~r2") == ("g", 2) and regeneration_of("g") == ("g", 0)
    # Ids that only look alike are originals, and regenerate under their own whole id.
    for odd in ("~r1", "g~r", "g~r01", "g~rx"):
        assert regeneration_of(odd) == (odd, 0)
        assert regenerated_group_id(odd) == odd + "~r1"
