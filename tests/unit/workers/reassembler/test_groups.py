"""PromptGroups: the prompt-group bookkeeping of one receipts partition."""

from workers.reassembler.groups import Intake, PromptGroups

from .fixtures import receipt


def test_a_group_completes_when_every_rollout_index_arrived():
    groups = PromptGroups(0)
    assert groups.add(receipt("g", 0, size=2), 10, 1_000)[0] is Intake.ADDED
    outcome, group = groups.add(receipt("g", 1, size=2), 12, 1_100)
    assert outcome is Intake.COMPLETED
    assert (group.first_offset, group.last_offset, group.first_seen_ms) == (10, 12, 1_000)
    assert group.offsets == {0: 10, 1: 12}
    assert [r.rollout_index for r in group.by_index()] == [0, 1]


def test_the_raw_record_is_kept_so_a_failed_group_can_be_dead_lettered_intact():
    groups = PromptGroups(0)
    _, group = groups.add(receipt("g", 0), 3, 0, (b"key", b"bytes"))
    assert group.raw == {0: (b"key", b"bytes")}


def test_same_index_or_same_rollout_id_is_a_duplicate():
    groups = PromptGroups(0)
    groups.add(receipt("g", 0, size=3), 0, 0)
    assert groups.add(receipt("g", 0, size=3, rollout_id="other"), 1, 0)[0] is Intake.DUPLICATE
    assert groups.add(receipt("g", 1, size=3, rollout_id="g-r0"), 2, 0)[0] is Intake.DUPLICATE
    assert list(groups.open["g"].receipts) == [0]


def test_a_receipt_disagreeing_on_size_or_prompt_is_inconsistent():
    groups = PromptGroups(0)
    groups.add(receipt("g", 0, size=3, prompt_idx=5), 0, 0)
    assert groups.add(receipt("g", 1, size=4, prompt_idx=5), 1, 0)[0] is Intake.INCONSISTENT
    assert groups.add(receipt("g", 1, size=3, prompt_idx=6), 2, 0)[0] is Intake.INCONSISTENT
    assert list(groups.open["g"].receipts) == [0]


def test_a_closed_group_recognises_re_read_receipts_and_refuses_late_ones():
    groups = PromptGroups(0)
    groups.add(receipt("g", 0), 4, 0)
    groups.add(receipt("g", 1), 6, 0)
    groups.close("g")
    assert "g" not in groups.open
    assert groups.add(receipt("g", 0), 4, 0) == (Intake.REREAD_CLOSED, None)
    assert groups.add(receipt("g", 1), 6, 0) == (Intake.REREAD_CLOSED, None)
    assert groups.add(receipt("g", 1, rollout_id="again"), 7, 0) == (Intake.LATE, None)


def test_the_safe_offset_never_passes_the_first_receipt_of_an_open_group():
    groups = PromptGroups(0)
    groups.add(receipt("a", 0), 5, 0)
    groups.add(receipt("b", 0), 6, 0)
    groups.add(receipt("b", 1), 7, 0)
    assert groups.safe_offset(8) == 5
    groups.close("b")
    assert groups.safe_offset(8) == 5
    groups.add(receipt("a", 1), 8, 0)
    groups.close("a")
    assert groups.safe_offset(9) == 9


def test_groups_fall_due_by_their_first_receipt_time():
    groups = PromptGroups(0)
    groups.add(receipt("old", 0), 0, 1_000)
    groups.add(receipt("new", 0), 1, 5_000)
    assert [g.group_id for g in groups.due(5_999, 5_000)] == []
    assert [g.group_id for g in groups.due(6_000, 5_000)] == ["old"]
    assert [g.group_id for g in groups.due(10_000, 5_000)] == ["old", "new"]


def test_a_restored_open_group_keeps_its_first_seen_time_when_its_receipts_are_read_again():
    groups = PromptGroups(0)
    groups.restore_open("g", 1_000)
    _, group = groups.add(receipt("g", 0), 3, 50_000)
    assert group.first_seen_ms == 1_000
    assert [g.group_id for g in groups.due(6_000, 5_000)] == ["g"]


def test_only_a_dead_lettered_group_reopens():
    groups = PromptGroups(0)
    for gid, dead in (("dead", True), ("done", False)):
        groups.add(receipt(gid, 0), 0, 0)
        groups.close(gid, dead_lettered=dead)
    assert groups.reopen_dead_lettered("done") is False
    assert groups.add(receipt("done", 0, rollout_id="redo"), 9, 0)[0] is Intake.LATE
    assert groups.reopen_dead_lettered("dead") is True
    assert groups.add(receipt("dead", 0, rollout_id="redo"), 9, 0)[0] is Intake.ADDED
    assert groups.reopen_dead_lettered("dead") is False  # open again, nothing to reopen


def test_closed_groups_are_forgotten_oldest_first_beyond_the_capacity():
    groups = PromptGroups(0, closed_capacity=2)
    for i, gid in enumerate(("a", "b", "c")):
        groups.add(receipt(gid, 0), i, 100 + i)
        groups.close(gid, dead_lettered=True, closed_ms=150 + i)
    # Retention alone would keep them all: the capacity forgets the oldest.
    assert groups.forget(event_ms=200, retention_ms=10_000) == ["a"]
    assert list(groups.closed) == ["b", "c"]
    assert groups.dead_lettered == {"b", "c"}
    assert groups.horizon_ms == 150  # when "a" closed, not when it opened


def test_closed_groups_are_forgotten_once_closed_longer_ago_than_the_retention():
    groups = PromptGroups(0)
    for i, (gid, closed) in enumerate((("old", 1_000), ("new", 5_000))):
        groups.add(receipt(gid, 0), i, 900)
        groups.close(gid, closed_ms=closed)
    assert groups.forget(event_ms=5_999, retention_ms=5_000) == []
    assert groups.forget(event_ms=6_001, retention_ms=5_000) == ["old"]
    assert list(groups.closed) == ["new"] and groups.horizon_ms == 1_000


def test_any_receipt_of_a_forgotten_group_produced_before_it_closed_is_late():
    groups = PromptGroups(0, closed_capacity=1)
    groups.add(receipt("a", 0), 0, 1_000)
    groups.add(receipt("a", 1), 1, 1_010)  # its second receipt, 10 ms later
    groups.close("a", closed_ms=1_010)
    groups.add(receipt("b", 0), 2, 1_020)
    groups.close("b", closed_ms=1_020)
    groups.forget(event_ms=1_020, retention_ms=60_000)
    assert "a" not in groups.closed and groups.horizon_ms == 1_010
    # A retried publish of its second rollout, stamped as the original: late, not a second "a".
    assert groups.add(receipt("a", 1, rollout_id="retry"), 10, 1_010)[0] is Intake.LATE
    # A redriven straggler starts its deadline now, but its age is the original one.
    assert groups.add(receipt("a", 1), 11, 50_000, event_ms=999)[0] is Intake.LATE
    assert "a" not in groups.open
    assert groups.add(receipt("fresh", 0), 13, 1_011)[0] is Intake.ADDED


def test_a_redriven_dead_lettered_group_reopens_whatever_the_horizon():
    groups = PromptGroups(0)
    groups.add(receipt("d", 0), 0, 500)
    groups.close("d", dead_lettered=True, closed_ms=500)
    groups.raise_horizon(10_000)
    assert groups.reopen_dead_lettered("d")
    assert groups.add(receipt("d", 0), 5, 20_000, event_ms=500, reopened=True)[0] is Intake.ADDED


def test_a_group_open_before_a_restart_is_not_late_whatever_the_horizon():
    groups = PromptGroups(0)
    groups.horizon_ms = 10_000
    groups.restore_open("g", 500)
    outcome, group = groups.add(receipt("g", 0), 3, 600)
    assert outcome is Intake.ADDED and group.first_seen_ms == 500


def test_restore_from_is_the_oldest_needed_entry():
    groups = PromptGroups(0)
    assert groups.restore_from(40) == 40
    groups.add(receipt("c", 0), 0, 0)
    groups.close("c")
    groups.entries_written({"c": 12}, set())
    groups.entries_written({"c": 30}, set())  # its cleared entry: the closing one is where to read from
    assert groups.restore_from(40) == 12
    groups.add(receipt("o", 0), 1, 0)
    groups.entries_written({"o": 7}, {"o"})
    assert groups.restore_from(40) == 7
    groups.close("o")
    groups.forget(event_ms=10**9, retention_ms=1)
    assert groups.restore_from(40) == 40


def test_rereading_is_true_up_to_the_emitted_offset():
    groups = PromptGroups(0)
    assert not groups.rereading(0)
    groups.emitted_through = 7
    assert groups.rereading(7) and not groups.rereading(8)
