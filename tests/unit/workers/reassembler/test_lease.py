"""The zombie guard: a worker refuses TQ puts after a freeze or a step longer than the poll interval."""

from tests.unit.manual_runtime import ManualRuntime
from workers.reassembler.lease import Lease


def _lease(clock):
    return Lease(session_timeout_s=6.0, max_poll_interval_s=60.0, tick_s=0.1, runtime=clock, watch=False)


def test_a_running_worker_keeps_its_lease():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    for _ in range(100):
        clock.now += 0.1
        lease.tick()
    assert lease.refusal() is None


def test_a_freeze_refuses_every_put_until_membership_is_confirmed_however_long_the_worker_runs_after():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    clock.now += 10.0  # SIGSTOP for 10 s, then SIGCONT: the watch ticks first
    lease.tick()
    # Waking, it polls (prefetched records) and keeps building for longer than a session timeout:
    # time alone never proves that its partitions did not move meanwhile.
    for _ in range(300):
        clock.now += 0.1
        lease.tick()
        lease.polled()
    assert "frozen for 10.0s" in lease.refusal() and lease.unconfirmed
    mark = lease.freezes()
    assert lease.confirmed(mark)
    assert lease.refusal() is None and not lease.unconfirmed


def test_a_confirmation_during_which_the_worker_froze_again_does_not_count():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    clock.now += 10.0
    lease.tick()
    mark = lease.freezes()  # the confirming transaction starts...
    clock.now += 8.0  # ...and the process is stopped again before the broker answered
    lease.tick()
    assert not lease.confirmed(mark)
    assert lease.refusal() is not None
    assert lease.confirmed(lease.freezes())


def test_a_freeze_the_watch_has_not_seen_yet_is_caught_by_the_check_itself():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    clock.now += 4.0  # shorter than the session, but more than half of it: not trusted
    assert "frozen for 3.9s" in lease.refusal()


def test_a_short_gap_is_not_a_freeze():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    clock.now += 2.5
    lease.tick()
    assert lease.refusal() is None


def test_a_step_longer_than_most_of_the_poll_interval_refuses_puts_until_the_next_poll():
    clock = ManualRuntime(100.0)
    lease = _lease(clock)
    for _ in range(460):  # 46 s of a running, heartbeating, slow step
        clock.now += 0.1
        lease.tick()
    assert "since the last poll" in lease.refusal()
    lease.polled()
    assert lease.refusal() is None
