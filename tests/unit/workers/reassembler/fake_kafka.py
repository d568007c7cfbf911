"""In-memory Kafka for unit tests of the reassembler's step: a log, consumer-group offsets, transactions.

Enough of Kafka's contract for `ReassemblerWorker` to run whole steps with no broker: records are
visible to the worker's consumer only once their transaction committed (read_committed), offsets sent
in a transaction commit with it, a newer producer under the same transactional id fences the older
one, and a commit carrying the consumer-group metadata of an older generation is refused (KIP-447).
It is not evidence that the pipeline works against Kafka; the integration tests are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from schemas.state import decode_state_entry
from streams.producer import Outgoing
from workers.reassembler.changelog import Changelog
from workers.reassembler.restore import LogEntry


@dataclass
class FakeMessage:
    _topic: str
    _partition: int
    _offset: int
    _key: bytes | None
    _value: bytes | None
    _ts: int
    _headers: tuple = ()
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
        return list(self._headers)

    def timestamp(self):
        return (1, self._ts)


@dataclass
class FakeBroker:
    """Topics as lists of committed records, consumer-group offsets and generations, producer epochs."""

    partitions: dict[str, int] = field(default_factory=dict)
    logs: dict[tuple[str, int], list[FakeMessage]] = field(default_factory=dict)
    offsets: dict[tuple[str, str, int], int] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    # Whether members learn of a new generation at their next poll; False: the heartbeat that would
    # tell them has not been answered yet, so they go on with their old assignment.
    members_notice: bool = True
    # Static members the coordinator fenced: their consumer's next poll reports it (a fatal error).
    fenced_members: set = field(default_factory=set)
    # Partitions a cooperative rebalance takes from a consumer group's member at its next poll.
    revocations: dict[str, set[int]] = field(default_factory=dict)
    # Groups whose member was removed after an ILLEGAL_GENERATION: its member id and generation are
    # reset at once, the loss is served by a later poll (once `members_notice`).
    removed_members: set = field(default_factory=set)
    # Groups whose member joined again under a new member id and a current generation, what that did
    # to its partitions not served yet (a callback at a later poll, once `members_notice`).
    rejoined_members: set = field(default_factory=set)
    _ts: Any = field(default_factory=lambda: itertools.count(1_000))

    def create(self, topic: str, partitions: int = 1) -> None:
        self.partitions[topic] = partitions
        for p in range(partitions):
            self.logs.setdefault((topic, p), [])

    def append(self, topic: str, partition: int, key: bytes | None, value: bytes | None, ts: int | None = None) -> int:
        log = self.logs[(topic, partition)]
        log.append(FakeMessage(topic, partition, len(log), key, value, next(self._ts) if ts is None else ts))
        return len(log) - 1

    def records(self, topic: str) -> list[FakeMessage]:
        return [m for (t, _), log in sorted(self.logs.items()) if t == topic for m in log]

    def kick(self, consumer_group: str) -> None:
        """The coordinator expelled the group's members (a session timeout): their generation is over."""
        self.generations[consumer_group] = self.generations.get(consumer_group, 0) + 1

    def revoke(self, consumer_group: str, partitions) -> None:
        """A cooperative rebalance: the member's next poll gives `partitions` up (on_revoke) and keeps
        the rest under a new generation; they are assigned to nobody here."""
        self.revocations.setdefault(consumer_group, set()).update(partitions)

    def remove(self, consumer_group: str) -> None:
        """The coordinator removed the group's member, after an ILLEGAL_GENERATION: until its poll serves
        the loss, it holds its old assignment with no member id and generation -1."""
        self.kick(consumer_group)
        self.removed_members.add(consumer_group)

    def rejoin(self, consumer_group: str) -> None:
        """The group's member joined again as a new member (a static member's rejoin), its callback not
        served yet: a current generation and member id, the tasks of the old membership."""
        self.kick(consumer_group)
        self.rejoined_members.add(consumer_group)

    def clients(self) -> FakeClients:
        return FakeClients(self)


class FakeClients:
    """A `WorkerClients` over a `FakeBroker`."""

    def __init__(self, broker: FakeBroker):
        self.broker = broker
        self.consumers: list[FakeConsumer] = []
        self.producers: list[FakeProducer] = []

    def consumer(self, consumer_group: str, settings: dict[str, Any]) -> FakeConsumer:
        c = FakeConsumer(self.broker, consumer_group)
        self.consumers.append(c)
        return c

    def producer(self, transactional_id: str, transaction_timeout_ms: int) -> FakeProducer:
        p = FakeProducer(self.broker, transactional_id)
        self.producers.append(p)
        return p

    def changelog(self, topic: str, partition: int) -> Changelog:
        log = self.broker.logs.get((topic, partition), [])
        entries = [
            LogEntry(m.offset(), m.key(), decode_state_entry(m.value()) if m.value() is not None else None) for m in log
        ]
        return Changelog(entries, 0, len(log))


class FakeConsumer:
    """The consumer API the worker uses; assigns every partition of its topic at the first consume."""

    def __init__(self, broker: FakeBroker, group: str):
        self.broker, self.group = broker, group
        self.topic: str | None = None
        self.callbacks: dict[str, Callable] = {}
        self.generation: int | None = None
        self.joins = 0  # a new member id with each join as a new member
        self.positions: dict[int, int] = {}
        self.paused: set[int] = set()
        self.closed = False
        self.timeouts: list[float] = []  # of every consume call: how long it would have waited

    def subscribe(self, topics, on_assign=None, on_revoke=None, on_lost=None) -> None:
        (self.topic,) = topics
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def _rebalance(self) -> None:
        if self.group in self.broker.rejoined_members:
            if self.generation is not None and self.generation != self.broker.generations[self.group]:
                self.generation, self.joins = self.broker.generations[self.group], self.joins + 1
            if not self.broker.members_notice:
                return
            self.broker.rejoined_members.discard(self.group)
            self.callbacks["assign"](self, [])  # the round served: nothing moved
            return
        revoked = sorted(self.broker.revocations.pop(self.group, set()) & set(self.positions))
        if revoked:
            self.callbacks["revoke"](self, [TopicPartition(self.topic, p) for p in revoked])
            for p in revoked:
                self.positions.pop(p)
            self.broker.kick(self.group)
            self.generation = self.broker.generations[self.group]  # rejoined at once, keeping the rest
            return
        current = self.broker.generations.get(self.group, 0)
        if self.generation == current or (self.generation is not None and not self.broker.members_notice):
            return
        if self.generation is not None and self.positions:
            self.callbacks["lost"](self, [TopicPartition(self.topic, p) for p in sorted(self.positions)])
            self.positions = {}
        self.broker.removed_members.discard(self.group)  # joined again, as a new member
        self.generation, self.joins = current, self.joins + 1
        everything = [TopicPartition(self.topic, p) for p in range(self.broker.partitions[self.topic])]
        self.callbacks["assign"](self, everything)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        self.timeouts.append(timeout)
        if self.group in self.broker.fenced_members:
            self.broker.fenced_members.discard(self.group)
            error = KafkaError(
                KafkaError._FATAL, "Static consumer fenced by other consumer with same group.instance.id"
            )
            return [FakeMessage(self.topic, -1, -1, None, None, 0, (), error)]
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

    def incremental_assign(self, partitions) -> None:
        self.assign(partitions)

    def assign(self, partitions) -> None:
        for tp in partitions:
            committed = self.broker.offsets.get((self.group, self.topic, tp.partition), 0)
            self.positions[tp.partition] = committed

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in sorted(self.positions)]

    def resume(self, partitions) -> None:
        self.paused -= {tp.partition for tp in partitions}

    def pause(self, partitions) -> None:
        self.paused |= {tp.partition for tp in partitions}

    def committed(self, partitions, timeout: float = -1) -> list[TopicPartition]:
        return [
            TopicPartition(tp.topic, tp.partition, self.broker.offsets.get((self.group, tp.topic, tp.partition), -1001))
            for tp in partitions
        ]

    def position(self, partitions) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions.get(tp.partition, -1001)) for tp in partitions]

    def seek(self, tp: TopicPartition) -> None:
        self.positions[tp.partition] = tp.offset

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool = False, timeout: float = -1):
        return 0, len(self.broker.logs[(tp.topic, tp.partition)])

    def _removed(self) -> bool:
        return self.group in self.broker.removed_members

    def memberid(self) -> str | None:
        return None if self.generation is None or self._removed() else f"{self.group}-member-{self.joins}"

    def consumer_group_metadata(self) -> tuple[str, int | None]:
        return (self.group, -1 if self._removed() else self.generation)

    def list_topics(self, topic: str, timeout: float = -1):
        partitions = {p: None for p in range(self.broker.partitions[topic])}
        return _Metadata({topic: _TopicMetadata(partitions)})

    def close(self) -> None:
        self.closed = True


@dataclass
class _TopicMetadata:
    partitions: dict
    error: Any = None


@dataclass
class _Metadata:
    topics: dict


def _error(code: int, reason: str, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, reason, **flags))


class FakeProducer:
    """`TransactionalProducer`'s API: records and offsets of a transaction land together at commit."""

    def __init__(self, broker: FakeBroker, transactional_id: str):
        self.broker, self.transactional_id = broker, transactional_id
        broker.epochs[transactional_id] = broker.epochs.get(transactional_id, 0) + 1
        self.epoch = broker.epochs[transactional_id]
        self._records: list[tuple[Outgoing, Callable | None]] = []
        self._offsets: list[tuple[TopicPartition, tuple]] = []
        self._in_txn = False
        self._delivered: list[tuple[Callable, FakeMessage]] = []
        self.commits = 0

    @property
    def in_transaction(self) -> bool:
        return self._in_txn

    def _check_epoch(self) -> None:
        if self.broker.epochs[self.transactional_id] != self.epoch:
            raise _error(KafkaError._FENCED, "fenced by a newer instance", fatal=True)

    def begin(self) -> None:
        self._check_epoch()
        self._records, self._offsets, self._in_txn = [], [], True

    def produce(self, rec: Outgoing, on_delivery=None) -> None:
        self._records.append((rec, on_delivery))

    def send_offsets(self, offsets, group_metadata, *, timeout_s: float = 30.0) -> None:
        self._check_epoch()
        group, generation = group_metadata
        # Generation -1 is not checked at all: the coordinator takes a transactional offset commit
        # without a member id as a standalone one, in any group state (`offsets_in_transactions`).
        if generation != -1 and generation != self.broker.generations.get(group, 0):
            raise _error(KafkaError.ILLEGAL_GENERATION, "stale generation", txn_requires_abort=True)
        self._offsets.extend((tp, group_metadata) for tp in offsets)

    def commit(self, *, timeout_s: float = 60.0) -> None:
        self._check_epoch()
        for rec, on_delivery in self._records:
            partition = rec.partition if rec.partition is not None else 0
            offset = self.broker.append(rec.topic, partition, rec.key, rec.value, rec.timestamp_ms)
            if on_delivery is not None:
                self._delivered.append((on_delivery, self.broker.logs[(rec.topic, partition)][offset]))
        for tp, (group, _) in self._offsets:
            self.broker.offsets[(group, tp.topic, tp.partition)] = tp.offset
        self._records, self._offsets, self._in_txn = [], [], False
        self.commits += 1

    def abort(self, *, timeout_s: float = 60.0) -> None:
        self._check_epoch()
        self._records, self._offsets, self._in_txn = [], [], False

    def poll(self, timeout_s: float = 0.0) -> None:
        delivered, self._delivered = self._delivered, []
        for cb, msg in delivered:
            cb(None, msg)

    def flush(self, timeout_s: float = 30.0) -> int:
        self.poll()
        return 0
