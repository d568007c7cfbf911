"""The spill's messages: round trips, and a chunk whose rows and offsets disagree is refused with its field path."""

import pytest

from schemas.errors import SchemaError
from schemas.spill import MAX_SPILL_MESSAGE_BYTES, SpillChunk, SpillEnd, SpillHeader

CHUNK = dict(partition="p", keys=("a", "b"), tags=({"group_id": "g"}, {}), offsets=(0, 8, 24), data=bytes(24))


def test_round_trips():
    for msg in (
        SpillHeader(binding="run-1@7", partitions=("rlstream.train",), created_ms=5),
        SpillChunk(**CHUNK),
        SpillEnd(chunks=1, rows=2),
    ):
        assert type(msg).from_bytes(msg.to_bytes(), max_bytes=MAX_SPILL_MESSAGE_BYTES) == msg


@pytest.mark.parametrize(
    "change,path",
    [
        ({"tags": ({},)}, "spill_chunk.tags"),
        ({"offsets": (0, 24)}, "spill_chunk.offsets"),
        ({"offsets": (0, 8, 23)}, "spill_chunk.offsets"),
        ({"offsets": (0, 30, 24)}, "spill_chunk.offsets[2]"),
        ({"keys": ("a", "")}, "spill_chunk.keys[1]"),
        ({"partition": ""}, "spill_chunk.partition"),
    ],
)
def test_a_chunk_that_does_not_add_up_is_refused_naming_the_field(change, path):
    with pytest.raises(SchemaError) as err:
        SpillChunk(**{**CHUNK, **change})
    assert err.value.path.startswith(path)


def test_a_header_needs_its_binding():
    with pytest.raises(SchemaError) as err:
        SpillHeader(binding="", partitions=(), created_ms=0)
    assert err.value.path == "spill_header.binding"
