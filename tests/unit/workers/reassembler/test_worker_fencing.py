"""Fenced reassemblers, whole steps with no broker: a fence ridden out, a live twin that stops, and a woken
zombie that is the one to stop (`workers/reassembler/fencing.py`)."""

from __future__ import annotations

import pytest

from workers.reassembler.errors import WorkerFenced
from workers.reassembler.faults import Faults

from .fake_kafka import FakeBroker
from .steps import (
    GROUP,
    Clock,
    CommitFault,
    RecordingStore,
    finalized,
    make_broker,
    publish,
    steps,
    worker,
)


def test_a_transaction_that_outlived_its_timeout_is_ridden_out_not_taken_for_a_live_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    # Twice in a row: a fence of a transaction open past its timeout is the coordinator's, never a twin's.
    w = worker(broker, store, clock=clock, faults=CommitFault(clock, broker, seconds=11.0, times=2))
    publish(broker, store, "g1")
    steps(w, 4)  # fenced at commit 11 s into a 10 s transaction: a new producer, the step again
    assert finalized(broker) == ["g1"]


def test_a_first_fence_within_the_timeout_is_ridden_out_and_a_second_soon_after_stops_the_worker_as_a_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    # A twin's init fences this worker, whose new producer fences the twin, which fences it back.
    w = worker(broker, store, clock=clock, faults=CommitFault(clock, broker, seconds=1.0, times=2))
    publish(broker, store, "g1")
    w.step()  # fenced 1 s into the transaction: once is ridden out
    with pytest.raises(WorkerFenced, match="another live worker"):
        w.step()  # fenced again soon after re-initialising: a live twin
    assert finalized(broker) == []


def test_fences_far_apart_are_each_ridden_out():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = CommitFault(clock, broker, seconds=1.0, times=1)
    w = worker(broker, store, clock=clock, faults=faults)
    publish(broker, store, "g1")
    steps(w, 3)
    clock.now += 3600.0
    faults.times = 1
    publish(broker, store, "g2")
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"]


class WokenZombie(Faults):
    """Frozen with its transaction open, past the transaction timeout and the session timeout: its
    partitions move and a successor starts under its worker id (whose producer fences this one)."""

    def __init__(self, clock: Clock, broker: FakeBroker, successor):
        self.clock, self.broker, self.successor, self.live = clock, broker, successor, None

    def before_commit(self) -> None:
        if self.live is None:
            self.clock.now += 11.0
            self.broker.kick(GROUP)
            self.live = self.successor()


def test_a_zombie_woken_past_its_transaction_timeout_is_the_twin_that_stops_not_the_live_worker():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = WokenZombie(clock, broker, lambda: worker(broker, store, clock=clock))
    zombie = worker(broker, store, clock=clock, faults=faults)
    publish(broker, store, "g1")
    # Fenced 11 s into a 10 s transaction: taken for the coordinator's abort, so the zombie
    # initialises a new producer, fencing the live worker.
    zombie.step()
    live = faults.live
    steps(live, 2)  # fenced once, soon into a transaction: it rides that out, fencing the zombie back
    with pytest.raises(WorkerFenced, match="another live worker"):
        steps(zombie, 3)  # fenced again after it re-initialised: the zombie is the twin that stops
    publish(broker, store, "g2")
    steps(live, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"]


def test_a_static_member_fenced_once_joins_again_but_fenced_twice_soon_after_stops_as_a_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    w = worker(broker, store, clock=clock, static_membership=True)
    publish(broker, store, "g1")
    steps(w, 2)
    # The coordinator fenced the member id (its own retried join, after the coordinator stalled).
    broker.fenced_members.add(GROUP)
    w.step()
    publish(broker, store, "g2")
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"], "a worker fenced once goes on"
    clock.now += 30.0  # within ten session timeouts of the first fence
    broker.fenced_members.add(GROUP)
    with pytest.raises(WorkerFenced, match="joined consumer group"):
        w.step()
