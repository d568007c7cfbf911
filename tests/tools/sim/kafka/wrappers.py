"""rlstream's own Kafka wrappers over the model, until they take a client factory (the seams).

`TransactionalProducer` and `AckedProducer` build confluent-kafka's `Producer` in their
constructors, and `read_topic` (hence `read_changelog`) its `Consumer`: their methods run on the
model unchanged, their constructors and the changelog read are redone here over `SimKafka`. Once
streams/producer.py and streams/consumer.py construct their clients through a factory, these go.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import TopicPartition

from schemas.state import PartitionProgress, decode_state_entry
from streams.config import KafkaConfig
from streams.consumer import Record
from streams.producer import AckedProducer, TransactionalProducer
from tests.tools.sim.kafka import SimKafka
from workers.reassembler.changelog import Changelog
from workers.reassembler.restore import LogEntry


class SimTransactionalProducer(TransactionalProducer):
    """`TransactionalProducer` over the model's `Producer` (its constructor's four lines, then its own methods)."""

    def __init__(
        self,
        sim: SimKafka,
        kafka: KafkaConfig,
        transactional_id: str,
        *,
        transaction_timeout_ms: int = 30000,
        init_timeout_s: float = 60.0,
        **overrides: object,
    ):
        conf = kafka.producer(
            transactional_id=transactional_id, **{"transaction.timeout.ms": transaction_timeout_ms, **overrides}
        )
        self.transactional_id = transactional_id
        self._producer = sim.Producer(conf)
        self._producer.init_transactions(init_timeout_s)
        self._in_txn = False


class SimAckedProducer(AckedProducer):
    def __init__(self, sim: SimKafka, kafka: KafkaConfig, **overrides: object):
        self._producer = sim.Producer(kafka.producer(**overrides))


def read_partition(
    sim: SimKafka, kafka: KafkaConfig, topic: str, partition: int, start: int, stop: int
) -> list[Record]:
    """`streams.consumer.read_topic` of one partition from `start` to `stop`, read_committed, on the model."""
    c = sim.Consumer(kafka.consumer(f"rlstream-reader-{topic}-{partition}", read_committed=True))
    try:
        c.assign([TopicPartition(topic, partition, start)])
        out: list[Record] = []
        while True:
            got = [m for m in c.consume(500, 0.5) if m.error() is None]
            out += [Record.of(m) for m in got if m.offset() < stop]
            (tp,) = c.position([TopicPartition(topic, partition)])
            if tp.offset >= stop or (
                not got and tp.offset >= c.get_watermark_offsets(TopicPartition(topic, partition))[1]
            ):
                return out
    finally:
        c.close()


class SimWorkerClients:
    """A reassembler's `WorkerClients` over the model (workers/reassembler/clients.py's protocol)."""

    def __init__(self, sim: SimKafka, kafka: KafkaConfig):
        self.sim, self.kafka = sim, kafka

    def consumer(self, consumer_group: str, settings: dict[str, Any]):
        return self.sim.Consumer(self.kafka.consumer(consumer_group, **settings))

    def producer(self, transactional_id: str, transaction_timeout_ms: int) -> TransactionalProducer:
        return SimTransactionalProducer(
            self.sim, self.kafka, transactional_id, transaction_timeout_ms=transaction_timeout_ms
        )

    def changelog(self, topic: str, partition: int) -> Changelog:
        """`read_changelog`, whole: from the restore point the latest progress entry names."""
        c = self.sim.Consumer(self.kafka.consumer(f"rlstream-changelog-{partition}", read_committed=True))
        try:
            low, high = c.get_watermark_offsets(TopicPartition(topic, partition))
        finally:
            c.close()
        records = read_partition(self.sim, self.kafka, topic, partition, low, high) if high > low else []
        entries = [
            LogEntry(r.offset, r.key, decode_state_entry(r.value) if r.value is not None else None) for r in records
        ]
        start = low
        for e in reversed(entries):
            if isinstance(e.entry, PartitionProgress):
                start = max(low, e.entry.restore_from)
                break
        return Changelog([e for e in entries if e.offset >= start], start, high)


class SimTrainerClients:
    """A trainer's `TrainerClients` over the model (workers/trainer/clients.py's protocol)."""

    def __init__(self, sim: SimKafka, kafka: KafkaConfig):
        self.sim, self.kafka = sim, kafka

    def consumer(self, consumer_group: str, settings: dict[str, Any]):
        return self.sim.Consumer(self.consumer_settings(consumer_group, settings))

    def consumer_settings(self, consumer_group: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self.kafka.consumer(consumer_group, **settings)

    def acked_producer(self) -> AckedProducer:
        return SimAckedProducer(self.sim, self.kafka)

    def producer(self, settings: dict[str, Any]):
        return self.sim.Producer(self.kafka.producer(**settings))

    def read(self, topic: str) -> list[Record]:
        c = self.sim.Consumer(self.kafka.consumer(f"rlstream-reader-{topic}", read_committed=True))
        try:
            parts = sorted(c.list_topics(topic).topics[topic].partitions)
            ends = {p: c.get_watermark_offsets(TopicPartition(topic, p))[1] for p in parts}
            lows = {p: c.get_watermark_offsets(TopicPartition(topic, p))[0] for p in parts}
        finally:
            c.close()
        return [
            r
            for p in parts
            if ends[p] > lows[p]
            for r in read_partition(self.sim, self.kafka, topic, p, lows[p], ends[p])
        ]
