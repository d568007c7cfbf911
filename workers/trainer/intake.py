"""The trainer consumer's intake: finalized records read read_committed, decided by policy, committed.

A partition's committed offset never passes a record not yet resolved (`position.py`): a group held,
ready, or handed out and not acked, a duplicate waiting for its original, a dead letter not yet
acknowledged. Records the trainer cannot use go to its dead-letter topic (`deadletters.py`). With
checkpoints (`checkpoint.py`) offsets move only with durable checkpoints, and rows of resolved
groups stay until one covers them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import KVStore
from workers.telemetry.sensors import TrainerSensor
from workers.trainer.checkpoint import PartitionMark
from workers.trainer.clears import RowClears
from workers.trainer.config import ConsumerConfig
from workers.trainer.deadletters import MISSING_ROWS, UNDECODABLE_FINALIZED, UNUSABLE_GROUP, make_letter
from workers.trainer.errors import PollErrors
from workers.trainer.lost_rows import HANDED_BACK, lost_rows_notice
from workers.trainer.outbox import Notice, Outbox
from workers.trainer.pending import DUPLICATE, NEW, REREAD, Pending, PendingGroups
from workers.trainer.policies import Decision, Policy

log = logging.getLogger("rlstream.trainer")

# Commit failures that lose a race with a rebalance (or follow a max.poll.interval.ms leave).
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
    # Records of a group id already taken in, at another position (re-published, re-finalized).
    duplicates: int = 0
    # Groups never consumed whose rows were missing from TQ: handed back for regeneration, else dead-lettered.
    missing_rows: int = 0
    # Of those, the groups handed back (`lost_rows.py`).
    handed_back: int = 0
    # Groups handed out that the trainer could not use, dead-lettered (`ExperienceConsumer.dead_letter`).
    unusable: int = 0
    undecodable: int = 0
    # Records read again that were resolved already: after a rebalance, or before a restart (commit metadata).
    reread: int = 0
    # Groups taken in that will never be trained (evicted as stale, rows missing, unusable), each once:
    # what `VersionPublisher` tells admission gates, which give their capacity back.
    lost: int = 0
    waiting: int = 0
    # Held groups more than the in_order lookahead ahead of the trainer (held, not dropped).
    ahead: int = 0


class FinalizedIntake:
    """The Kafka side of the trainer's consumer: read finalized records, decide each by policy, commit.

    `ExperienceConsumer` (consumer.py) adds what the trainer calls on top of it.
    `sensor` gets every yield (with its staleness), eviction, duplicate, undecodable record and group
    with missing rows, e.g. a `PrometheusTrainerSensor`; `on_yield` / `on_evict` get the group itself.
    `make_consumer` builds the Kafka consumer from its settings (a test passes one with faults).
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
        make_consumer: Callable[[dict[str, object]], Consumer] = Consumer,
    ):
        self.config = config
        self.policy = policy
        self.version = version
        self.counts = ConsumerCounts()
        self._store = store
        self._on_yield = on_yield
        self._on_evict = on_evict
        self.sensor = sensor if sensor is not None else TrainerSensor()
        # Rows of resolved groups stay until a commit names their records: a durable checkpoint's with
        # checkpoints, else the next commit of the offsets (`clears.py`).
        self._clears = RowClears(store, config.train_partition, deferred=config.checkpointed)
        self._pending = PendingGroups(store, config.train_partition, config.max_seen_groups, clear=self._clears.clear)
        self._run = uuid.uuid4().hex  # tells this consumer's states from a predecessor's
        # A restored checkpoint's marks, per partition, until that partition is first assigned.
        self._restored: dict[int, PartitionMark] = {}
        self._durable_cut = -1  # the last durable cut of this run: an older one never moves commits back
        # A durable checkpoint's commits, until done: one naming its records, its rows, then its marks.
        self._naming: list[tuple[int, int, str]] = []
        self._release_cut: int | None = None
        self._durable: list[tuple[int, int, str]] = []
        self._paused: set[int] = set()
        self._errors = PollErrors(config.finalized_topic, config.consumer_group, config.max_poll_interval_ms)
        self._replay = AckedProducer(kafka) if config.stale_replay else None
        self._outbox = Outbox(kafka, f"trainer:{config.consumer_group}")
        settings = {
            "session.timeout.ms": config.session_timeout_ms,
            "heartbeat.interval.ms": max(100, config.session_timeout_ms // 3),
            "max.poll.interval.ms": config.max_poll_interval_ms,
        }
        self._consumer = make_consumer(kafka.consumer(config.consumer_group, **settings))
        self._consumer.subscribe(
            [config.finalized_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    def _on_assign(self, consumer, partitions) -> None:
        # librdkafka keeps a partition's paused state across revoke and re-assign.
        consumer.resume(partitions)
        topic = self.config.finalized_topic
        if self._restored:
            partitions = self._start_from_state(consumer, partitions)
            if not partitions:
                return
        try:
            committed = consumer.committed(partitions, timeout=30)
        except KafkaException as exc:
            log.warning("%s: committed offsets unreadable (%s); consumed groups may be reported missing", topic, exc)
            return
        for tp in committed:
            try:
                self._pending.assign(tp.partition, tp.offset, tp.metadata)
            except ValueError as exc:
                log.warning("%s[%d]: %s; consumed groups may be reported missing", topic, tp.partition, exc)

    def _on_revoke(self, consumer, partitions) -> None:
        for tp in partitions:
            self._pending.revoke(tp.partition)
            # A letter dropped unsent is written again when its record is read again: that record
            # must not then pass as one already consumed.
            self._pending.forget_seen(tp.partition, self._outbox.offsets(tp.partition))
            # Its missing-rows groups are read and counted again by whoever reads the partition next;
            # what a gate reads does not go down with this (VersionPublisher keeps the highest count sent).
            dropped = [n.kind for n in self._outbox.drop(tp.partition)]
            self.counts.lost -= sum(1 for kind in dropped if kind in (MISSING_ROWS, HANDED_BACK, UNUSABLE_GROUP))
            self.counts.handed_back -= dropped.count(HANDED_BACK)
            self.counts.unusable -= dropped.count(UNUSABLE_GROUP)
            self._clears.drop(tp.partition)
            self._paused.discard(tp.partition)

    def poll(self, timeout_s: float = 0.1) -> int:
        """Fetch new finalized records and decide each; returns how many were read."""
        read = 0
        # librdkafka's consume(n, t) returns once it has n records or t has passed: asked for a batch,
        # a select waiting for one group would wake only when its poll interval ran out. So wait for
        # the first record alone, then take what else has arrived without waiting.
        msgs = self._consumer.consume(1, timeout_s)
        if msgs and self.config.max_poll_records > 1:
            msgs += self._consumer.consume(self.config.max_poll_records - 1, 0)
        for m in msgs:
            if m.error() is not None:
                self._errors.handle(m.error())
                continue
            read += 1
            self._take(m)
        self._resolve_letters()
        self._apply_backpressure()
        return read

    def _take(self, m) -> None:
        part, offset = m.partition(), m.offset()
        resolved_before = self._pending.read(part, offset)
        try:
            group = FinalizedGroup.from_bytes(m.value())
        except SchemaError as exc:
            if not resolved_before:  # else dead-lettered already, before a restart
                self._undecodable(m, exc)
            return
        outcome, pending = self._pending.take(group, part, offset, resolved_before=resolved_before)
        if outcome == NEW and pending is not None:
            self._decide(pending)
        elif outcome == REREAD:
            self.counts.reread += 1
            if resolved_before:
                # Consumed before a restart (the commit or the checkpoint names it): a predecessor that
                # died before clearing its rows would otherwise leave them forever.
                self._clears.clear(list(group.sample_ids), part, offset)
        elif outcome == DUPLICATE:
            self.counts.duplicates += 1
            self.sensor.on_duplicate()
            log.warning(
                "duplicate finalized record of group %s at %s[%d]@%d: not yielded again",
                group.group_id,
                self.config.finalized_topic,
                part,
                offset,
            )

    def _undecodable(self, m, exc: SchemaError) -> None:
        part, offset, key = m.partition(), m.offset(), m.key()
        where = f"{m.topic()}[{part}]@{offset}"
        topic = self.config.topics.trainer_deadletter
        log.error("undecodable finalized record at %s (key %r): %s; sent to %s", where, key and key[:80], exc, topic)
        self.counts.undecodable += 1
        self.sensor.on_undecodable()
        letter = make_letter(
            m.topic(),
            part,
            offset,
            key,
            m.value(),
            UNDECODABLE_FINALIZED,
            f"{where}: {exc}",
            worker_id=self._outbox.worker_id,
        )
        notice = Notice(topic, letter.source_key, letter.to_bytes(), UNDECODABLE_FINALIZED, where)
        self._outbox.add(part, offset, notice)

    def _resolve_letters(self) -> None:
        """Resolve the records whose dead letters were acknowledged, and commit what is now resolved."""
        for part, offset in self._outbox.flush():
            self._pending.resolve_offset(part, offset)
        self._commit_resolved()

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

    def _decide(self, p: Pending) -> None:
        decision = self.policy.decide(p.group, self.version)
        if decision is Decision.YIELD:
            p.state = "ready"
        elif decision is Decision.HOLD:
            p.state = "held"
        else:
            self._evict(p)

    def _evict(self, p: Pending) -> None:
        self._clears.clear(list(p.group.sample_ids), p.partition, p.offset)
        if self._replay is not None:
            topic = self.config.topics.replay(self.config.stale_replay)
            self._replay.send([Outgoing(topic, p.group.group_id.encode(), p.group.to_bytes())])
        self.counts.evicted_stale += 1
        self.counts.lost += 1
        self.sensor.on_evict()
        self._pending.resolved(p)
        self._pending.group_resolved(p.group)
        if self._on_evict is not None:
            self._on_evict(p.group, self.version)

    def _missing_rows(self, chosen: list[Pending], missing: set[str]) -> None:
        """Groups whose rows are missing from TQ and were never consumed: handed back, else dead-lettered.

        A group consumed already never gets here: one resolved by this consumer is "seen" as resolved
        (its record read again is a duplicate), one resolved before a restart is named by the commit
        metadata. So rows missing here were lost (TQ died with the job, cleared by someone else).
        """
        for p in chosen:
            lost = [s for s in p.group.sample_ids if s in missing]
            if not lost:
                continue
            notice, message = lost_rows_notice(
                self.config, p.group, p.partition, p.offset, lost, worker_id=self._outbox.worker_id
            )
            self.counts.missing_rows += 1
            self.counts.lost += 1
            self.sensor.on_missing_rows()
            if notice.kind == HANDED_BACK:
                log.warning("%s", message)
                self.counts.handed_back += 1
                self.sensor.on_handed_back()
            else:
                log.error("%s", message)
            self._clears.clear(list(p.group.sample_ids), p.partition, p.offset)
            # Unresolved until its notice is acknowledged: the outbox holds the commit back instead.
            self._pending.set_aside(p)
            self._outbox.add(p.partition, p.offset, notice)
            self._pending.group_resolved(p.group)
        self._resolve_letters()

    def _commit_durable(self) -> None:
        """A durable checkpoint's commits: first one naming its records without passing them, then (their
        rows cleared) its marks; each step retried by the next call until it is done."""
        what = f"{self.config.finalized_topic} offsets of a durable checkpoint"
        if self._naming and not self._commit(self._naming, what):
            return
        self._naming = []
        if self._release_cut is not None:
            self._clears.release_through(self._release_cut)
            self._release_cut = None
        if self._durable and self._commit(self._durable, what):
            self._durable = []

    def _commit(self, points: list[tuple[int, int, str]], what: str) -> bool:
        """Commit (partition, offset, metadata) points; False, logged, when the broker refuses them for now."""
        if not points:
            return True
        topic = self.config.finalized_topic
        offsets = [TopicPartition(topic, part, offset, metadata=metadata) for part, offset, metadata in points]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.fatal():
                raise
            # Retried by the next call; a record read again meanwhile is known to be resolved.
            level = logging.DEBUG if err.code() in _RETRY_COMMIT else logging.WARNING
            log.log(level, "commit of %s failed, retrying later: %s", what, err.str())
            return False
        for part, offset, metadata in points:
            self._pending.committed(part, offset, metadata)
        return True

    def _start_from_state(self, consumer, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Seek the partitions a restored state names to where it says; the rest start from their commits.

        A mark applies at its partition's first assignment only: later ones (a rebalance, a rejoin
        after a long step) resume from the commits, and what this consumer trained since is known to
        it as seen. Records between the last commit and the mark were resolved before the state was
        cut, but a crash between saving the checkpoint and `checkpoint_durable` would leave their rows:
        they are read again as resolved, and their rows cleared with the next durable checkpoint.
        """
        named = [tp for tp in partitions if tp.partition in self._restored]
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(named, timeout=30)}
        except KafkaException as exc:
            log.warning("committed offsets unreadable (%s): rows of groups trained before the checkpoint may stay", exc)
            committed = {}
        for tp in named:
            mark = self._restored.pop(tp.partition)
            start = min(mark.offset, max(0, committed.get(tp.partition, mark.offset)))
            before = [(start, mark.offset - 1)] if start < mark.offset else []
            self._pending.restore(tp.partition, start, before + list(mark.trained))
            tp.offset = start
        consumer.assign(partitions)
        restored = {tp.partition for tp in named}
        return [tp for tp in partitions if tp.partition not in restored]

    def _commit_resolved(self) -> None:
        """Commit what is resolved; rows waiting for a commit naming their records go after it, and the
        offset passes those records with the next commit (`clears.py`)."""
        if self._clears.deferred:  # offsets move with durable checkpoints only
            self._commit_durable()
            return
        topic = self.config.finalized_topic
        held = self._clears.held
        if not self._commit(self._pending.commit_points(topic, self._outbox.offsets, held), f"{topic} offsets"):
            return
        if self._clears.release_named(self._pending.named):
            self._commit(self._pending.commit_points(topic, self._outbox.offsets, held), f"{topic} offsets")

    def _update_waiting(self) -> None:
        waiting = [p for p in self._pending.all_pending() if p.state in ("held", "ready")]
        self.counts.waiting = len(waiting)
        self.counts.ahead = sum(
            1 for p in waiting if p.state == "held" and self.policy.too_far_ahead(p.group, self.version)
        )

    def close(self) -> None:
        # Letters sent but not yet acknowledged get a moment, so their records are committed past.
        try:
            for part, offset in self._outbox.flush(timeout_s=5.0):
                self._pending.resolve_offset(part, offset)
            self._commit_resolved()
        except Exception as exc:  # noqa: BLE001 - the Kafka member must go whatever TQ does
            log.warning(
                "closing with %d row(s) of resolved records not cleared (%s: %s); the next trainer clears"
                " those the commits name when it reads their records again",
                self._clears.kept_rows,
                type(exc).__name__,
                exc,
            )
        finally:
            self._consumer.close()
            self._outbox.close()
            if self._replay is not None:
                self._replay.close()
