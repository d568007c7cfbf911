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

from confluent_kafka import KafkaException, TopicPartition

from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.producer import Outgoing
from streams.runtime import REAL_RUNTIME, Runtime
from streams.tq import KVStore
from workers.telemetry.sensors import TrainerSensor
from workers.trainer.checkpoint import PartitionMark
from workers.trainer.clears import RowClears
from workers.trainer.clients import KafkaTrainerClients, TrainerClients, cooperative
from workers.trainer.commits import Commits
from workers.trainer.config import ConsumerConfig
from workers.trainer.deadletters import MISSING_ROWS, UNDECODABLE_FINALIZED, UNUSABLE_GROUP, make_letter
from workers.trainer.errors import PollErrors
from workers.trainer.lost_rows import HANDED_BACK, lost_rows_notice
from workers.trainer.outbox import Notice, Outbox
from workers.trainer.pending import DUPLICATE, HELD, NEW, READY, REREAD, Pending, PendingGroups
from workers.trainer.policies import Decision, Policy
from workers.trainer.progress import ProgressCarrier
from workers.trainer.starts import COMMITTED_TIMEOUT_S, PartitionStarts

log = logging.getLogger("rlstream.trainer")


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
    # Materializes TQ failed (a deadline, a storage unit silent, a controller failure): the batch given back.
    tq_failures: int = 0
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
    `clients` makes every Kafka client it uses (`clients.py`; a test passes fakes or clients with faults);
    `runtime` (`streams.runtime`) is every clock it reads: select's and next_batch's deadlines, the
    retries of committed offsets that could not be read, record times (a test's or a simulator's moves
    when it says; no setting reaches it).
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
        clients: TrainerClients | None = None,
        runtime: Runtime = REAL_RUNTIME,
    ):
        self.config = config
        self.policy = policy
        self.version = version
        self.counts = ConsumerCounts()
        self._store = store
        self._on_yield = on_yield
        self._on_evict = on_evict
        self.sensor = sensor if sensor is not None else TrainerSensor()
        self.sensor.on_version(version)
        self._runtime = runtime
        # Rows of resolved groups stay until a commit names their records: a durable checkpoint's with
        # checkpoints, else the next commit of the offsets (`clears.py`).
        self._clears = RowClears(store, config.train_partition, deferred=config.checkpointed)
        self._pending = PendingGroups(store, config.train_partition, config.max_seen_groups, clear=self._clears.clear)
        self._run = uuid.uuid4().hex  # tells this consumer's states from a predecessor's
        # A restored checkpoint's marks, per partition, until that partition is first assigned.
        self._restored: dict[int, PartitionMark] = {}
        # Per partition, the last cut of a state that took its restored mark (`state_dict`): such a state
        # may be declared durable once the partition started, and its mark must not be committed then.
        self._restored_cut: dict[int, int] = {}
        self._durable_cut = -1  # the last durable cut of this run: an older one never moves commits back
        self._paused: set[int] = set()
        self._errors = PollErrors(config.finalized_topic, config.consumer_group, config.max_poll_interval_ms)
        self._clients = clients if clients is not None else KafkaTrainerClients(kafka, runtime=runtime)
        self._replay = self._clients.acked_producer() if config.stale_replay else None
        self._outbox = Outbox(self._clients, f"trainer:{config.consumer_group}")
        settings = {
            "session.timeout.ms": config.session_timeout_ms,
            "heartbeat.interval.ms": max(100, config.session_timeout_ms // 3),
            "max.poll.interval.ms": config.max_poll_interval_ms,
        }
        self._consumer = self._clients.consumer(config.consumer_group, settings)
        self._cooperative = cooperative(self._clients.consumer_settings(config.consumer_group, settings))
        # Partitions assigned whose commit is not read yet: paused until it is.
        self._starts = PartitionStarts(config.finalized_topic, runtime.monotonic)
        # Where each commit's resolved ranges go when its metadata cannot hold them, and the commits.
        topic, group = config.finalized_topic, config.consumer_group
        self._progress = ProgressCarrier(
            self._clients, config.topics.trainer_progress, group, topic, self._run, runtime.monotonic, runtime.wall_ms
        )
        self._commits = Commits(
            self._consumer,
            config.finalized_topic,
            self._pending,
            self._clears,
            self._outbox,
            self._progress,
            runtime.monotonic,
        )
        self._consumer.subscribe(
            [config.finalized_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    def _on_assign(self, consumer, partitions) -> None:
        """Assign the partitions paused: each is read once its commit is known (`starts.py`), never before.

        Nothing here waits on the broker: librdkafka runs this inside poll, and a fetch of committed
        offsets that blocks (the coordinator moving) would hold up the rebalance and the heartbeats.
        """
        if self._cooperative:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        # After the assignment: librdkafka keeps an application's pause across assignments (it belongs to the
        # partition), but a partition of a topic the consumer has not been assigned yet cannot be paused
        # before it is, and one it never paused starts fetching as soon as it is assigned.
        consumer.pause(partitions)
        for tp in partitions:
            self._starts.add(tp.partition, self._restored.pop(tp.partition, None))
        self.sensor.on_partitions_waiting(len(self._starts))

    def _settle_starts(self) -> None:
        """Read the commits of partitions assigned since, and start each from its own; retried while they fail."""
        if not self._starts.due():
            return
        waiting = self._starts.waiting()
        topic = self.config.finalized_topic
        try:
            tps = [TopicPartition(topic, p) for p in waiting]
            committed = self._consumer.committed(tps, timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            if exc.args[0].fatal():
                raise
            self.sensor.on_commit_reads_failed(len(waiting))
            self._starts.failed(waiting, exc.args[0].str())
            return
        unread = {tp.partition: tp.error.str() for tp in committed if tp.error is not None}
        read = [tp for tp in committed if tp.error is None and tp.partition in self._starts]
        # The resolved ranges each commit names: inline, or on the progress topic (`progress.py`).
        named = self._progress.read(read)
        for part, reason in named.unreadable.items():
            if self._starts.restored(part):  # a checkpoint's mark says what is resolved: the commit's ranges are moot
                named.ranges[part] = []
            else:
                unread[part] = reason
        started = []
        for tp in read:
            if tp.partition in unread:
                continue
            start = self._starts.known(tp.partition, tp.offset)
            if start.restored is not None:
                self._pending.restore(tp.partition, start.offset, start.resolved)
            else:
                self._pending.assign(tp.partition, tp.offset, named.ranges[tp.partition])
            if start.offset is not None:
                try:
                    self._consumer.seek(TopicPartition(topic, tp.partition, start.offset))
                except KafkaException as exc:  # not where its position says: it waits, and is asked again
                    self._pending.revoke(tp.partition)
                    self._starts.add(tp.partition, start.restored)
                    unread[tp.partition] = f"seek to {start.offset}: {exc.args[0].str()}"
                    continue
            started.append(TopicPartition(topic, tp.partition))
        self.sensor.on_partitions_waiting(len(self._starts))
        if unread:
            self.sensor.on_commit_reads_failed(len(unread))
            self._starts.failed(sorted(unread), "; ".join(sorted(set(unread.values()))))
        else:
            self._starts.settled()
            self._progress.forget()  # what the read of the progress topic found served every start
        if self._paused:  # backpressure holds the whole assignment: they resume with it
            self._paused |= {tp.partition for tp in started}
        elif started:
            self._consumer.resume(started)

    def _on_revoke(self, consumer, partitions) -> None:
        self._revoke(partitions)
        self.sensor.on_partitions_waiting(len(self._starts))

    def _revoke(self, partitions) -> None:
        for tp in partitions:
            mark = self._starts.revoke(tp.partition)
            if mark is not None:  # never started: the mark applies at the partition's next assignment
                self._restored[tp.partition] = mark
            self._pending.revoke(tp.partition)
            self._progress.drop(tp.partition)
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
        self._settle_starts()
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
            time_ms=self._runtime.wall_ms(),
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
            # Not those whose start is still unknown: they resume once it is (`_settle_starts`).
            self._consumer.resume([tp for tp in assignment if tp.partition not in self._starts])
            self._paused = set()

    def _decide(self, p: Pending) -> None:
        decision = self.policy.decide(p.group, self.version)
        if decision is Decision.YIELD:
            p.move(READY)
        elif decision is Decision.HOLD:
            p.move(HELD)
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
                self.config,
                p.group,
                p.partition,
                p.offset,
                lost,
                worker_id=self._outbox.worker_id,
                time_ms=self._runtime.wall_ms(),
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

    def _commit_resolved(self) -> None:
        self._commits.round()

    def _update_waiting(self) -> None:
        waiting = [p for p in self._pending.all_pending() if p.state.waiting]
        self.counts.waiting = len(waiting)
        self.counts.ahead = sum(
            1 for p in waiting if p.state is HELD and self.policy.too_far_ahead(p.group, self.version)
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
            self._progress.close()
            if self._replay is not None:
                self._replay.close()
