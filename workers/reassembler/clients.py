"""The Kafka clients a reassembler worker makes, behind one factory it is given.

`KafkaClients` builds confluent-kafka clients from a `KafkaConfig`, through the `KafkaApi` it is
given (`streams.kafka_api`: confluent-kafka itself by default; the explorer's model of Kafka), its
changelog reads waiting on the worker's `Runtime`. The worker asks its factory for a consumer, a
transactional producer and a partition's state changelog, and nothing else, so a unit test can
hand it a factory of in-memory fakes (tests/unit/workers/reassembler/fake_kafka.py) and run whole
steps (finalize, settle, prepare, commit, post-commit) with no broker.
"""

from __future__ import annotations

from typing import Any, Protocol

from streams.config import KafkaConfig
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.producer import TransactionalProducer
from streams.runtime import REAL_RUNTIME, Runtime
from workers.reassembler.changelog import Changelog, read_changelog
from workers.reassembler.config import ReassemblerConfig


def consumer_settings(config: ReassemblerConfig) -> dict[str, Any]:
    """The librdkafka settings of a worker's receipts consumer, beyond those of its `KafkaConfig`."""
    return {
        "session.timeout.ms": config.session_timeout_ms,
        "heartbeat.interval.ms": max(100, config.session_timeout_ms // 6),
        "max.poll.interval.ms": config.max_poll_interval_ms,
        "client.id": config.transactional_id,
        "partition.assignment.strategy": config.partition_assignment,
        **({"group.instance.id": config.transactional_id} if config.static_membership else {}),
    }


class WorkerClients(Protocol):
    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> Any:
        """A consumer of `consumer_group` with these librdkafka settings (confluent-kafka's `Consumer` API)."""
        ...

    def producer(self, transactional_id: str, transaction_timeout_ms: int) -> TransactionalProducer:
        """A transactional producer under `transactional_id`, its transactions initialised (fencing older ones)."""
        ...

    def changelog(self, topic: str, partition: int) -> Changelog:
        """The part of state partition `partition` a restore reads, read_committed."""
        ...


class KafkaClients:
    """Clients of the cluster `kafka` describes, made by `api` (the real ones by default)."""

    def __init__(self, kafka: KafkaConfig, *, api: KafkaApi = REAL_KAFKA, runtime: Runtime = REAL_RUNTIME):
        self.kafka = kafka
        self.api = api
        self.runtime = runtime

    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> Any:
        return self.api.Consumer(self.kafka.consumer(consumer_group, **settings))

    def producer(self, transactional_id: str, transaction_timeout_ms: int) -> TransactionalProducer:
        return TransactionalProducer(
            self.kafka, transactional_id, transaction_timeout_ms=transaction_timeout_ms, api=self.api
        )

    def changelog(self, topic: str, partition: int) -> Changelog:
        return read_changelog(self.kafka, topic, partition, api=self.api, runtime=self.runtime)
