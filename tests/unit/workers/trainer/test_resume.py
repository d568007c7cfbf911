"""How `resume` accounts for the groups it reads from the cut (issue 30): pure parts, no broker."""

from __future__ import annotations

from schemas.finalized import FinalizedGroup
from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, GroupState
from streams.partitioner import partition_of
from workers.trainer.checkpoint import PartitionMark
from workers.trainer.resume import (
    ResumeReport,
    _account_states,
    _is_trained,
    _remembered,
    _sort_finalized,
)
from workers.trainer.resume_reads import FinalizedRead


def _closed(gid: str, finalized_at_ms: int, outcome: str = FINALIZED) -> GroupState:
    return GroupState(gid, CLOSED, 0, 0, 0, 1, outcome=outcome, finalized_at_ms=finalized_at_ms)


def _in(partition: int, parts: int, stem: str) -> str:
    return next(f"{stem}{i}" for i in range(1000) if partition_of(f"{stem}{i}".encode(), parts) == partition)


def test_a_finalized_group_whose_record_was_not_read_lies_before_where_its_partition_was_read_whatever_the_clocks():
    # Partition 0 read from its cut (offset 40), its first record written at t=1,000,000 ms by one worker.
    # A group's state entry and its record are committed in one transaction: read from the cut to a
    # stable end, a record not read lies before the cut (or expired, counted apart). Before, a state
    # entry whose finalized_at_ms (another worker's wall clock) ran more than 5 minutes past the first
    # record's timestamp was unaccounted for, and resume exited 1 with no way forward.
    read = FinalizedRead(begin={0: 40, 1: 0})
    early, skewed = _in(0, 2, "early"), _in(0, 2, "skewed")
    states = {
        early: _closed(early, 900_000),  # before the cut: trained, its record not read
        skewed: _closed(skewed, 1_000_000 + 3_600_000),  # a clock an hour ahead (or a batch delayed)
        "dead": _closed("dead", 5, outcome=DEAD_LETTERED),
    }
    report = ResumeReport()
    _account_states(report, states, first={}, remembered=set(), finalized=read, parts=[0, 1])
    assert report.unaccounted == [] and report.closed_without_record == 1


def test_a_finalized_group_of_a_partition_read_from_its_start_is_unaccounted_for_unless_its_record_was_read():
    read = FinalizedRead(begin={0: 0, 1: 0})
    gid, found, known = _in(1, 2, "g"), _in(1, 2, "found"), _in(1, 2, "known")
    states = {gid: _closed(gid, 1), found: _closed(found, 1), known: _closed(known, 1)}
    report = ResumeReport()
    _account_states(report, states, first={found: (1, 3, False)}, remembered={known}, finalized=read, parts=[0, 1])
    assert report.unaccounted == [gid]


def _group(gid: str, rows: int = 2) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=gid, prompt_idx=0, partition_id="rlstream.train", sample_ids=tuple(f"{gid}_g{i}" for i in range(rows)),
        tags=({},) * rows, group_min_wv=0, group_max_wv=0, canonical_output_tokens=0, valid_row_count=rows,
        total_row_count=rows, rejection_reasons=(None,) * rows, dropped=False, drop_reason=None, metrics={},
        source=None,
    )  # fmt: skip


def test_records_are_sorted_as_they_stream_by_and_only_the_unresolved_ones_are_kept():
    marks = {0: PartitionMark(10, [(12, 12)])}
    records = [(11, _group("new")), (12, _group("done")), (13, _group("dup")), (14, _group("new")), (9, _group("old"))]
    read = FinalizedRead()
    for offset, group in records:
        read.take(0, offset, group, _is_trained(marks, 0, offset))
    assert [u[0] for u in read.untrained] == ["new", "dup"] and read.records == 5
    report = ResumeReport()
    _sort_finalized(report, read, {"dup"}, store=None, spill=None, train="rlstream.train")
    # "done" and "old" resolved by the cut; "dup" remembered resolved by the checkpoint; "new" has no
    # spill: handed back by the trainer, its second record the trainer's own duplicate.
    assert (report.trained, report.hand_back_finalized, report.duplicates, report.restored) == (2, 1, 1, 0)


def test_a_duplicate_read_from_the_start_of_a_group_resolved_before_the_cut_names_its_original():
    marks = {0: PartitionMark(10, [])}
    read = FinalizedRead()
    for offset, gid in ((3, "a"), (4, "b"), (11, "a"), (12, "c"), (13, "c")):
        read.take(0, offset, _group(gid), _is_trained(marks, 0, offset))
    assert read.originals == [("a", 0, 3)] and read.resolved == 2  # "c" twice past the cut: the trainer's own
    report = ResumeReport()
    _sort_finalized(report, read, set(), store=None, spill=None, train="rlstream.train")
    assert report.resolved_originals == [("a", 0, 3)] and report.duplicates == 1 and report.hand_back_finalized == 1


def test_a_resolved_group_whose_record_the_cut_holds_back_is_not_remembered():
    """A hand-back unacknowledged at the cut: named in an old checkpoint's resolved file, its record is not
    resolved by the marks; resume must count it to be handed back, not as a duplicate of a resolved group."""
    marks = {0: PartitionMark(3, [(5, 5)])}
    groups = [("old", 0, 1), ("held", 0, 3), ("past", 0, 5), ("other", 1, 9), ("unwanted", 0, 0)]
    assert _remembered(groups, marks, {"old", "held", "past", "other"}) == {"old", "past", "other"}
