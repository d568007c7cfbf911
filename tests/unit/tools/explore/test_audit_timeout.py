"""When the audit counts a `group_timeout` letter as earned: every rollout the group closed without
landed `group_timeout_s` or more after its first receipt (the receipts log says so, not the harness)."""

from __future__ import annotations

from tests.tools.explore.audit import GROUP_TIMEOUT_MS, Seen


def seen(landed: dict[int, int], had: set[int]) -> Seen:
    return Seen(landed={"g": landed}, timed_out_with={"g": had})


def test_a_group_whose_missing_rollouts_all_landed_late_earned_its_timeout():
    assert seen({0: 0, 1: GROUP_TIMEOUT_MS + 500}, {0}).late("g", 2)


def test_an_in_time_receipt_the_group_closed_without_is_no_excuse_beside_a_late_one():
    # Rollout 1 landed at once but the group closed with rollout 0 alone: that receipt was lost.
    assert not seen({0: 0, 1: 10, 2: GROUP_TIMEOUT_MS * 2}, {0}).late("g", 3)


def test_a_receipt_that_never_landed_is_no_excuse():
    assert not seen({0: 0}, {0}).late("g", 2)


def test_a_group_that_had_every_rollout_did_not_time_out():
    assert not seen({0: 0, 1: GROUP_TIMEOUT_MS * 2}, {0, 1}).late("g", 2)
