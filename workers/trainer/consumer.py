"""`ExperienceConsumer`: the trainer's read_committed view of finalized groups, by weight version.

Groups are held, yielded or evicted by a consumption policy; a yielded batch carries the padded
tensors fetched from TQ train, and `release` clears those rows and commits the consumed offsets.
A partition's committed offset never passes a group that is still held or yielded but unreleased.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas.errors import InvalidArgument, SchemaError
from schemas.finalized import FinalizedGroup
from schemas.payload import unpack_payload
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import KVStore, MissingKeysError
from workers.telemetry.sensors import TrainerSensor
from workers.trainer.config import ConsumerConfig
from workers.trainer.policies import Decision, Policy

__all__ = ["ConsumerConfig", "ConsumerCounts", "ExperienceConsumer", "TrainBatch"]

log = logging.getLogger("rlstream.trainer")

_RETRY_COMMIT = (
    KafkaError._NO_OFFSET,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError._ASSIGNMENT_LOST,
    KafkaError._STATE,
)


@dataclass
class ConsumerCounts:
    """Totals since the consumer started, except `waiting` and `ahead`: those are the current figures."""

    yielded: int = 0
    evicted_stale: int = 0
    duplicates: int = 0
    missing_rows: int = 0
    undecodable: int = 0
    waiting: int = 0
    # Held groups more than the in_order lookahead ahead of the trainer (held, not dropped).
    ahead: int = 0


@dataclass(frozen=True)
class TrainBatch:
    """Groups yielded together, their sample IDs and tags, and the padded tensors from TQ train."""

    version: int
    groups: tuple[FinalizedGroup, ...]
    sample_ids: tuple[str, ...]
    tags: tuple[dict, ...]
    tensors: dict[str, torch.Tensor]
    positions: tuple[tuple[int, int], ...]  # (partition, offset) of each group's record

    @property
    def staleness(self) -> list[int]:
        return [self.version - g.group_min_wv for g in self.groups]


@dataclass
class _Pending:
    group: FinalizedGroup
    partition: int
    offset: int
    state: str  # "held" | "ready" | "yielded"


class ExperienceConsumer:
    """Read finalized groups read_committed and hand them to the trainer by weight version.

    `sensor` gets every yield (with its staleness), eviction and dropped duplicate, e.g. a
    `PrometheusTrainerSensor`; `on_yield` / `on_evict` get the group itself.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        config: ConsumerConfig,
        policy: Policy,
        *,
        version: int = 0,
        on_yield: Callable[[FinalizedGroup, int], None] | None = None,
        on_evict: Callable[[FinalizedGroup, int], None] | None = None,
        sensor: TrainerSensor | None = None,
    ):
        self.config = config
        self.policy = policy
        self.version = version
        self.counts = ConsumerCounts()
        self._store = store
        self._on_yield = on_yield
        self._on_evict = on_evict
        self.sensor = sensor if sensor is not None else TrainerSensor()
        self._committed: dict[int, int] = {}
        self._consumer = Consumer(
            kafka.consumer(config.consumer_group, **{"session.timeout.ms": config.session_timeout_ms})
        )
        self._consumer.subscribe(
            [config.finalized_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )
        self._pending: dict[int, dict[int, _Pending]] = {}  # partition -> offset -> pending
        self._positions: dict[int, int] = {}
        # Group ids already taken in, oldest forgotten first past max_seen_groups.
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._paused: set[int] = set()
        self._replay = AckedProducer(kafka) if config.stale_replay else None

    # ----- version and intake -----------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The trainer's current weight version; held groups are re-decided (some become usable, some stale)."""
        if version < self.version:
            raise InvalidArgument(f"weight version went backwards: {self.version} -> {version}")
        self.version = version
        for part in list(self._pending):
            for p in list(self._pending[part].values()):
                if p.state == "held":
                    self._decide(p)
        self._apply_backpressure()

    def _on_assign(self, consumer, partitions) -> None:
        # librdkafka keeps a partition's paused state across revoke and re-assign.
        consumer.resume(partitions)

    def _on_revoke(self, consumer, partitions) -> None:
        for tp in partitions:
            for p in self._pending.pop(tp.partition, {}).values():
                # A yielded group stays "seen": if its record is read again it must not be yielded twice.
                if p.state != "yielded":
                    self._seen.pop(p.group.group_id, None)
            self._positions.pop(tp.partition, None)
            self._committed.pop(tp.partition, None)
            self._paused.discard(tp.partition)

    def poll(self, timeout_s: float = 0.1) -> int:
        """Fetch new finalized records and decide each; returns how many were read."""
        msgs = self._consumer.consume(self.config.max_poll_records, timeout_s)
        for m in msgs:
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(m.error())
            self._positions[m.partition()] = m.offset() + 1
            try:
                group = FinalizedGroup.from_bytes(m.value())
            except SchemaError as exc:
                # The reassembler only writes valid records; count and skip anything else.
                self.counts.undecodable += 1
                log.warning("skipped an undecodable record at %s[%d]@%d: %s", m.topic(), m.partition(), m.offset(), exc)
                continue
            if group.group_id in self._seen:
                self.counts.duplicates += 1
                self.sensor.on_duplicate()
                continue
            self._seen[group.group_id] = None
            if len(self._seen) > self.config.max_seen_groups:
                self._seen.popitem(last=False)
            pending = _Pending(group, m.partition(), m.offset(), "held")
            self._pending.setdefault(m.partition(), {})[m.offset()] = pending
            self._decide(pending)
        self._commit_resolved()
        self._apply_backpressure()
        return len(msgs)

    def _apply_backpressure(self) -> None:
        """Stop fetching while too many groups wait (held or ready); a group that could be used is never
        held back by pausing one partition behind another's far-ahead group."""
        self._update_waiting()
        waiting, limit = self.counts.waiting, self.config.max_waiting_groups
        assignment = self._consumer.assignment()
        if not self._paused and waiting >= limit and assignment:
            self._consumer.pause(assignment)
            self._paused = {tp.partition for tp in assignment}
        elif self._paused and waiting < limit:
            self._consumer.resume(assignment)
            self._paused = set()

    def _decide(self, p: _Pending) -> None:
        decision = self.policy.decide(p.group, self.version)
        if decision is Decision.YIELD:
            p.state = "ready"
        elif decision is Decision.EVICT:
            self._evict(p)

    def _evict(self, p: _Pending) -> None:
        self._store.clear(self.config.train_partition, list(p.group.sample_ids))
        if self._replay is not None:
            topic = self.config.topics.replay(self.config.stale_replay)
            self._replay.send([Outgoing(topic, p.group.group_id.encode(), p.group.to_bytes())])
        self.counts.evicted_stale += 1
        self.sensor.on_evict()
        del self._pending[p.partition][p.offset]
        if self._on_evict is not None:
            self._on_evict(p.group, self.version)

    # ----- batches ------------------------------------------------------------------------------

    def _ready(self) -> list[_Pending]:
        ready = [p for part in self._pending.values() for p in part.values() if p.state == "ready"]
        by_id = {p.group.group_id: p for p in ready}
        return [by_id[g.group_id] for g in self.policy.order([p.group for p in ready])]

    def next_batch(self, num_groups: int, timeout_s: float) -> TrainBatch | None:
        """Up to num_groups usable groups with their padded tensors, waiting at most timeout_s for any."""
        if num_groups < 1:
            raise InvalidArgument(f"num_groups must be >= 1, got {num_groups}")
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self._ready()
            if len(ready) >= num_groups or (ready and time.monotonic() >= deadline):
                batch = self._fetch(ready[:num_groups])
                if batch is not None:
                    return batch
                continue
            if time.monotonic() >= deadline:
                self._update_waiting()
                return None
            self.poll(min(0.1, max(0.0, deadline - time.monotonic())))

    def _fetch(self, chosen: list[_Pending]) -> TrainBatch | None:
        ids = [s for p in chosen for s in p.group.sample_ids]
        try:
            fields = self._store.get(self.config.train_partition, ids)
        except MissingKeysError as exc:
            # Rows already cleared: the group was released before a restart whose offsets had not
            # yet passed it. It was consumed once; drop it rather than train on it twice.
            missing = set(exc.missing)
            for p in chosen:
                if any(s in missing for s in p.group.sample_ids):
                    log.info("group %s: rows already cleared (released before a restart); dropped", p.group.group_id)
                    self.counts.missing_rows += 1
                    self._store.clear(self.config.train_partition, list(p.group.sample_ids))
                    del self._pending[p.partition][p.offset]
            self._commit_resolved()
            return None
        tags = [t for p in chosen for t in p.group.tags]
        tensors = unpack_payload(fields, tags, pad_value_dict=self.config.pad_value_dict)
        for p in chosen:
            p.state = "yielded"
            self.sensor.on_yield(self.version, p.group.group_min_wv)
            if self._on_yield is not None:
                self._on_yield(p.group, self.version)
        self.counts.yielded += len(chosen)
        self._update_waiting()
        return TrainBatch(
            self.version,
            tuple(p.group for p in chosen),
            tuple(ids),
            tuple(tags),
            tensors,
            tuple((p.partition, p.offset) for p in chosen),
        )

    def release(self, batch: TrainBatch) -> None:
        """The trainer is done with the batch: clear its rows from TQ and commit what is now resolved."""
        self._store.clear(self.config.train_partition, list(batch.sample_ids))
        for part, offset in batch.positions:
            self._pending.get(part, {}).pop(offset, None)
        self._commit_resolved()

    def _commit_resolved(self) -> None:
        offsets = []
        for part, position in self._positions.items():
            pending = self._pending.get(part)
            safe = min(pending) if pending else position
            if self._committed.get(part) != safe:
                offsets.append(TopicPartition(self.config.finalized_topic, part, safe))
        if offsets:
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
                self._committed.update((tp.partition, tp.offset) for tp in offsets)
            except KafkaException as exc:
                # A commit that loses a race with a rebalance is retried by the next call.
                if exc.args[0].code() not in _RETRY_COMMIT:
                    raise

    def _update_waiting(self) -> None:
        waiting = [p for part in self._pending.values() for p in part.values() if p.state in ("held", "ready")]
        self.counts.waiting = len(waiting)
        self.counts.ahead = sum(
            1 for p in waiting if p.state == "held" and self.policy.too_far_ahead(p.group, self.version)
        )

    def close(self) -> None:
        self._consumer.close()
        if self._replay is not None:
            self._replay.close()
