"""PartitionTask: one partition's intake, deadlines and commit cycle, with an in-memory KV store for TQ."""

import dataclasses

import msgspec
import pytest

from schemas import deadletter as dl
from schemas.regenerate import MAX_REGENERATIONS, STAGING_LOST
from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, HANDED_BACK, OPEN, GroupState, PartitionProgress
from streams.tq import STAGING, TRAIN
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.commit import StateWrites
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.finalize import GroupOutcome, finalize_groups
from workers.reassembler.groups import Intake
from workers.reassembler.restore import restore_partition
from workers.reassembler.task import PartitionTask
from workers.rollout.convert import failed_rollout
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

from .fixtures import closed, opened, receipt, record

TINY = SyntheticShape(group_size=2, calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))
CONFIG = ReassemblerConfig(prefix="t", worker_id="w0", input_topic="t.rollout.receipts")
TIMEOUT_MS = 30_000


def make_task(store, entries=(), config=CONFIG):
    return resumed(PartitionTask.resume(restore_partition(0, entries), store, config), store)


def resumed(task, store):
    """`task` once the worker cleared the staging its predecessor left, as its first step does."""
    store.clear(STAGING, task.restored_staging)
    task.restored_staging_cleared()
    return task


def staged(store, group_id):
    """A staged group of two rollouts; returns their receipts."""
    rollouts = make_group(group_id, 0, 1, shape=TINY)
    stage_rollouts(store, rollouts)
    return [r.receipt for r in rollouts]


def received(task, store, group_id):
    """A staged group's receipts taken in by `task` from offset 10 on; returns the group's staging keys."""
    receipts = staged(store, group_id)
    for offset, r in enumerate(receipts, start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    return [c.staging_key for r in receipts for c in r.manifest]


def step(task, store, now_ms=5_000, clock_ms=None, config=CONFIG):
    """Ready groups -> finalize into the store -> prepare, as the worker does for one partition."""
    ready = task.ready(now_ms if clock_ms is None else clock_ms, TIMEOUT_MS)
    outcomes = finalize_groups(store, ready, config.actor, receipts_topic=config.receipts_topic, now_ms=now_ms)
    return task.prepare(outcomes, now_ms)


def test_a_complete_group_commits_its_record_state_progress_and_offset_then_clears_staging():
    store = InMemoryStore()
    task = make_task(store)
    keys = received(task, store, "g")
    commit = step(task, store)
    assert [f.group_id for f in commit.finalized] == ["g"] and commit.dead_letters == ()
    # Opened and closed in one step: the closing entry alone (an OPEN one would be superseded at once).
    assert [(s.status, s.outcome) for s in commit.state] == [(CLOSED, FINALIZED)]
    assert set(commit.state[0].staging_keys) == set(keys) and not commit.state[0].staging_cleared
    assert commit.progress == PartitionProgress(partition=0, emitted_through=11, time_ms=5_000)
    assert commit.commit_offset == 12
    assert store.present(TRAIN, list(commit.finalized[0].sample_ids)) == set(commit.finalized[0].sample_ids)
    # Staging stays until the transaction committed: a crash before it re-finalizes from it.
    assert store.present(STAGING, keys) == set(keys)

    task.post_commit(commit)
    assert store.present(STAGING, keys) == set()
    assert task.has_work
    follow_up = task.prepare([], 6_000)
    assert [(s.group_id, s.status, s.staging_cleared) for s in follow_up.state] == [("g", CLOSED, True)]
    # Cleared: the entry no longer lists the keys, so compaction keeps a small record per group.
    assert follow_up.state[0].staging_keys == ()
    # No new receipt: progress stays where it was (written again with the state, for the restore
    # point); the offset is sent again unchanged, to fence a zombie.
    assert follow_up.progress.emitted_through == commit.progress.emitted_through
    assert follow_up.commit_offset == commit.commit_offset
    task.post_commit(follow_up)
    assert not task.has_work and task.prepare([], 7_000).empty


def test_the_commit_offset_stays_at_the_first_receipt_of_an_open_group():
    store = InMemoryStore()
    task = make_task(store)
    task.intake(record(3, receipt("open", 0).to_bytes()), 0)
    done = staged(store, "done")
    task.intake(record(4, done[0].to_bytes()), 0)
    task.intake(record(5, done[1].to_bytes()), 0)
    commit = step(task, store)
    assert [f.group_id for f in commit.finalized] == ["done"]
    assert commit.commit_offset == 3 and commit.progress.emitted_through == 5


def test_a_group_read_by_one_step_and_finalized_by_the_next_moves_the_commit_offset_past_it():
    # The pipelined step's overlapped poll takes a group's receipts after the step chose its groups: that
    # step commits with the group open (offset at its first receipt), and the next finalizes it with no
    # new receipt. Its commit must move the offset past the group; it re-sent the old offset, so the
    # partition's committed offset stayed at the group's first receipt for good (a successor re-read
    # everything since; past closed_retention_s those receipts would reopen their groups).
    store = InMemoryStore()
    task = make_task(store)
    received(task, store, "g")  # offsets 10 and 11: complete, but after this step's ready groups
    first = task.prepare([], 5_000)
    assert first.commit_offset == 10
    task.post_commit(first)
    second = step(task, store)
    assert [f.group_id for f in second.finalized] == ["g"]
    assert second.commit_offset == 12


def test_without_clear_staging_the_staged_tensors_stay_and_no_cleared_entry_follows():
    store = InMemoryStore()
    config = msgspec.structs.replace(CONFIG, clear_staging=False)
    task = make_task(store, config=config)
    receipts = staged(store, "g")
    for offset, r in enumerate(receipts):
        task.intake(record(offset, r.to_bytes()), 0)
    commit = step(task, store, config=config)
    assert commit.state[-1].staging_keys == () and commit.staging_to_clear == ()
    task.post_commit(commit)
    keys = [c.staging_key for r in receipts for c in r.manifest]
    assert store.present(STAGING, keys) == set(keys)
    assert task.prepare([], 0).state == ()


def test_bad_duplicate_and_late_receipts_become_dead_letters_of_their_kind():
    store = InMemoryStore()
    task = make_task(store, [closed("old", 0, 1)])
    task.intake(record(2, b"\x93\xff"), 0)
    task.intake(record(3, receipt("g", 0, size=3).to_bytes()), 0)
    task.intake(record(4, receipt("g", 0, size=3, rollout_id="again").to_bytes(), redriven=2), 0)
    task.intake(record(5, receipt("g", 1, size=4).to_bytes()), 0)
    task.intake(record(6, receipt("old", 0, rollout_id="late").to_bytes()), 0)
    letters = task.prepare([], 0).dead_letters
    assert [(d.source_offset, d.error_kind) for d in letters] == [
        (2, dl.DECODE_ERROR),
        (4, dl.DUPLICATE_RECEIPT),
        (5, dl.INCONSISTENT_GROUP),
        (6, dl.LATE_RECEIPT),
    ]
    assert letters[0].original == b"\x93\xff" and letters[0].source_key == b"k2"
    assert letters[1].redrive_count == 2 and letters[1].worker_id == "w0"


def test_a_failed_group_dead_letters_every_receipt_with_its_redrive_count_and_closes_dead_lettered():
    store = InMemoryStore()
    task = make_task(store)
    task.intake(record(7, receipt("g", 0).to_bytes(), redriven=1), 0)
    task.intake(record(8, receipt("g", 1).to_bytes()), 0)
    (group,) = task.ready(0, TIMEOUT_MS)
    outcome = GroupOutcome(group, None, dl.ALL_ROLLOUTS_FAILED, "no valid row", ("g-r0/c0", "g-r1/c0"))
    commit = task.prepare([outcome], 9)
    assert [(d.source_offset, d.error_kind, d.redrive_count) for d in commit.dead_letters] == [
        (7, dl.ALL_ROLLOUTS_FAILED, 1),
        (8, dl.ALL_ROLLOUTS_FAILED, 0),
    ]
    assert commit.dead_letters[0].original == receipt("g", 0).to_bytes()
    assert commit.finalized == () and commit.state[-1].outcome == DEAD_LETTERED
    assert "g" in task.groups.dead_lettered


def test_receipts_read_again_below_the_recorded_progress_emit_nothing_twice():
    store = InMemoryStore()
    entries = [opened("g", 3), PartitionProgress(partition=0, emitted_through=5, time_ms=0)]
    task = make_task(store, entries)
    task.intake(record(3, receipt("g", 0, size=3).to_bytes()), 0)
    task.intake(record(4, b"poison"), 0)
    task.intake(record(5, receipt("g", 0, size=3, rollout_id="dup").to_bytes()), 0)
    task.intake(record(6, b"poison"), 0)
    task.intake(record(7, receipt("h", 0, size=3).to_bytes()), 0)
    commit = task.prepare([], 0)
    assert [d.source_offset for d in commit.dead_letters] == [6]
    assert [(s.group_id, s.status) for s in commit.state] == [("h", OPEN)]
    assert commit.progress.emitted_through == 7 and commit.commit_offset == 3


def test_progress_never_goes_back_below_what_was_recorded():
    store = InMemoryStore()
    task = make_task(store, [opened("g", 50), PartitionProgress(partition=0, emitted_through=100, time_ms=0)])
    task.intake(record(50, receipt("g", 0).to_bytes()), 0)
    commit = task.prepare([], 0)
    assert commit.progress.emitted_through == 100 and commit.commit_offset == 50


def test_a_redriven_receipt_reopens_a_dead_lettered_group_and_its_open_entry_comes_last():
    store = InMemoryStore()
    task = make_task(store, [closed("g", 0, 1, outcome=DEAD_LETTERED, keys=("g/0",))])
    # The predecessor's uncleared keys are recorded as a cleared entry; the redriven receipt then
    # reopens the same group in this step, and compaction must keep the OPEN entry.
    task.intake(record(9, receipt("g", 0).to_bytes(), redriven=1), 0)
    commit = task.prepare([], 0)
    assert [(s.status, s.staging_cleared) for s in commit.state] == [(CLOSED, True), (OPEN, False)]
    assert commit.dead_letters == () and "g" in task.groups.open


def test_a_redriven_receipt_of_a_finalized_group_is_still_late():
    store = InMemoryStore()
    task = make_task(store, [closed("g", 0, 1)])
    task.intake(record(9, receipt("g", 0).to_bytes(), redriven=1), 0)
    commit = task.prepare([], 0)
    assert [d.error_kind for d in commit.dead_letters] == [dl.LATE_RECEIPT]
    assert commit.state == () and "g" not in task.groups.open


def test_a_predecessors_uncleared_staging_is_left_to_the_worker_and_recorded_once_cleared():
    store = InMemoryStore()
    receipts = staged(store, "g")
    keys = tuple(c.staging_key for r in receipts for c in r.manifest)
    task = PartitionTask.resume(restore_partition(0, [closed("g", 0, 1, keys=keys)]), store, CONFIG)
    # The restore writes nothing to TQ: it may follow an abort of a worker that is a zombie by now.
    assert store.present(STAGING, list(keys)) == set(keys)
    assert task.has_work and sorted(task.restored_staging) == sorted(keys)
    assert task.prepare([], 0).state == (), "not recorded cleared before it is"
    resumed(task, store)
    assert store.present(STAGING, list(keys)) == set()
    commit = task.prepare([], 0)
    assert [(s.group_id, s.staging_cleared, s.staging_keys) for s in commit.state] == [("g", True, ())]
    # Nothing was read yet: the committed offset and emitted progress stay where they are.
    assert commit.progress.emitted_through == -1 and commit.commit_offset is None


@pytest.mark.parametrize(
    "position,caught_up,paused,expected",
    [
        (None, True, False, 2_000),  # nothing read yet: the newest receipt seen (none -> its default)
        (50, False, False, 2_000),  # behind a backlog: event time
        (100, True, False, 9_000),  # read to the end: wall time
        (50, False, True, 9_000),  # paused: nothing new is read, wall time frees memory
    ],
)
def test_the_deadline_clock(position, caught_up, paused, expected):
    task = make_task(InMemoryStore())
    task.max_ts = 2_000
    task.position = position
    assert task.clock(9_000, caught_up=caught_up, paused=paused) == expected


def test_a_group_falls_due_by_the_clock_and_that_makes_the_partition_commit():
    store = InMemoryStore()
    task = make_task(store)
    task.intake(record(0, receipt("g", 0).to_bytes(), ts=1_000), 1_000)
    task.post_commit(task.prepare([], 1_000))
    assert not task.has_work
    assert task.ready(1_000 + TIMEOUT_MS - 1, TIMEOUT_MS) == []
    assert not task.has_work
    assert [g.group_id for g in task.ready(1_000 + TIMEOUT_MS, TIMEOUT_MS)] == ["g"]
    assert task.has_work


def test_a_step_that_only_writes_state_resends_the_committed_offset_so_a_zombie_is_fenced():
    # A predecessor's uncleared staging is recorded as cleared by the successor's first commit; that
    # transaction must carry an offset, or a worker already out of the group could still commit it.
    store = InMemoryStore()
    keys = ("g-r0/c0",)
    closed = GroupState(
        group_id="g", status=CLOSED, partition=0, first_offset=3, last_offset=4, first_seen_ms=1,
        outcome=FINALIZED, finalized_at_ms=2, staging_keys=keys,
    )  # fmt: skip
    task = resumed(PartitionTask.resume(restore_partition(0, [closed]), store, CONFIG, committed_offset=5), store)
    commit = task.prepare((), now_ms=10)
    assert commit.state and commit.progress.emitted_through == -1
    assert commit.commit_offset == 5
    untracked = resumed(PartitionTask.resume(restore_partition(0, [closed]), store, CONFIG), store)
    assert untracked.prepare((), now_ms=10).commit_offset is None


def test_receipts_keyed_elsewhere_are_dead_lettered_and_never_open_a_second_copy_of_their_group():
    store = InMemoryStore()
    task = make_task(store)
    task.intake(record(0, receipt("g", 0).to_bytes(), key=b"not-g"), 1_000)
    task.intake(record(1, receipt("g", 1).to_bytes(), key=b""), 1_000)
    commit = task.prepare([], 1_000)
    assert [d.error_kind for d in commit.dead_letters] == [dl.KEY_MISMATCH, dl.KEY_MISMATCH]
    assert "g" not in task.groups.open and commit.state == ()


def test_a_far_future_producer_timestamp_is_clamped_to_the_workers_clock():
    store = InMemoryStore()
    task = make_task(store)
    now = 1_000_000
    task.intake(record(0, receipt("late", 0).to_bytes(), ts=now - 10), now)
    # A receipt stamped a year ahead neither moves the partition's clock into the future (which
    # would cut "late" short) nor keeps its own group from ever falling due.
    task.intake(record(1, receipt("g", 0).to_bytes(), ts=now + 365 * 86_400_000), now)
    assert task.max_ts == now
    assert task.groups.open["g"].first_seen_ms == now
    assert [g.group_id for g in task.ready(now + TIMEOUT_MS, TIMEOUT_MS)] == ["late", "g"]


def test_a_negative_producer_timestamp_does_not_break_the_step():
    task = make_task(InMemoryStore())
    task.intake(record(0, receipt("g", 0).to_bytes(), ts=-5), 2_000)
    # A missing (negative) CreateTime counts as now, not as the epoch: its group is not due at once.
    assert task.max_ts == 2_000 and task.groups.open["g"].first_seen_ms == 2_000
    (entry,) = task.prepare([], 2_000).state  # a negative first_seen_ms would not validate here
    assert entry.first_seen_ms == 2_000


def test_a_near_megabyte_poison_receipt_becomes_a_dead_letter_that_fits_one_kafka_message():
    task = make_task(InMemoryStore())
    poison = b"\xc1" * 999_800  # 0xc1 is never valid MessagePack
    task.intake(record(0, poison, key=b"junk"), 1_000)
    (letter,) = task.prepare([], 1_000).dead_letters
    assert letter.error_kind == dl.DECODE_ERROR and letter.original_truncated
    assert letter.original_size == len(poison) and poison.startswith(letter.original)
    # librdkafka's default message.max.bytes is 1,000,000: the whole record copied would not fit.
    assert len(letter.to_bytes()) < 600_000


def test_a_restored_first_seen_time_from_a_clock_running_ahead_is_brought_back_to_now():
    import time

    future = int(time.time() * 1000) + 365 * 86_400_000
    task = make_task(InMemoryStore(), [opened("g", 0, first_seen_ms=future)])
    assert task.groups.restored_open_ms["g"] <= int(time.time() * 1000)


def test_a_huge_record_key_is_cut_in_its_dead_letter():
    task = make_task(InMemoryStore())
    task.intake(record(0, b"\xc1junk", key=b"k" * 600_000), 1_000)
    (letter,) = task.prepare([], 1_000).dead_letters
    assert len(letter.source_key) == dl.MAX_KEY_BYTES and len(letter.to_bytes()) < 600_000


def test_forgotten_groups_are_tombstoned_after_their_entries_and_the_progress_carries_horizon_and_restore_point():
    store = InMemoryStore()
    config = msgspec.structs.replace(CONFIG, max_closed_groups=1)
    task = PartitionTask.resume(restore_partition(0, [], closed_capacity=1), store, config, state_end=100)
    for offset, gid in enumerate(("a", "b")):
        for r in staged(store, gid):
            task.intake(record(offset * 10 + r.rollout_index, r.to_bytes(), ts=1_000 + offset), 5_000)
    first = step(task, store)
    assert first.forgotten == () and first.progress.restore_from == 100
    task.post_commit(first, StateWrites({"a": 101, "b": 102}, end_offset=104))
    second = task.prepare([], 6_000)
    # Over the capacity: "a" is forgotten; "b"'s closing entry is now the oldest a restore needs.
    assert second.forgotten == ("a",)
    assert [s.group_id for s in second.state] == ["a", "b"]  # their cleared entries, before the tombstone
    # The horizon is when "a" closed: the newest receipt timestamp read by then (b's, 1_001).
    assert first.state[0].closed_event_ms == 1_001
    assert second.progress.horizon_ms == 1_001 and second.progress.restore_from == 102
    assert task.groups.add(receipt("a", 0), 50, 999)[0] is Intake.LATE


def test_a_receipt_carrying_another_groups_staging_neither_takes_nor_clears_its_rows():
    store = InMemoryStore()
    task = make_task(store)
    a = staged(store, "A")
    # Group B (size 1) claims A's first rollout: same rollout id and keys, so the receipt is well formed.
    hijack = msgspec.structs.replace(a[0], group_id="B", group_size=1, rollout_index=0)
    task.intake(record(0, hijack.to_bytes()), 5_000)
    first = step(task, store)
    assert first.finalized == ()  # its only row is not B's: no valid row, dead-lettered
    task.post_commit(first)
    a_keys = [c.staging_key for r in a for c in r.manifest]
    assert store.present(STAGING, a_keys) == set(a_keys)
    for offset, r in enumerate(a, start=1):
        task.intake(record(offset, r.to_bytes()), 5_000)
    second = step(task, store)
    assert [(f.group_id, f.valid_row_count) for f in second.finalized] == [("A", 2)]


def test_a_late_receipts_staged_rows_are_cleared_after_its_dead_letter_commits():
    store = InMemoryStore()
    task = make_task(store)
    receipts = staged(store, "g")
    task.intake(record(0, receipts[0].to_bytes(), ts=1_000), 1_000)
    timed_out = step(task, store, now_ms=1_000 + TIMEOUT_MS)
    assert [f.valid_row_count for f in timed_out.finalized] == [1]
    task.post_commit(timed_out)
    late_keys = [c.staging_key for c in receipts[1].manifest]
    task.intake(record(1, receipts[1].to_bytes()), 40_000)
    commit = step(task, store, now_ms=40_000)
    assert [d.error_kind for d in commit.dead_letters] == [dl.LATE_RECEIPT]
    # Only after the commit: a crash before it re-reads the receipt and refuses it again.
    assert store.present(STAGING, late_keys) == set(late_keys)
    task.post_commit(commit)
    assert store.present(STAGING, late_keys) == set()


def test_a_duplicate_of_an_accepted_receipt_leaves_the_rows_its_group_uses():
    store = InMemoryStore()
    task = make_task(store)
    receipts = staged(store, "g")
    task.intake(record(0, receipts[0].to_bytes()), 5_000)
    task.intake(record(1, receipts[0].to_bytes()), 5_000)
    commit = step(task, store)
    assert [d.error_kind for d in commit.dead_letters] == [dl.DUPLICATE_RECEIPT]
    task.post_commit(commit)
    keys = [c.staging_key for c in receipts[0].manifest]
    assert store.present(STAGING, keys) == set(keys)


def test_a_hijacking_receipt_in_the_same_step_as_its_victim_takes_none_of_its_rows():
    store = InMemoryStore()
    task = make_task(store)
    a = staged(store, "A")
    hijack = msgspec.structs.replace(a[0], group_id="B", group_size=1, rollout_index=0)
    for offset, r in enumerate([hijack, *a]):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert [(f.group_id, f.valid_row_count) for f in commit.finalized] == [("A", 2)]
    (b_closed,) = [e for e in commit.state if e.group_id == "B"]
    assert b_closed.staging_keys == ()  # nothing of A's is cleared on B's account


def test_a_routed_experts_width_that_changes_between_calls_dead_letters_the_group_not_the_worker():
    store = InMemoryStore()
    shape = dataclasses.replace(TINY, calls=(2, 2), routed_experts_k=4)
    rollouts = make_group("E", 0, 1, shape=shape)
    second = rollouts[0].segments[1]
    second["routed_experts"] = second["routed_experts"][:, :2].contiguous()  # width 2 after width 4
    stage_rollouts(store, rollouts)
    actor = msgspec.structs.replace(CONFIG.actor, router_replay_enabled=True)
    config = msgspec.structs.replace(CONFIG, actor=actor)
    task = make_task(store, config=config)
    for offset, r in enumerate(rollouts):
        task.intake(record(offset, r.receipt.to_bytes()), 5_000)
    commit = step(task, store, config=config)
    assert commit.finalized == ()
    assert [d.error_kind for d in commit.dead_letters] == [dl.INCONSISTENT_GROUP] * 2
    assert "routed" in commit.dead_letters[0].message or "size" in commit.dead_letters[0].message


def test_a_redriven_receipt_without_its_original_time_is_late_for_a_group_behind_the_horizon():
    store = InMemoryStore()
    progress = PartitionProgress(partition=0, emitted_through=-1, time_ms=0, horizon_ms=50_000)
    task = make_task(store, [progress])
    # A letter written before dead letters recorded the source time: its group may be a forgotten one.
    task.intake(record(3, receipt("old", 0).to_bytes(), ts=90_000, redriven=1), 90_000)
    commit = step(task, store, now_ms=90_000)
    assert [d.error_kind for d in commit.dead_letters] == [dl.LATE_RECEIPT]
    assert "old" not in task.groups.open


def test_a_paused_worker_behind_a_backlog_does_not_age_closed_groups_by_wall_time():
    store = InMemoryStore()
    config = msgspec.structs.replace(CONFIG, closed_retention_s=60.0)
    task = make_task(store, config=config)
    receipts = staged(store, "g")
    for offset, r in enumerate(receipts):
        task.intake(record(offset, r.to_bytes(), ts=1_000), 10_000_000)  # read an hour and more late
    commit = step(task, store, now_ms=10_000_000, clock_ms=task.clock(10_000_000, caught_up=False, paused=True))
    task.post_commit(commit)
    assert task.prepare([], 10_000_000).forgotten == ()
    assert task.groups.horizon_ms is None


def test_groups_a_restore_forgets_for_capacity_are_tombstoned_by_the_first_commit():
    # Three closed groups in the changelog, room for two: the oldest is forgotten while restoring,
    # and its entry must not stand in the compacted state topic for ever.
    config = msgspec.structs.replace(CONFIG, max_closed_groups=2)
    entries = [closed("a", 0, 1), closed("b", 2, 3), closed("c", 4, 5)]
    task = PartitionTask.resume(restore_partition(0, entries, closed_capacity=2), InMemoryStore(), config)
    assert task.has_work
    commit = task.prepare([], 5_000)
    assert commit.forgotten == ("a",) and not commit.empty
    assert task.prepare([], 5_000).forgotten == (), "tombstoned once"


def test_a_receipt_read_again_after_a_restart_never_reopens_a_forgotten_group_whatever_its_clock_says():
    # The group closed and was forgotten before the restart (horizon 5_000); its receipt at offset 3
    # was read then, but the partition's offset was held back below it by another open group.
    # Its producer's clock ran ahead: first read at 5_000 it was clamped to 5_000, now it clamps to
    # 9_000, past the horizon. Judged by its offset, it was read before: late, never a new group.
    progress = PartitionProgress(partition=0, emitted_through=10, time_ms=0, horizon_ms=5_000)
    store = InMemoryStore()
    task = make_task(store, [opened("held", 1), progress])
    task.intake(record(3, receipt("gone", 0).to_bytes(), ts=20_000), 9_000)
    commit = step(task, store, now_ms=9_000)
    assert "gone" not in task.groups.open
    assert commit.finalized == () and commit.dead_letters == ()  # reread: its letter was written before
    assert ("gone-r0/c0", "gone", "gone-r0") in commit.refused_staging


def test_a_group_whose_staging_rows_are_all_gone_is_handed_back_with_its_offsets_not_dead_lettered():
    # A whole-job restart: the receipts are in Kafka, TQ came back empty.
    store = InMemoryStore()
    task = make_task(store)
    keys = received(task, store, "g")
    store.clear(STAGING, keys)
    commit = step(task, store)
    assert commit.finalized == () and commit.dead_letters == ()
    (regen,) = commit.regenerate
    assert (regen.group_id, regen.new_group_id, regen.group_size, regen.reason) == ("g", "g~r1", 2, STAGING_LOST)
    assert regen.source == "t.rollout.receipts[0]@10-11"
    # Closed in the same transaction as the offset past its receipts: never handed back twice.
    assert commit.state[-1].outcome == HANDED_BACK and commit.commit_offset == 12
    assert "g" not in task.groups.dead_lettered


def _with_failed_sibling(store, group_id, *, staged_rows=False):
    """A staged group of two whose rollout 1 failed: its receipt names nothing, or (`staged_rows`) the rows it
    staged before failing; returns the receipts."""
    ok, failed = staged(store, group_id)
    return [
        ok,
        msgspec.structs.replace(failed, failure_reason="env_crashed", manifest=failed.manifest if staged_rows else ()),
    ]


def test_a_group_with_a_failed_rollout_whose_other_rows_are_all_gone_is_handed_back_not_dead_lettered():
    # After a whole-job restart: one rollout failed, the other's staging went with TQ. Dead-lettering it
    # as inconsistent would leave its prompt untrained for good.
    store = InMemoryStore()
    task = make_task(store)
    receipts = _with_failed_sibling(store, "g")
    store.clear(STAGING, [c.staging_key for c in receipts[0].manifest])
    for offset, r in enumerate(receipts, start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert commit.finalized == () and commit.dead_letters == ()
    (regen,) = commit.regenerate
    assert (regen.group_id, regen.new_group_id, regen.reason) == ("g", "g~r1", STAGING_LOST)
    assert commit.state[-1].outcome == HANDED_BACK


def test_a_failed_rollouts_own_staged_rows_do_not_keep_its_group_from_being_handed_back():
    # "Gone" is judged on the rollouts whose rows are missing: the failed one's rows (restored from a
    # spill, say) are not a sign that the group's staging survived.
    store = InMemoryStore()
    task = make_task(store)
    ok, failed = _with_failed_sibling(store, "g", staged_rows=True)
    store.clear(STAGING, [c.staging_key for c in ok.manifest])
    assert store.present(STAGING, [c.staging_key for c in failed.manifest])
    for offset, r in enumerate([ok, failed], start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert [r.group_id for r in commit.regenerate] == ["g"] and commit.dead_letters == ()


def test_a_timed_out_group_whose_received_rollouts_lost_their_rows_is_handed_back():
    # Open when the job died: one receipt committed, the other never published; its rows went with TQ.
    store = InMemoryStore()
    task = make_task(store)
    first = staged(store, "g")[0]
    store.clear(STAGING, [c.staging_key for c in first.manifest])
    task.intake(record(10, first.to_bytes()), 5_000)
    commit = step(task, store, now_ms=5_000 + TIMEOUT_MS + 1)
    assert [r.group_id for r in commit.regenerate] == ["g"] and commit.dead_letters == ()


def test_a_group_every_rollout_of_which_failed_is_still_dead_lettered_not_handed_back():
    store = InMemoryStore()
    task = make_task(store)
    ok, failed = _with_failed_sibling(store, "g")
    store.clear(STAGING, [c.staging_key for c in ok.manifest])
    both = [msgspec.structs.replace(ok, failure_reason="env_crashed", manifest=()), failed]
    for offset, r in enumerate(both, start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert commit.regenerate == ()
    assert {d.error_kind for d in commit.dead_letters} == {dl.ALL_ROLLOUTS_FAILED}


def test_a_group_with_a_failed_rollout_naming_another_groups_rows_is_dead_lettered_not_handed_back():
    # Hostile input as before: the rows exist, staged by "a"; a failed sibling changes nothing.
    store = InMemoryStore()
    task = make_task(store)
    ok = msgspec.structs.replace(staged(store, "a")[0], group_id="b")
    failed = receipt("b", 1)
    failed = msgspec.structs.replace(failed, failure_reason="env_crashed", manifest=())
    for offset, r in enumerate([ok, failed], start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert commit.regenerate == () and commit.dead_letters


def test_a_partial_group_whose_surviving_rollouts_are_in_tq_is_completed_not_handed_back():
    store = InMemoryStore()
    task = make_task(store)
    keys = received(task, store, "g")
    store.clear(STAGING, keys[:1])  # the first rollout's first call lost, the second rollout survived
    commit = step(task, store)
    assert [f.group_id for f in commit.finalized] == ["g"] and commit.regenerate == ()
    assert commit.finalized[0].valid_row_count == 1


def test_a_group_whose_staged_rows_exist_but_belong_to_another_group_is_dead_lettered_not_handed_back():
    # Hostile input: the keys are in TQ, staged by group "a"; "b" claims them. TQ was not lost.
    store = InMemoryStore()
    task = make_task(store)
    a = staged(store, "a")
    hijack = [msgspec.structs.replace(r, group_id="b") for r in a]
    for offset, r in enumerate(hijack, start=10):
        task.intake(record(offset, r.to_bytes()), 5_000)
    commit = step(task, store)
    assert commit.regenerate == ()
    assert [d.source_key for d in commit.dead_letters] == [b"b", b"b"]


def test_a_group_regenerated_too_often_is_dead_lettered_instead_of_handed_back_again():
    # A publisher whose receipts name rows it never staged must not loop through regeneration forever.
    store = InMemoryStore()
    task = make_task(store)
    late = f"g~r{MAX_REGENERATIONS}"
    keys = received(task, store, late)
    store.clear(STAGING, keys)
    commit = step(task, store)
    assert commit.regenerate == ()
    assert {d.source_key for d in commit.dead_letters} == {late.encode()}
    assert commit.state[-1].outcome == DEAD_LETTERED


def test_a_group_whose_lost_staging_a_spill_put_back_in_part_is_handed_back_not_dead_lettered():
    # After a whole-job restart the spill had caught one call of a multi-call rollout (staged before the
    # spill listed staging, the rest after): the group's own key present was taken for its staging
    # having survived, and the group was dead-lettered inconsistent, its prompt never trained.
    store = InMemoryStore()
    task = make_task(store)
    shape = dataclasses.replace(TINY, calls=(3, 3))
    rollouts = make_group("g", 0, 1, shape=shape)
    stage_rollouts(store, rollouts)
    keys = [c.staging_key for r in rollouts for c in r.receipt.manifest]
    store.clear(STAGING, keys[1:])
    assert store.present(STAGING, keys) == {keys[0]}
    for offset, r in enumerate(rollouts, start=10):
        task.intake(record(offset, r.receipt.to_bytes()), 5_000)
    commit = step(task, store)
    assert [r.group_id for r in commit.regenerate] == ["g"] and commit.dead_letters == ()
    assert commit.state[-1].outcome == HANDED_BACK


def test_a_group_closed_at_its_timeout_with_no_valid_row_is_dead_lettered_as_timed_out_not_inconsistent():
    """Explorer seed 91: the rollout worker stalled past group_timeout_s between the receipt of a failed
    rollout and that of its good sibling. The group closed with nothing to train; its letter says so,
    rather than calling a slow, well-formed group inconsistent (hostile) input."""
    store = InMemoryStore()
    task = make_task(store)
    rollouts = make_group("g", 0, 1, shape=TINY)
    first = failed_rollout(
        rollout_id=rollouts[0].receipt.rollout_id, group_id="g", prompt_idx=0, rollout_index=0, group_size=2,
        environment="synthetic", failure_reason="env_crashed",
    )  # fmt: skip
    task.intake(record(10, first.receipt.to_bytes(), ts=1_000), 1_000)
    commit = step(task, store, now_ms=1_000 + TIMEOUT_MS, clock_ms=1_000 + TIMEOUT_MS)
    assert [d.error_kind for d in commit.dead_letters] == [dl.GROUP_TIMEOUT]
    assert "timeout" in commit.dead_letters[0].message
    assert commit.finalized == () and commit.state[-1].outcome == DEAD_LETTERED
