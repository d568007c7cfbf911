"""A worker the coordinator removed sends no offsets until it has joined again (explorer seed 154).

librdkafka resets a removed member's id and generation as soon as a heartbeat is told
UNKNOWN_MEMBER_ID, and serves the loss of its partitions only at the application's next poll. The
consumer-group metadata taken in between carries generation -1 and no member id, and the group
coordinator takes a transactional offset commit of such metadata without any membership check
(`tests/tools/sim/scenarios/kafka_txn.py`'s `offsets_in_transactions`, on the real broker). A worker
woken from a freeze confirmed its membership with it and then finalized, on its stale task, groups
its successor had already finalized: trained twice. Over the in-memory Kafka (`fake_kafka.py`).
"""

from __future__ import annotations

from .steps import GROUP, Clock, FreezeAtPut, RecordingStore, finalized, make_broker, publish, steps, worker


def test_a_freeze_is_not_confirmed_with_the_metadata_of_a_removed_member():
    clock = Clock()
    broker, store = make_broker(), RecordingStore()
    broker.members_notice = False
    faults = FreezeAtPut(clock, broker, seconds=10.0)
    w = worker(broker, store, clock=clock, faults=faults)
    faults.tick = w._lease.tick
    publish(broker, store, "g1")
    w.step()  # froze at its put: refused, aborted
    assert faults.frozen and store.puts() == []
    broker.remove(GROUP)  # the heartbeat after the thaw heard it; the loss is not served yet
    steps(w, 3)
    assert w._lease.unconfirmed, "confirmed by a transaction of generation -1"
    assert store.puts() == [] and finalized(broker) == []
    broker.members_notice = True  # the next poll serves the loss; the member joins again
    steps(w, 3)
    assert finalized(broker) == ["g1"], "confirmed once it is a member again"


def test_a_worker_removed_without_a_freeze_neither_puts_nor_commits_until_it_has_joined_again():
    """No freeze for the lease to see: the coordinator lost the member's heartbeats (a network
    partition between them) and removed it, and its heartbeat has just heard so."""
    broker, store = make_broker(), RecordingStore()
    broker.members_notice = False
    w = worker(broker, store)
    steps(w, 1)  # joined, nothing to do
    broker.remove(GROUP)
    publish(broker, store, "g1")
    steps(w, 3)
    assert store.puts() == [] and finalized(broker) == []
    broker.members_notice = True
    steps(w, 3)
    assert finalized(broker) == ["g1"]
