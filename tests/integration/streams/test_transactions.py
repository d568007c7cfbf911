"""Transactions and consumer groups against the real broker: the guarantees the pipeline is built on."""

from confluent_kafka import Consumer, TopicPartition

from streams.consumer import committed_offsets, read_topic, wait_until
from streams.producer import AckedProducer, Outgoing, TransactionalProducer


def _values(kafka, topic, read_committed):
    return sorted(r.value for r in read_topic(kafka, topic, read_committed=read_committed))


def test_committed_batch_visible_aborted_batch_only_uncommitted(kafka, make_topic, unique):
    topic = make_topic("txn", partitions=2)
    p = TransactionalProducer(kafka, f"txn-{unique}")
    p.begin()
    for i in range(5):
        p.produce(Outgoing(topic, f"k{i}".encode(), f"committed-{i}".encode()))
    p.commit()
    p.begin()
    for i in range(3):
        p.produce(Outgoing(topic, f"k{i}".encode(), f"aborted-{i}".encode()))
    p.flush()
    p.abort()

    committed = _values(kafka, topic, read_committed=True)
    everything = _values(kafka, topic, read_committed=False)
    assert committed == sorted(f"committed-{i}".encode() for i in range(5))
    assert everything == sorted(
        [f"committed-{i}".encode() for i in range(5)] + [f"aborted-{i}".encode() for i in range(3)]
    )


def _assignment_settled(consumers, expected_total):
    for c in consumers:
        c.poll(0.1)
    return sum(len(c.assignment()) for c in consumers) == expected_total


def test_two_consumers_split_partitions_then_survivor_owns_all(kafka, make_topic, unique):
    topic = make_topic("grp", partitions=4)
    group = f"g-{unique}"
    conf = kafka.consumer(group, **{"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    a, b = Consumer(conf), Consumer(conf)
    a.subscribe([topic])
    b.subscribe([topic])
    wait_until(
        lambda: _assignment_settled([a, b], 4) and a.assignment() and b.assignment(),
        timeout_s=60,
        what="both consumers to own partitions",
    )
    owned_a = {tp.partition for tp in a.assignment()}
    owned_b = {tp.partition for tp in b.assignment()}
    assert owned_a.isdisjoint(owned_b) and owned_a | owned_b == {0, 1, 2, 3}

    b.close()
    wait_until(lambda: _assignment_settled([a], 4), timeout_s=60, what="survivor to own all partitions")
    assert {tp.partition for tp in a.assignment()} == {0, 1, 2, 3}
    a.close()


def test_offsets_move_only_when_transaction_commits(kafka, make_topic, unique):
    src = make_topic("src")
    out = make_topic("out")
    group = f"g-{unique}"
    AckedProducer(kafka).send([Outgoing(src, b"k", f"v{i}".encode()) for i in range(10)])

    consumer = Consumer(kafka.consumer(group))
    consumer.subscribe([src])
    msgs = []
    wait_until(lambda: msgs.extend(consumer.consume(10, 0.5)) or len(msgs) >= 10, timeout_s=30, what="10 records")
    producer = TransactionalProducer(kafka, f"txn-{unique}")

    # Aborted: output invisible, offsets unchanged.
    producer.begin()
    producer.produce(Outgoing(out, b"k", b"first"))
    producer.send_offsets([TopicPartition(src, 0, 5)], consumer.consumer_group_metadata())
    producer.abort()
    assert committed_offsets(kafka, group, src)[0] < 0

    # Committed: offsets move with the output.
    producer.begin()
    producer.produce(Outgoing(out, b"k", b"second"))
    producer.send_offsets([TopicPartition(src, 0, 7)], consumer.consumer_group_metadata())
    producer.commit()
    assert committed_offsets(kafka, group, src)[0] == 7
    assert [r.value for r in read_topic(kafka, out)] == [b"second"]
    consumer.close()
