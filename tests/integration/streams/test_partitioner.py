"""rlstream's own partitioner against the broker: keyed records land where `partition_of` says."""

from streams.partitioner import partition_of
from streams.producer import AckedProducer, Outgoing


def test_partition_of_is_where_rlstreams_producer_puts_a_keyed_record(kafka, make_topic):
    topic = make_topic("keys", partitions=7)
    keys = [f"run7-g{i:05d}".encode() for i in range(300)] + [b"a", b"ab", b"abc", "prompt-\u00e9".encode()]
    producer = AckedProducer(kafka)
    try:
        landed = producer.send([Outgoing(topic, k, b"v") for k in keys])
    finally:
        producer.close()
    assert [p for p, _ in landed] == [partition_of(k, 7) for k in keys]
