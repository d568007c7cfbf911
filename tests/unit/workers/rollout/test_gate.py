"""The admission gate's arithmetic: AReaL's staleness capacity, the counters, and waiting for capacity."""

import threading
import time

import pytest

from schemas.errors import InvalidArgument
from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, HANDED_BACK, OPEN, GroupState
from workers.rollout.gate import StalenessBudget, TrainerLosses, lost_group, staleness_capacity


def cap(**kw):
    args = dict(version=0, max_staleness=2, batch_groups=8, accepted=0, running=0, max_concurrent=1000)
    args.update(kw)
    return staleness_capacity(**args)


def test_capacity_is_eta_plus_version_plus_one_batches_minus_accepted_and_running():
    assert cap() == 24  # (2 + 0 + 1) * 8
    assert cap(version=1) == 32
    assert cap(version=1, accepted=20, running=5) == 7
    assert cap(max_staleness=0, accepted=8) == 0
    # Over the budget (the trainer restarted lower, or a worker overshot) is negative, not clamped.
    assert cap(accepted=30) == -6


def test_concurrency_limits_capacity_too():
    assert cap(max_concurrent=4, running=1) == 3
    assert cap(version=10, max_concurrent=4, running=4) == 0


def test_a_share_of_the_batch_scales_the_staleness_term():
    assert cap(batch_groups=8 * 0.5) == 12


def test_no_capacity_before_a_version_is_seen_then_counted_from_the_first_version():
    b = StalenessBudget(2)
    assert b.capacity() == 0 and b.version is None
    b.observe(40, 8)  # joining late: (eta + 1) * B ahead, not 41 * B
    assert b.capacity() == 24 and b.version == 40
    b.observe(41, 8)
    assert b.capacity() == 32


def test_started_groups_run_until_finished_and_accepted_ones_keep_counting():
    b = StalenessBudget(1)
    b.observe(0, 4)
    assert b.acquire(3, timeout=0)
    b.on_started(1)
    assert b.capacity() == 4  # (1 + 0 + 1) * 4 - 4 running
    b.on_finished(accepted=True)
    b.on_finished(accepted=False)  # dropped before the trainer: frees its slot for good
    assert b.capacity() == 5
    c = b.counts()
    assert (c.started, c.running, c.accepted, c.rejected) == (4, 2, 1, 1)
    with pytest.raises(InvalidArgument):
        StalenessBudget(1).on_finished(accepted=True)


def test_acquire_times_out_while_full_and_wakes_on_a_new_version():
    b = StalenessBudget(0)
    b.observe(0, 2)
    assert b.acquire(2, timeout=0)
    b.on_finished(True)
    b.on_finished(True)
    t0 = time.monotonic()
    assert not b.acquire(1, timeout=0.2)
    assert time.monotonic() - t0 >= 0.19
    got = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire(1, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still blocked: the trainer has not moved
    b.observe(1, 2)
    waiter.join(timeout=5)
    assert got == [True]


def test_close_releases_waiters():
    b = StalenessBudget(0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire(1, timeout=10)))
    waiter.start()
    time.sleep(0.05)
    b.close()
    waiter.join(timeout=5)
    assert got == [False]


@pytest.mark.parametrize("kw", [{"max_staleness": -1}, {"max_concurrent": 0}, {"batch_share": 0}, {"batch_share": 2}])
def test_bad_parameters_are_refused_by_name(kw):
    args = {"max_staleness": 1, **kw}
    eta = args.pop("max_staleness")
    with pytest.raises(InvalidArgument, match=next(iter(kw))):
        StalenessBudget(eta, **args)


def _run_loop(budget: StalenessBudget, *, batch: int, lost_every: int, report_losses: bool, rounds: int = 400) -> int:
    """A rollout worker filling the budget and a trainer that steps its version after each `batch` groups
    it trains; every `lost_every`-th group is lost on the way (evicted, dead-lettered). Returns the version."""
    version, made, trained = 0, 0, 0
    flowing: list[int] = []  # groups accepted, in the order the trainer meets them
    budget.observe(version, batch)
    for _ in range(rounds):
        while budget.acquire(1, timeout=0):
            budget.on_finished(accepted=True)
            flowing.append(made)
            made += 1
            c = budget.counts()
            # AReaL's bound for the groups still counted: never more than (eta + v + 1) * B of them.
            assert c.accepted - c.lost + c.running <= (budget.max_staleness + version + 1) * batch
        while flowing:
            group = flowing.pop(0)
            if group % lost_every == lost_every - 1:
                if report_losses:
                    budget.on_lost(1)
                continue
            trained += 1
            if trained % batch == 0:
                version += 1
                budget.observe(version, batch)
    return version


def test_losses_give_their_capacity_back_so_the_version_keeps_moving():
    """The issue's example: B = 4, eta = 1, one group in ten lost."""
    stalled = _run_loop(StalenessBudget(1), batch=4, lost_every=10, report_losses=False)
    assert stalled < 15  # each loss stays counted as accepted: nothing is admitted from version 11 on
    budget = StalenessBudget(1)
    assert _run_loop(budget, batch=4, lost_every=10, report_losses=True) >= 300
    c = budget.counts()
    assert c.lost == c.accepted // 10  # each loss counted once
    assert budget.capacity() == (1 + budget.version + 1) * 4 - (c.accepted - c.lost) - c.running


def test_a_share_of_the_trainer_gets_that_share_of_each_loss():
    b = StalenessBudget(0, batch_share=0.5)
    b.observe(0, 4)
    assert b.acquire(2, timeout=0)
    b.on_finished(True)
    b.on_finished(True)
    assert b.capacity() == 0
    b.on_lost(1)
    assert b.capacity() == 0  # half a group
    b.on_lost(1)
    assert b.capacity() == 1
    with pytest.raises(InvalidArgument):
        b.on_lost(-1)


def test_capacity_counts_lost_groups_as_never_accepted():
    assert cap(accepted=20, running=5, lost=3) == 2
    assert cap(batch_groups=4 * 0.5, accepted=6, lost=2 * 0.5) == 1  # floor(3 * 2 - 6 + 1)


@pytest.mark.parametrize(("outcome", "lost"), [(DEAD_LETTERED, True), (HANDED_BACK, True), (FINALIZED, False)])
def test_a_group_closed_without_training_rows_counts_as_lost_to_the_gate(outcome, lost):
    # A handed-back group never trains under its id (a regeneration is admitted as a new group):
    # counting it as accepted forever would shrink the gate's capacity for good.
    entry = GroupState("g", CLOSED, 0, 0, 1, 0, outcome=outcome)
    assert (lost_group(entry.to_bytes()) == "g") is lost
    assert lost_group(GroupState("g", OPEN, 0, 0, 0, 0).to_bytes()) is None


def test_a_trainer_run_losses_count_once_each_even_if_a_lower_count_is_read_between():
    losses = TrainerLosses()
    assert losses.new_losses("r1", 3) == 0  # the first record read: those losses predate this gate
    assert losses.new_losses("r1", 4) == 1
    # A lower count (a publisher that sent its consumer's count as it was, after a rebalance gave a
    # loss back) is not a negative loss, and the climb back to 4 is not a new one either.
    assert losses.new_losses("r1", 3) == 0
    assert losses.new_losses("r1", 4) == 0
    assert losses.new_losses("r1", 5) == 1
    assert losses.new_losses("r2", 2) == 2  # a restarted trainer counts from 0
