"""A step refused again and again is retried with a bounded backoff, not at once (explorer seed 1111).

A worker frozen past its session timeout sends its committed offsets in a transaction to confirm its
membership; the group coordinator refuses it from the old generation until the consumer has learnt
of its rebalance. Each refusal aborts the step and rebuilds at the same committed offsets, and the
records come straight back: with no wait between, a hot loop of transactions and rebuilds until the
heartbeat notices (forever on a network that takes no time). Over the in-memory Kafka (`fake_kafka.py`).
"""

from __future__ import annotations

from workers.reassembler.retry import MAX_REBUILD_DELAY_S, retry_delay

from .steps import Clock, finalized, frozen_at_first_put, steps


def test_a_confirmation_refused_again_and_again_waits_longer_each_time_up_to_a_bound():
    clock = Clock()
    broker, store, w = frozen_at_first_put(clock)
    clock.slept.clear()
    steps(w, 12)  # each step's confirmation refused: the same records, the same committed offsets
    assert store.puts() == [] and finalized(broker) == []
    assert len(clock.slept) >= 10, f"rebuilt at once after a refusal: {clock.slept}"
    assert clock.slept[:4] == [retry_delay(0), retry_delay(1), retry_delay(2), retry_delay(3)]
    assert max(clock.slept) == MAX_REBUILD_DELAY_S, "the wait is bounded"
    broker.members_notice = True  # the next poll hands the member its rebalance
    steps(w, 3)
    assert finalized(broker) == ["g1"], "a confirmed worker goes on"


def test_a_rebuild_after_progress_is_not_delayed():
    clock = Clock()
    broker, store, w = frozen_at_first_put(clock)
    steps(w, 3)  # refused, with waits
    broker.members_notice = True
    steps(w, 3)
    assert finalized(broker) == ["g1"]
    clock.slept.clear()
    w._rebuild()  # an abort after a commit moved the offsets: no backoff carried over
    assert clock.slept == []
