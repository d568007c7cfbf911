"""What confluent-kafka hands an application: messages (records or errors), topic metadata, group metadata."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from streams.partitioner import partition_of
from tests.tools.sim.kafka import errors

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

TIMESTAMP_CREATE_TIME = 1


class Message:
    """`confluent_kafka.Message`: a record, a delivery report's record, or an error event."""

    def __init__(
        self,
        topic: str | None,
        partition: int,
        offset: int | None,
        key: bytes | None = None,
        value: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        timestamp_ms: int = -1,
        error: KafkaError | None = None,
    ):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value = key, value
        self._headers = list(headers) if headers else None
        self._timestamp = (TIMESTAMP_CREATE_TIME, timestamp_ms) if timestamp_ms >= 0 else (0, -1)
        self._error = error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str | None:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return None if self._headers is None else list(self._headers)

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def leader_epoch(self) -> int | None:
        return 0 if self._error is None and self._offset is not None and self._offset >= 0 else None

    def latency(self) -> float | None:
        return None

    def __len__(self) -> int:
        return len(self._value) if self._value is not None else 0

    def __repr__(self) -> str:
        if self._error is not None:
            return f"Message(error={self._error.name()})"
        return f"Message({self._topic}[{self._partition}]@{self._offset})"


def error_event(err: KafkaError, topic: str | None = None, partition: int = -1) -> Message:
    """An error a consume returns as a message (its text is the value, as librdkafka's)."""
    return Message(topic, partition, None, None, err.str().encode(), None, -1, err)


@dataclass
class PartitionMetadata:
    id: int
    leader: int = 1
    replicas: list[int] = field(default_factory=lambda: [1])
    isrs: list[int] = field(default_factory=lambda: [1])
    error: KafkaError | None = None


@dataclass
class TopicMetadata:
    topic: str
    partitions: dict[int, PartitionMetadata]
    error: KafkaError | None = None


@dataclass
class ClusterMetadata:
    topics: dict[str, TopicMetadata]
    cluster_id: str = "sim-cluster"
    controller_id: int = 1
    brokers: dict[int, Any] = field(default_factory=dict)
    orig_broker_id: int = 1
    orig_broker_name: str = "sim:9092/1"


@dataclass(frozen=True)
class GroupMetadata:
    """What `consumer_group_metadata()` returns: whom a transaction's offsets are sent as (KIP-447)."""

    group_id: str
    generation: int
    member_id: str
    instance_id: str | None


def topic_partition(topic: str, partition: int, offset: int, metadata: str | None = None) -> TopicPartition:
    """A `TopicPartition` (its constructor refuses metadata=None)."""
    if metadata is None:
        return TopicPartition(topic, partition, offset)
    return TopicPartition(topic, partition, offset, metadata=metadata)


def choose_partition(partitioner: str, key: bytes | None, partitions: int, rng) -> int:
    """librdkafka's partitioners for a record without an explicit partition."""
    if key is None or partitioner == "random":
        return rng.randrange(partitions)
    if partitioner in ("murmur2", "murmur2_random"):
        return partition_of(key, partitions)
    if partitioner in ("consistent", "consistent_random"):
        return zlib.crc32(key) % partitions
    raise NotImplementedError(f"partitioner {partitioner!r} is not modelled")


def cluster_metadata(cluster: KafkaCluster, topic: str | None, timeout: float | None) -> ClusterMetadata:
    env = cluster.env
    if not cluster.broker_up:
        env.wait_until(lambda: cluster.broker_up, math.inf if timeout is None or timeout < 0 else env.now() + timeout)
        if not cluster.broker_up:
            raise KafkaException(errors.transport("Failed to get metadata"))
    with cluster.lock:
        names = [topic] if topic is not None else sorted(cluster.topics)
        out: dict[str, TopicMetadata] = {}
        for name in names:
            t = cluster.topics.get(name)
            if t is None:
                out[name] = TopicMetadata(name, {}, errors.error(KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                                 "Broker: Unknown topic or partition"))  # fmt: skip
            else:
                out[name] = TopicMetadata(name, {p: PartitionMetadata(p) for p in range(len(t.logs))})
        return ClusterMetadata(out)
