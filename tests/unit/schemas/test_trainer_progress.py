"""`TrainerProgress`: round trip, validation by field path, chunks that carry any number of ranges and
join back only when they are all the commit's, and its topic decodes it by role."""

import msgspec
import pytest

from schemas.codec import MAX_MESSAGE_BYTES
from schemas.errors import SchemaError
from schemas.trainer_progress import MAX_CHUNK_RANGES, TrainerProgress, join_chunks, progress_chunks
from workers.topics import TopicNames, decode_value, pipeline_topics, topic_role

FIELDS = dict(
    consumer_group="trainer",
    topic="p.experience.finalized",
    partition=2,
    offset=100,
    token="abc.1",
    chunk=0,
    chunks=1,
    base=100,
    ranges=(0, 1, 2, 0),
    time_ms=1,
)


def test_round_trip_the_ranges_and_the_topic_role():
    msg = TrainerProgress(**FIELDS)
    assert TrainerProgress.from_bytes(msg.to_bytes()) == msg
    assert msg.decoded() == [(100, 101), (103, 103)]
    topic = TopicNames("p").trainer_progress
    assert topic == "p.trainer.progress"
    assert topic_role(topic) == "trainer_progress" and decode_value(msg.to_bytes(), topic_role(topic)) == msg
    spec = {s.name: s for s in pipeline_topics(TopicNames("p"), 4)}[topic]
    assert spec.partitions == 1 and spec.config["cleanup.policy"] == "compact"


@pytest.mark.parametrize(
    "changes,path",
    [
        ({"consumer_group": ""}, "consumer_group"),
        ({"token": ""}, "token"),
        ({"partition": -1}, "partition"),
        ({"chunks": 0}, "chunks"),
        ({"chunk": 1}, "chunk"),  # not below chunks
        ({"base": 99}, "base"),  # chunk 0 counts from the offset
        ({"ranges": (0, 1, 2)}, "ranges"),
        ({"ranges": (0, 1, 0, 3)}, "ranges[2]"),  # a later range must start past the one before
        ({"ranges": (0, -1)}, "ranges[1]"),
        ({"chunk": 1, "chunks": 2, "base": 150, "ranges": (0, 1)}, "ranges[0]"),
    ],
)
def test_a_bad_field_is_named_by_its_path(changes, path):
    bad = msgspec.msgpack.encode({"kind": "trainer_progress", "schema_version": [1, 0], **FIELDS, **changes})
    with pytest.raises(SchemaError) as err:
        TrainerProgress.from_bytes(bad)
    assert err.value.path == f"trainer_progress.{path}"


def _alternating(n: int, start: int = 10) -> list[tuple[int, int]]:
    return [(start + 2 * i + 1, start + 2 * i + 1) for i in range(n)]


def test_any_number_of_ranges_travels_in_chunks_that_each_fit_a_message_and_join_back():
    ranges = _alternating(2 * MAX_CHUNK_RANGES + 5)
    chunks = progress_chunks("g", "t", 0, 10, "tok", ranges, 1)
    assert len(chunks) == 3 and all(len(c.to_bytes()) < MAX_MESSAGE_BYTES for c in chunks)
    assert join_chunks(list(reversed(chunks)), 10, "tok", 3) == ranges
    # The worst case: offsets far apart, every integer at its widest.
    wide = [(2**40 * (i + 1), 2**40 * (i + 1) + 2**39) for i in range(MAX_CHUNK_RANGES)]
    (chunk,) = progress_chunks("g", "t", 0, 0, "tok", wide, 1)
    assert len(chunk.to_bytes()) < MAX_MESSAGE_BYTES and join_chunks([chunk], 0, "tok", 1) == wide
    assert join_chunks(progress_chunks("g", "t", 0, 7, "tok", [], 1), 7, "tok", 1) == []


def test_chunks_join_only_when_they_are_all_the_commits():
    ranges = _alternating(10)
    chunks = progress_chunks("g", "t", 0, 10, "tok", ranges, 1, chunk_ranges=4)
    assert len(chunks) == 3
    with pytest.raises(SchemaError, match="chunk 1 of 3"):
        join_chunks([chunks[0], chunks[2]], 10, "tok", 3)
    with pytest.raises(SchemaError, match="missing"):
        join_chunks(chunks, 10, "another", 3)  # a commit that relies on another entry
    with pytest.raises(SchemaError, match="commit at 10"):
        join_chunks(chunks, 12, "tok", 3)  # the token's entry goes with another committed offset
    stale = progress_chunks("g", "t", 0, 10, "tok", _alternating(10, start=11), 1, chunk_ranges=4)
    with pytest.raises(SchemaError, match="starts at"):
        join_chunks([chunks[0], stale[1], chunks[2]], 10, "tok", 3)
