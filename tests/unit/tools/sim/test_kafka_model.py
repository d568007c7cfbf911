"""The Kafka model's faults as an explorer drives them: frozen and killed processes, held requests,
failing points, the broker down mid-session. No broker: these are the model's own promises, built
from what the differential tests showed the real one does."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.tools.sim.env import ManualEnv
from tests.tools.sim.kafka import KafkaCluster, SimKafka

COOP = {
    "enable.auto.commit": False,
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 1000,
    "max.poll.interval.ms": 60000,
}


@pytest.fixture
def cluster():
    c = KafkaCluster(ManualEnv(seed=1))
    c.create_topic("t", 4)
    return c


def _member(cluster, process: str, events: list, **conf):
    c = SimKafka(cluster, process).Consumer({"group.id": "g", **COOP, **conf})
    c.subscribe(
        ["t"],
        on_assign=lambda _, ps: events.append((process, "+", sorted(p.partition for p in ps))),
        on_revoke=lambda _, ps: events.append((process, "-", sorted(p.partition for p in ps))),
        on_lost=lambda _, ps: events.append((process, "lost", sorted(p.partition for p in ps))),
    )
    return c


def _owned(c) -> set[int]:
    return {tp.partition for tp in c.assignment()}


def _poll(*consumers, rounds: int = 5) -> None:
    for _ in range(rounds):
        for c in consumers:
            c.consume(10, 0.1)


def test_a_frozen_member_is_removed_at_its_session_timeout_and_learns_it_after_thawing(cluster):
    env, events = cluster.env, []
    a, b = _member(cluster, "a", events), _member(cluster, "b", events)
    _poll(a, b)
    assert _owned(a) | _owned(b) == {0, 1, 2, 3} and _owned(a) and _owned(b)
    held, stale = _owned(a), a.consumer_group_metadata()
    cluster.freeze("a")
    env.advance(5.5)
    _poll(b, rounds=1)
    assert _owned(b) != {0, 1, 2, 3}  # within its session it keeps its partitions
    env.advance(0.5)
    _poll(b)
    assert _owned(b) == {0, 1, 2, 3}
    # A zombie's transaction with its old membership is refused (KIP-447).
    p = SimKafka(cluster, "a").Producer({"transactional.id": "a"})
    p.init_transactions(5)
    p.begin_transaction()
    with pytest.raises(KafkaException) as refused:
        p.send_offsets_to_transaction([TopicPartition("t", min(held), 0)], stale, 5)
    assert refused.value.args[0].code() == KafkaError.UNKNOWN_MEMBER_ID and refused.value.args[0].txn_requires_abort()
    # Thawed, it still reads its old partitions until its first heartbeat is refused, then loses them.
    cluster.thaw("a")
    assert _owned(a) == held
    env.advance(1.0)
    a.consume(10, 0.1)
    assert ("a", "lost", sorted(held)) in events
    _poll(a, b, rounds=10)
    assert _owned(a) and _owned(a) | _owned(b) == {0, 1, 2, 3} and not _owned(a) & _owned(b)


def test_a_thawed_member_told_of_its_removal_keeps_its_generation_and_joins_only_after_serving_the_loss(cluster):
    """What a real consumer frozen past its session shows (tests/integration/sim/test_kafka_frozen_member.py):
    its member id reset, its generation kept, its offsets refused, no new membership before the loss."""
    env, events = cluster.env, []
    a, b = _member(cluster, "a", events), _member(cluster, "b", events)
    _poll(a, b)
    held, generation = _owned(a), a.consumer_group_metadata().generation
    cluster.freeze("a")
    env.advance(6.5)
    _poll(b)
    cluster.thaw("a")
    env.advance(3.0)  # its heartbeat has been refused; no poll yet
    md = a.consumer_group_metadata()
    assert a.memberid() is None and (md.generation, md.member_id) == (generation, "")
    assert _owned(a) == held and not any(e[:2] == ("a", "lost") for e in events)
    p = SimKafka(cluster, "a").Producer({"transactional.id": "a"})
    p.init_transactions(5)
    p.begin_transaction()
    with pytest.raises(KafkaException) as refused:
        p.send_offsets_to_transaction([TopicPartition("t", min(held), 0)], md, 5)
    assert refused.value.args[0].code() == KafkaError.UNKNOWN_MEMBER_ID
    a.consume(10, 0.1)
    assert ("a", "lost", sorted(held)) in events
    _poll(a, b, rounds=10)
    assert a.memberid() is not None and _owned(a)


def test_a_static_member_killed_is_replaced_by_its_successor_without_a_rebalance(cluster):
    env, events = cluster.env, []
    a = _member(cluster, "a", events, **{"group.instance.id": "w0"})
    b = _member(cluster, "b", events, **{"group.instance.id": "w1"})
    _poll(a, b)
    held = _owned(a)
    cluster.kill("a")
    events.clear()
    env.advance(2.0)
    spare = _member(cluster, "spare", events, **{"group.instance.id": "w0"})
    _poll(spare, b)
    assert _owned(spare) == held and events == [("spare", "+", sorted(held))]


def test_a_transaction_left_open_by_a_frozen_process_is_aborted_and_its_producer_fenced(cluster):
    env = cluster.env
    p = SimKafka(cluster, "z").Producer({"transactional.id": "z", "transaction.timeout.ms": 10000})
    p.init_transactions(5)
    p.begin_transaction()
    p.produce("t", partition=0, value=b"x")
    p.flush(5)
    reader = SimKafka(cluster, "r").Consumer({"group.id": "r", "enable.auto.commit": False})
    assert reader.get_watermark_offsets(TopicPartition("t", 0)) == (0, 0)
    cluster.freeze("z")
    env.advance(11.0)  # past the timeout and the next cleanup pass
    assert reader.get_watermark_offsets(TopicPartition("t", 0)) == (0, 2)
    cluster.thaw("z")
    with pytest.raises(KafkaException) as fenced:
        p.commit_transaction(5)
    assert fenced.value.args[0].code() == KafkaError._FENCED and fenced.value.args[0].fatal()


def test_a_commit_whose_end_request_is_held_times_out_retriably_and_the_next_call_completes_it(cluster):
    env = cluster.env
    p = SimKafka(cluster, "p").Producer({"transactional.id": "p"})
    p.init_transactions(5)
    p.begin_transaction()
    p.produce("t", partition=1, value=b"v")
    stop = env.hold(lambda r: r.name == "kafka.broker.end_txn")
    with pytest.raises(KafkaException) as slow:
        p.commit_transaction(2)
    assert slow.value.args[0].code() == KafkaError._TIMED_OUT and slow.value.args[0].retriable()
    assert cluster.records("t", 1) == []  # not committed yet
    stop()
    env.release()  # the coordinator gets to it: committed, whatever the client saw
    assert [e.value for e in cluster.records("t", 1)] == [b"v"]
    p.commit_transaction(2)  # resumes the call in progress: done
    p.begin_transaction()


def test_a_point_can_make_committed_fail_as_a_coordinator_failover_does(cluster):
    env = cluster.env
    c = SimKafka(cluster, "c").Consumer({"group.id": "g", "enable.auto.commit": False})

    def failover(name, details):
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets: Local: Timed out"))

    stop = env.on_point("kafka.consumer.committed.begin", failover)
    with pytest.raises(KafkaException):
        c.committed([TopicPartition("t", 0)], timeout=5)
    stop()
    assert c.committed([TopicPartition("t", 0)], timeout=5)[0].offset == -1001


def test_members_keep_their_sessions_through_a_broker_outage(cluster):
    env, events = cluster.env, []
    a, b = _member(cluster, "a", events), _member(cluster, "b", events)
    _poll(a, b)
    before = (_owned(a), _owned(b))
    cluster.freeze("a")  # silent through the outage: the coordinator restarts its session clock
    cluster.down()
    env.advance(30.0)
    cluster.up()
    env.advance(5.0)
    _poll(b, rounds=1)
    assert (_owned(a), _owned(b)) == before
    env.advance(1.5)
    _poll(b)
    assert _owned(b) == {0, 1, 2, 3}


def test_compaction_drops_aborted_records_and_shadowed_keys_below_the_cleaner_point():
    cluster = KafkaCluster(ManualEnv())
    cluster.create_topic("s", 1, {"cleanup.policy": "compact"})
    sim = SimKafka(cluster)
    p = sim.Producer({"transactional.id": "s"})
    p.init_transactions(5)
    for value, commit in [(b"1", True), (b"2", False), (b"3", True)]:
        p.begin_transaction()
        p.produce("s", partition=0, key=b"k", value=value)
        p.produce("s", partition=0, key=b"other", value=value)
        p.commit_transaction(5) if commit else p.abort_transaction(5)
    cluster.compact("s")  # the last record (the last marker) is the active segment's
    kept = [(e.key, e.value) for e in cluster.records("s", 0, read_committed=False)]
    assert kept == [(b"k", b"3"), (b"other", b"3")]


def test_keyless_records_take_a_partition_from_the_seed():
    def partitions(seed: int) -> list[int]:
        cluster = KafkaCluster(ManualEnv(seed=seed))
        cluster.create_topic("t", 8)
        p = SimKafka(cluster).Producer({"partitioner": "murmur2_random"})
        got: list[int] = []
        for _ in range(10):
            p.produce("t", value=b"v", on_delivery=lambda err, msg: got.append(msg.partition()))
        p.flush(5)
        return got

    assert partitions(1) == partitions(1) and len(set(partitions(1))) > 1


def test_a_synchronous_commit_that_gets_no_answer_times_out_and_may_land_later(cluster):
    env = cluster.env
    c = SimKafka(cluster, "c").Consumer({"group.id": "lone", "enable.auto.commit": False})
    stop = env.hold(lambda r: r.name == "kafka.broker.offset_commit")
    with pytest.raises(KafkaException) as timed_out:
        c.commit(offsets=[TopicPartition("t", 0, 5, metadata="m")], asynchronous=False)
    assert timed_out.value.args[0].code() == KafkaError._TIMED_OUT
    assert c.committed([TopicPartition("t", 0)])[0].offset == -1001
    stop()
    env.release()  # the coordinator applies it after the caller gave up
    (tp,) = c.committed([TopicPartition("t", 0)])
    assert (tp.offset, tp.metadata) == (5, "m")


def test_a_member_joining_while_a_round_waits_for_a_dead_one_is_in_that_round(cluster):
    """A JoinGroup sent while the coordinator prepares a rebalance joins that round: once the silent
    member's session ends the round completes with the newcomer, not at the rebalance timeout.

    (The explorer found the model waiting for the newcomer to rejoin a round it had joined: a trainer
    restarted twice quickly, both predecessors killed, sat 60 s in PreparingRebalance, its commits
    refused ILLEGAL_GENERATION.)"""
    env, events = cluster.env, []
    eager = {"partition.assignment.strategy": "range", "max.poll.interval.ms": 60000}
    a = _member(cluster, "a", events, **eager)
    _poll(a)
    assert _owned(a) == {0, 1, 2, 3}
    cluster.kill("a")
    b = _member(cluster, "b", events, **eager)  # starts a round that waits for a, dead
    _poll(b, rounds=1)
    cluster.kill("b")
    c = _member(cluster, "c", events, **eager)  # joins while that round is still preparing
    _poll(c, rounds=1)
    env.advance(6.5)  # a's and b's sessions end
    _poll(c)
    assert _owned(c) == {0, 1, 2, 3}
    assert env.now() - cluster.started_at < 20
