"""The Kafka clients a trainer's consumer makes, behind one factory it is given.

`KafkaTrainerClients` builds confluent-kafka clients from a `KafkaConfig` through the `KafkaApi` it is
given (confluent-kafka itself by default, the explorer's model of Kafka), its topic reads waiting on
the trainer's `Runtime`. The trainer's side
asks its factory for the finalized topic's reader (a consumer of its consumer group), acknowledged
producers (the stale-group replay, the version publisher, the progress entries), the outbox's
producer (dead letters and hand-backs, served by delivery reports) and a read of a whole topic (the
progress topic on assignment), and nothing else. So a unit
test can hand it a factory of in-memory fakes (tests/unit/workers/trainer/fake_kafka.py) and run
the consumer's commits, assignments and clears with no broker, and a test or the explorer can hand
it clients that fail on purpose. No setting reaches a factory: a caller passes one in code, or gets
the real one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from streams.config import KafkaConfig
from streams.consumer import Record, read_topic
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.producer import AckedProducer, Outgoing
from streams.runtime import REAL_RUNTIME, Runtime


class Acked(Protocol):
    def send(self, records: Sequence[Outgoing], *, timeout_s: float = 30.0) -> list[tuple[int, int]]:
        """Produce and wait for the broker's acknowledgement of every record (`DeliveryError` if not)."""
        ...

    def close(self, timeout_s: float = 10.0) -> None: ...


class TrainerClients(Protocol):
    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> Any:
        """A consumer of `consumer_group` with these librdkafka settings (confluent-kafka's `Consumer` API)."""
        ...

    def consumer_settings(self, consumer_group: str, settings: dict[str, Any]) -> dict[str, Any]:
        """The whole librdkafka configuration `consumer` builds (the assignment strategy decides how to assign)."""
        ...

    def acked_producer(self) -> Acked:
        """An idempotent producer whose `send` returns once the broker acknowledged every record."""
        ...

    def producer(self, settings: dict[str, Any]) -> Any:
        """A plain idempotent producer (confluent-kafka's `Producer` API: produce, poll, flush)."""
        ...

    def read(self, topic: str) -> list[Record]:
        """Every record of `topic` up to its end now, read_committed, in offset order per partition."""
        ...


class KafkaTrainerClients:
    """Clients of the cluster `kafka` describes, made by `api` (the real ones by default)."""

    def __init__(self, kafka: KafkaConfig, *, api: KafkaApi = REAL_KAFKA, runtime: Runtime = REAL_RUNTIME):
        self.kafka = kafka
        self.api = api
        self.runtime = runtime

    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> Any:
        return self.api.Consumer(self.consumer_settings(consumer_group, settings))

    def consumer_settings(self, consumer_group: str, settings: dict[str, Any]) -> dict[str, Any]:
        return self.kafka.consumer(consumer_group, **settings)

    def acked_producer(self) -> AckedProducer:
        return AckedProducer(self.kafka, api=self.api)

    def producer(self, settings: dict[str, Any]) -> Any:
        return self.api.Producer(self.kafka.producer(**settings))

    def read(self, topic: str) -> list[Record]:
        return list(read_topic(self.kafka, topic, api=self.api, runtime=self.runtime))


def cooperative(settings: dict[str, Any]) -> bool:
    """Whether a consumer of these settings rebalances incrementally (then it must `incremental_assign`)."""
    return "cooperative" in str(settings.get("partition.assignment.strategy", ""))
