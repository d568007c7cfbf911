"""In-memory Kafka for unit tests of the trainer's consumer: topic logs, consumer-group commits with metadata.

Enough of Kafka's contract for `ExperienceConsumer` to run whole selects, acks, checkpoints and
restarts with no broker, through its `TrainerClients` factory (`workers/trainer/clients.py`): one
member per consumer group holds every partition of its topic (assigned at its first consume, or
again after `rebalance`), commits keep their metadata, and acknowledged records land in the log at
once. As librdkafka does, a rebalance callback that does not assign is followed by an assignment
of the partitions offered. As librdkafka keeps it, an application's pause belongs to the partition, not
to the assignment: it survives a revocation and the next assignment, and only `resume` lifts it (a
partition of a topic the consumer has not been assigned yet cannot be paused). A commit is checked
against the member's generation only, as the classic protocol's coordinator does: a commit of a
partition the member is not assigned lands (checked on the real broker). `Faults` makes calls
fail (the first committed() calls, commits, seeks, acknowledged sends) or wait (the outbox's
deliveries), and every commit is noted in `events` in order, beside whatever a test's store notes
there, so tests can check what came first.
It is not evidence that the trainer works against Kafka; the integration tests are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from streams.consumer import Record
from streams.errors import DeliveryError
from streams.producer import Outgoing
from streams.tq import KVStore


@dataclass
class FakeMessage:
    _topic: str
    _partition: int
    _offset: int
    _key: bytes | None
    _value: bytes | None
    _ts: int
    _error: Any = None

    def error(self):
        return self._error

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self):
        return self._key

    def value(self):
        return self._value

    def headers(self):
        return []

    def timestamp(self):
        return (1, self._ts)


@dataclass
class Faults:
    """Calls that fail, counted down as they do (a test's; nothing fails by default)."""

    committed: int = 0  # committed() calls that raise, the first ones
    unreadable: set[int] = field(default_factory=set)  # partitions whose committed() entry carries an error
    commits: int = 0  # commit() calls that raise, the first ones
    commits_land: bool = False  # whether those land all the same (a timeout after the broker took them)
    sends: int = 0  # acknowledged sends that raise, the first ones
    seeks: int = 0  # seek() calls that raise, the first ones
    # Topics whose acknowledged sends always fail (the broker does not know them, say).
    unknown_topics: set[str] = field(default_factory=set)
    # Topics whose records from the outbox's producer wait unacknowledged (queued, no delivery report).
    held_topics: set[str] = field(default_factory=set)
    committed_calls: int = 0  # how many committed() calls were made
    committed_in_callback: int = 0  # of those, how many from inside a rebalance callback (librdkafka: a stall)


@dataclass
class _Unread:
    """A committed() entry with an error (confluent-kafka's TopicPartition takes none in its constructor)."""

    topic: str
    partition: int
    offset: int
    metadata: str | None
    error: KafkaError


def _error(code: int, reason: str) -> KafkaException:
    return KafkaException(KafkaError(code, reason))


@dataclass
class FakeBroker:
    """Topics as lists of records, consumer-group commits (offset and metadata) and a log of events."""

    partitions: dict[str, int] = field(default_factory=dict)
    logs: dict[tuple[str, int], list[FakeMessage]] = field(default_factory=dict)
    commits: dict[tuple[str, str, int], tuple[int, str]] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    # ("commit", group, partition, offset, metadata) in order, and whatever tests add (clears, say).
    events: list[tuple] = field(default_factory=list)
    generations: dict[str, int] = field(default_factory=dict)
    _ts: Any = field(default_factory=lambda: itertools.count(1_000))

    def create(self, topic: str, partitions: int = 1) -> None:
        self.partitions[topic] = partitions
        for p in range(partitions):
            self.logs.setdefault((topic, p), [])

    def append(self, topic: str, partition: int, key: bytes | None, value: bytes | None) -> int:
        log = self.logs[(topic, partition)]
        log.append(FakeMessage(topic, partition, len(log), key, value, next(self._ts)))
        return len(log) - 1

    def records(self, topic: str) -> list[FakeMessage]:
        return [m for (t, _), log in sorted(self.logs.items()) if t == topic for m in log]

    def committed(self, group: str, topic: str, partition: int) -> tuple[int, str] | None:
        return self.commits.get((group, topic, partition))

    def rebalance(self, group: str) -> None:
        """The group rebalances: its member's partitions are revoked and assigned again at its next consume."""
        self.generations[group] = self.generations.get(group, 0) + 1

    def clients(self, **consumer_settings: Any) -> FakeClients:
        """Clients of this broker; `consumer_settings` as a `KafkaConfig`'s client settings would add them."""
        return FakeClients(self, consumer_settings)


class FakeClients:
    """A `TrainerClients` over a `FakeBroker`."""

    def __init__(self, broker: FakeBroker, consumer_settings: dict[str, Any] | None = None):
        self.broker = broker
        self.consumers: list[FakeConsumer] = []
        self.reads: list[str] = []  # the topics read whole, in order (`read`)
        self._settings = dict(consumer_settings or {})

    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> FakeConsumer:
        conf = self.consumer_settings(consumer_group, settings)
        cooperative = "cooperative" in str(conf.get("partition.assignment.strategy", ""))
        self.consumers.append(FakeConsumer(self.broker, consumer_group, cooperative=cooperative))
        return self.consumers[-1]

    def consumer_settings(self, consumer_group: str, settings: dict[str, Any]) -> dict[str, Any]:
        return {"group.id": consumer_group, **settings, **self._settings}

    def acked_producer(self) -> FakeAcked:
        return FakeAcked(self.broker)

    def producer(self, settings: dict[str, Any]) -> FakeProducer:
        return FakeProducer(self.broker)

    def read(self, topic: str) -> list[Record]:
        self.reads.append(topic)
        return [
            Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), (), m._ts)
            for m in self.broker.records(topic)
        ]


class FakeConsumer:
    """The consumer API the trainer uses; its group's only member, holding every partition of its topic."""

    def __init__(self, broker: FakeBroker, group: str, *, cooperative: bool = False):
        self.broker, self.group = broker, group
        self.cooperative = cooperative
        self.topic: str | None = None
        self.callbacks: dict[str, Callable | None] = {}
        self.generation: int | None = None
        self.positions: dict[int, int] = {}
        self.paused: set[int] = set()
        self.closed = False
        self._assigned_in_callback = False
        self._in_callback = False

    def subscribe(self, topics, on_assign=None, on_revoke=None, on_lost=None) -> None:
        (self.topic,) = topics
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def _rebalance(self) -> None:
        current = self.broker.generations.get(self.group, 0)
        if self.generation == current:
            return
        if self.generation is not None and self.positions:
            self.callbacks["revoke"](self, self.assignment())
            self.positions = {}
        self.generation = current
        offered = [TopicPartition(self.topic, p) for p in range(self.broker.partitions[self.topic])]
        self._assigned_in_callback = False
        self._in_callback = True
        try:
            self.callbacks["assign"](self, offered)
        finally:
            self._in_callback = False
        if not self._assigned_in_callback:  # as confluent-kafka does after a callback that did not assign
            self._add(offered)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        self._rebalance()
        out: list[FakeMessage] = []
        for p in sorted(self.positions):
            if p in self.paused:
                continue
            log = self.broker.logs[(self.topic, p)]
            while self.positions[p] < len(log) and len(out) < num_messages:
                out.append(log[self.positions[p]])
                self.positions[p] += 1
        return out

    def assign(self, partitions) -> None:
        if self.cooperative and self._in_callback:  # librdkafka refuses it, as here
            raise _error(KafkaError._STATE, "Changes to the current assignment must be made using incremental_assign()")
        self.positions = {}
        self._add(partitions)

    def incremental_assign(self, partitions) -> None:
        if not self.cooperative:
            raise _error(KafkaError._STATE, "Changes to the current assignment must be made using assign()")
        self._add(partitions)

    def _add(self, partitions) -> None:
        self._assigned_in_callback = True
        for tp in partitions:
            commit = self.broker.committed(self.group, tp.topic, tp.partition)
            start = tp.offset if tp.offset >= 0 else (commit[0] if commit is not None else 0)
            self.positions[tp.partition] = start  # paused still if it was: the flag is the partition's

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in sorted(self.positions)]

    def pause(self, partitions) -> None:
        # Kept across assignments; before the consumer knows the topic (its first assignment) there is no
        # partition to pause, and librdkafka skips it.
        if self.generation is not None:
            self.paused |= {tp.partition for tp in partitions}

    def resume(self, partitions) -> None:
        self.paused -= {tp.partition for tp in partitions}

    def seek(self, tp: TopicPartition) -> None:
        if self.broker.faults.seeks > 0:
            self.broker.faults.seeks -= 1
            raise _error(KafkaError._STATE, f"seek of {tp.topic}[{tp.partition}] refused by the test")
        if tp.partition not in self.positions:
            raise _error(KafkaError._STATE, f"seek of {tp.topic}[{tp.partition}], which is not assigned")
        self.positions[tp.partition] = tp.offset

    def committed(self, partitions, timeout: float = -1) -> list[TopicPartition]:
        faults = self.broker.faults
        faults.committed_calls += 1
        faults.committed_in_callback += self._in_callback
        if faults.committed > 0:
            faults.committed -= 1
            raise _error(KafkaError._TIMED_OUT, "committed offsets not fetched: the coordinator does not answer")
        out = []
        for tp in partitions:
            commit = self.broker.committed(self.group, tp.topic, tp.partition)
            if tp.partition in faults.unreadable:
                error = KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE, "the test")
                out.append(_Unread(tp.topic, tp.partition, -1001, None, error))
            elif commit is None:
                out.append(TopicPartition(tp.topic, tp.partition, -1001))
            else:
                out.append(TopicPartition(tp.topic, tp.partition, commit[0], metadata=commit[1]))
        return out

    def commit(self, offsets=None, asynchronous: bool = True) -> None:
        faults = self.broker.faults
        failing = faults.commits > 0
        faults.commits = max(0, faults.commits - 1)
        if failing and not faults.commits_land:
            raise _error(KafkaError._TRANSPORT, "commit refused by the test")
        # As the classic protocol's coordinator does, the member's generation is checked, not whether it is
        # assigned the partitions it commits: a commit of another member's partition lands.
        if self.generation is not None and self.generation != self.broker.generations.get(self.group, 0):
            raise _error(KafkaError.ILLEGAL_GENERATION, "commit of a generation the group has left behind")
        for tp in offsets:
            self.broker.commits[(self.group, tp.topic, tp.partition)] = (tp.offset, tp.metadata or "")
            self.broker.events.append(("commit", self.group, tp.partition, tp.offset, tp.metadata or ""))
        if failing:
            raise _error(KafkaError._TIMED_OUT, "commit timed out (the test), though the broker took it")

    def close(self) -> None:
        self.closed = True


class FakeAcked:
    """`AckedProducer`'s API: records land in the log when sent, unless a fault refuses them."""

    def __init__(self, broker: FakeBroker):
        self.broker = broker

    def send(self, records: Sequence[Outgoing], *, timeout_s: float = 30.0) -> list[tuple[int, int]]:
        faults = self.broker.faults
        if faults.sends > 0 or any(r.topic in faults.unknown_topics for r in records):
            faults.sends = max(0, faults.sends - 1)
            raise DeliveryError("not acknowledged: refused by the test")
        out = []
        for rec in records:
            partition = rec.partition if rec.partition is not None else 0
            out.append((partition, self.broker.append(rec.topic, partition, rec.key, rec.value)))
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class FakeProducer:
    """The outbox's producer: a record lands at `poll` or `flush`, which then serve its delivery report."""

    def __init__(self, broker: FakeBroker):
        self.broker = broker
        self._queued: list[tuple[str, bytes | None, bytes | None, Callable | None]] = []

    def produce(self, topic: str, key=None, value=None, on_delivery=None, **_kwargs) -> None:
        self._queued.append((topic, key, value, on_delivery))

    def poll(self, timeout: float = 0.0) -> int:
        held = self.broker.faults.held_topics
        queued = [q for q in self._queued if q[0] not in held]
        self._queued = [q for q in self._queued if q[0] in held]
        for topic, key, value, on_delivery in queued:
            offset = self.broker.append(topic, 0, key, value)
            if on_delivery is not None:
                on_delivery(None, self.broker.logs[(topic, 0)][offset])
        return len(queued)

    def flush(self, timeout: float = 30.0) -> int:
        self.poll()
        return 0


class NotingStore:
    """A store whose clears are noted in the broker's `events`, so tests see them beside the commits."""

    def __init__(self, store: KVStore, events: list[tuple]):
        self._store, self._events = store, events

    def clear(self, partition: str, keys) -> None:
        self._events.append(("clear", tuple(keys)))
        self._store.clear(partition, keys)

    def __getattr__(self, name):
        return getattr(self._store, name)
