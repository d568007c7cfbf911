"""A worker sends no offsets and puts nothing for tasks of a membership it no longer has.

Explorer seed 154 first looked like this hole: a worker woken from a freeze confirmed its membership
with generation -1 metadata and no member id, which the coordinator takes in a transaction with no
membership check (`offsets_in_transactions`, on the real broker), and then handed back, on its stale
task, groups its successor had finalized. That metadata was the Kafka model's mistake: librdkafka
resets a removed member's id but keeps its generation, which the coordinator refuses (a review read
librdkafka's source and froze a real consumer past its session to show it; the model now does the
same). The state is real after an ILLEGAL_GENERATION, which resets the generation too, before the
loss is served; and a static member that joined again under a new id has a current generation
before it has served what the rejoin did to its partitions. `commit.member_metadata` refuses both.
Over the in-memory Kafka (`fake_kafka.py`).
"""

from __future__ import annotations

from .steps import GROUP, Clock, RecordingStore, finalized, frozen_at_first_put, make_broker, publish, steps, worker


def test_a_freeze_is_not_confirmed_with_the_metadata_of_a_removed_member():
    clock = Clock()
    broker, store, w = frozen_at_first_put(clock)
    broker.remove(GROUP)  # after an ILLEGAL_GENERATION: id and generation reset, the loss not served yet
    steps(w, 3)
    assert w._lease.unconfirmed, "confirmed by a transaction of generation -1"
    assert store.puts() == [] and finalized(broker) == []
    broker.members_notice = True  # the next poll serves the loss; the member joins again
    steps(w, 3)
    assert finalized(broker) == ["g1"], "confirmed once it is a member again"


def _membership_changes_after_joining(change) -> None:
    """A joined worker's membership changes as `change(broker)` says, then g1 arrives: nothing is put or
    committed until the next poll has served the change, then g1 is finalized."""
    broker, store = make_broker(), RecordingStore()
    broker.members_notice = False
    w = worker(broker, store)
    steps(w, 1)  # joined, nothing to do
    change(broker)
    publish(broker, store, "g1")
    steps(w, 3)
    assert store.puts() == [] and finalized(broker) == []
    broker.members_notice = True  # the next poll serves the change
    steps(w, 3)
    assert finalized(broker) == ["g1"]


def test_a_worker_removed_without_a_freeze_neither_puts_nor_commits_until_it_has_joined_again():
    """No freeze for the lease to see: the coordinator lost the member's heartbeats (a network
    partition between them) and removed it, and its heartbeat has just heard so."""
    _membership_changes_after_joining(lambda broker: broker.remove(GROUP))


def test_a_member_that_joined_again_under_a_new_id_commits_nothing_for_its_old_tasks():
    """A static member's rejoin gives it a new member id and a current generation at once; what the
    rejoin did to its partitions comes with a callback at its next poll. Until then its tasks are the
    old membership's, and a transaction of the new metadata would pass the coordinator's check."""
    _membership_changes_after_joining(lambda broker: broker.rejoin(GROUP))
