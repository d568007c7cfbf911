"""The trainer's per-partition position (`PartitionPosition`): commit offsets never pass an unresolved record,
and the commit metadata names the resolved records past it so a restart knows them."""

import pytest

from workers.trainer.position import METADATA_PREFIX, PartitionPosition, decode_ranges, encode_ranges, runs


def test_ranges_round_trip_relative_to_the_committed_offset():
    ranges = [(12, 12), (14, 50), (1000, 1000)]
    metadata, truncated = encode_ranges(10, ranges)
    assert metadata.startswith(METADATA_PREFIX) and not truncated
    assert decode_ranges(10, metadata) == ranges
    assert decode_ranges(10, METADATA_PREFIX) == []


def test_metadata_of_another_writer_or_none_names_nothing_and_malformed_metadata_is_refused():
    assert decode_ranges(5, None) == [] and decode_ranges(5, "someone else's") == []
    with pytest.raises(ValueError, match="gap.length"):
        decode_ranges(5, METADATA_PREFIX + "zz")
    with pytest.raises(ValueError, match="overlaps"):
        decode_ranges(5, METADATA_PREFIX + "0.1,0.1")  # the second range starts where the first ended
    assert decode_ranges(5, METADATA_PREFIX + "0.1") == [(5, 6)]  # the first may start at the offset itself


def test_too_many_ranges_are_cut_and_say_so():
    ranges = [(2 * i + 1, 2 * i + 1) for i in range(1, 2000)]
    metadata, truncated = encode_ranges(0, ranges, limit=200)
    assert truncated and len(metadata) <= 200
    kept = decode_ranges(0, metadata)
    assert kept == ranges[: len(kept)] and kept


def test_runs_break_only_at_unresolved_records():
    # 3 and 4 are a transaction marker and an aborted record: never read, so runs go across them.
    assert runs([1, 2, 5, 8, 9], [6]) == [(1, 5), (8, 9)]
    assert runs([], [1, 2]) == [] and runs([4], []) == [(4, 4)]


def test_the_commit_stays_at_the_first_unresolved_record_and_names_what_is_resolved_past_it():
    position = PartitionPosition()
    assert position.commit_point([]) is None
    for offset in (0, 1, 2, 4, 5):  # 3 is a commit marker
        assert not position.read(offset)
    for offset in (0, 2, 5):
        position.resolve(offset)
    assert position.commit_point([1, 4]) == (1, [(2, 2), (5, 5)])
    position.resolve(1)
    position.resolve(4)
    assert position.commit_point([]) == (6, [])


def test_a_successor_knows_what_its_predecessor_resolved_and_carries_it_on():
    first = PartitionPosition()
    for offset in range(10, 20):
        first.read(offset)
    for offset in (11, 12, 15, 16, 17, 18, 19):
        first.resolve(offset)
    offset, ranges = first.commit_point([10, 13, 14])
    second = PartitionPosition.from_commit(offset, ranges)
    assert [second.read(o) for o in (10, 11, 12, 13)] == [False, True, True, False]
    # Not yet read again: 15..19 stay named in the successor's own commits.
    second.resolve(10)
    assert second.commit_point([13]) == (13, [(15, 19)])
    assert PartitionPosition.from_commit(-1001).commit_point([]) is None


def test_a_successor_whose_poll_ends_inside_a_prior_range_writes_metadata_the_next_restart_reads():
    first = PartitionPosition()
    for offset in range(100, 110):
        first.read(offset)
    for offset in range(105, 110):
        first.resolve(offset)
    offset, ranges = first.commit_point(list(range(100, 105)))
    metadata, _ = encode_ranges(offset, ranges)
    assert (offset, decode_ranges(offset, metadata)) == (100, [(105, 109)])
    second = PartitionPosition.from_commit(offset, decode_ranges(offset, metadata))
    for o in range(100, 107):  # its first poll ends at 106, inside the predecessor's range
        second.read(o)
        second.resolve(o)
    offset2, ranges2 = second.commit_point([])
    assert offset2 == 107
    # The rest of the range starts at the committed offset itself: still readable after a restart.
    metadata2, _ = encode_ranges(offset2, ranges2)
    assert decode_ranges(offset2, metadata2) == [(107, 109)]
    third = PartitionPosition.from_commit(offset2, decode_ranges(offset2, metadata2))
    assert [third.read(o) for o in (107, 108, 109, 110)] == [True, True, True, False]
