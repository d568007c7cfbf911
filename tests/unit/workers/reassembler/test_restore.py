"""restore_partition: a partition's prompt-group bookkeeping rebuilt from its state changelog, in log order."""

from schemas.state import DEAD_LETTERED, OPEN, GroupState, PartitionProgress
from workers.reassembler.groups import Intake
from workers.reassembler.restore import LEGACY_PROGRESS_ID, LogEntry, restore_partition

from .fixtures import closed, opened, receipt


def test_the_latest_entry_of_a_group_wins():
    restored = restore_partition(0, [opened("g", 4), closed("g", 4, 6)])
    groups = restored.groups
    assert {gid: c.last_offset for gid, c in groups.closed.items()} == {"g": 6}
    assert groups.restored_open_ms == {}
    assert groups.add(receipt("g", 0), 4, 0)[0] is Intake.REREAD_CLOSED
    assert groups.add(receipt("g", 0, rollout_id="late"), 7, 0)[0] is Intake.LATE


def test_an_open_group_keeps_its_first_seen_time_for_its_deadline():
    groups = restore_partition(0, [opened("g", 4, first_seen_ms=1_234)]).groups
    _, group = groups.add(receipt("g", 0), 4, 99_999)
    assert group.first_seen_ms == 1_234


def test_closed_entries_with_uncleared_staging_are_pending_in_log_order():
    restored = restore_partition(
        0,
        [
            closed("b", 0, 1, keys=("b/0",)),
            closed("a", 2, 3, keys=("a/0", "a/1")),
            closed("none", 4, 5),
            closed("done", 6, 7, keys=("d/0",)),
            closed("done", 6, 7, keys=("d/0",), cleared=True),
        ],
    )
    assert [(e.group_id, e.staging_keys) for e in restored.staging_to_clear] == [("b", ("b/0",)), ("a", ("a/0", "a/1"))]


def test_a_later_closed_entry_without_keys_settles_its_staging_to_clear():
    # What a worker of the previous version wrote once it had cleared the keys.
    legacy_cleared = closed("g", 0, 1)
    assert restore_partition(0, [closed("g", 0, 1, keys=("k",)), legacy_cleared]).staging_to_clear == ()


def test_open_after_closed_reopens_a_redriven_dead_lettered_group_and_drops_its_staging_to_clear():
    restored = restore_partition(
        0,
        [closed("g", 0, 1, outcome=DEAD_LETTERED, keys=("g/0",)), opened("g", 9, first_seen_ms=5_000)],
    )
    assert restored.staging_to_clear == ()
    assert "g" not in restored.groups.closed and "g" not in restored.groups.dead_lettered
    outcome, group = restored.groups.add(receipt("g", 0), 9, 0)
    assert outcome is Intake.ADDED and group.first_seen_ms == 5_000


def test_a_dead_lettered_group_stays_reopenable_but_a_finalized_one_does_not():
    restored = restore_partition(0, [closed("dead", 0, 0, outcome=DEAD_LETTERED), closed("done", 1, 1)])
    assert restored.groups.dead_lettered == {"dead"}
    assert restored.groups.reopen_dead_lettered("dead")
    assert not restored.groups.reopen_dead_lettered("done")


def test_progress_is_the_highest_recorded_whatever_the_order():
    entries = [PartitionProgress(partition=0, emitted_through=n, time_ms=0) for n in (5, 40, 12)]
    assert restore_partition(0, entries).groups.emitted_through == 40
    assert restore_partition(0, []).groups.emitted_through == -1


def test_progress_is_not_a_prompt_group():
    groups = restore_partition(0, [PartitionProgress(partition=0, emitted_through=3, time_ms=0)]).groups
    assert groups.restored_open_ms == {} and not groups.closed


def test_a_progress_entry_of_the_previous_version_still_counts():
    legacy = GroupState(LEGACY_PROGRESS_ID, OPEN, 0, 0, 17, 0)
    groups = restore_partition(0, [legacy]).groups
    assert groups.emitted_through == 17
    assert LEGACY_PROGRESS_ID not in groups.restored_open_ms


def test_a_tombstone_forgets_a_closed_group_and_its_staging_to_clear():
    entries = [
        LogEntry(0, b"g", closed("g", 0, 1, keys=("g/0",))),
        LogEntry(1, b"h", closed("h", 2, 3)),
        LogEntry(2, b"g", None),
    ]
    restored = restore_partition(0, entries)
    assert list(restored.groups.closed) == ["h"]
    assert restored.staging_to_clear == ()


def test_the_horizon_is_the_highest_recorded_and_makes_unknown_old_receipts_late():
    progress = [
        LogEntry(i, b"p", PartitionProgress(partition=0, emitted_through=1, time_ms=0, horizon_ms=h))
        for i, h in enumerate((5_000, 9_000, 7_000))
    ]
    groups = restore_partition(0, progress).groups
    assert groups.horizon_ms == 9_000
    assert groups.add(receipt("gone", 0), 5, 9_000)[0] is Intake.LATE
    assert groups.add(receipt("new", 0), 6, 9_001)[0] is Intake.ADDED


def test_restored_entries_keep_their_offsets_for_the_next_restore_point():
    entries = [
        LogEntry(10, b"a", closed("a", 0, 1)),
        LogEntry(11, b"b", closed("b", 2, 3, keys=("b/0",))),
        LogEntry(14, b"b", closed("b", 2, 3, keys=("b/0",), cleared=True)),
        LogEntry(15, b"o", opened("o", 4)),
    ]
    groups = restore_partition(0, entries).groups
    assert groups.restore_from(20) == 10
    groups.forget(event_ms=0, retention_ms=1)  # nothing is old yet
    groups.closed.popitem(last=False)  # were "a" forgotten, "b"'s closing entry is the oldest needed
    assert groups.restore_from(20) == 11
