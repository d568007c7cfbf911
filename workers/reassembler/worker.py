"""The reassembler worker: a consumer-group member that turns receipts into finalized groups exactly once.

Each step polls receipts, finalizes the groups that completed or passed their deadline, and commits
one Kafka transaction holding the finalized records, dead letters, state-changelog entries and the
input offsets. Any failure inside a step aborts it and rebuilds the worker's state from the committed
offsets and the state topic, so a step either happened entirely or not at all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas import deadletter as dl
from schemas.deadletter import DeadLetter
from schemas.errors import SchemaError
from schemas.metadata_guard import MetadataViolation, assert_metadata_only
from schemas.receipt import Receipt
from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, OPEN, GroupState
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import Outgoing, TransactionalProducer, is_fatal, is_fenced
from streams.tq import KVStore
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.finalize import GroupOutcome, finalize_groups
from workers.reassembler.groups import PROGRESS_KEY, Added, OpenGroup, PartitionGroups

log = logging.getLogger("rlstream.reassembler")

# Header `rlstream deadletter redrive` puts on a re-published record: how many times it was redriven.
REDRIVE_HEADER = "rlstream.redrive_count"


def redrive_count(headers) -> int:
    """The redrive count a record carries in its headers (0 when it was never redriven)."""
    for key, value in headers or ():
        if key == REDRIVE_HEADER:
            try:
                return max(0, int(bytes(value or b"0").decode()))
            except ValueError:
                return 0
    return 0


@dataclass
class WorkerStats:
    receipts: int = 0
    finalized: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    transactions: int = 0
    aborts: int = 0
    paused: bool = False
    open_groups: int = 0
    finalize_seconds: list[float] = field(default_factory=list)


def classify(value: bytes | None) -> tuple[Receipt | None, str | None, str | None]:
    """Decode and check one receipt at the boundary: (receipt, None, None) or (None, error kind, message)."""
    if value is None:
        return None, dl.DECODE_ERROR, "receipt: empty record value"
    try:
        raw = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as exc:
        return None, dl.DECODE_ERROR, f"receipt: not MessagePack ({type(exc).__name__}: {exc})"[:500]
    try:
        assert_metadata_only(raw, path="receipt")
    except MetadataViolation as exc:
        return None, dl.METADATA_VIOLATION, str(exc)
    try:
        return Receipt.from_bytes(value), None, None
    except SchemaError as exc:
        return None, dl.VALIDATION_ERROR, str(exc)


class WorkerFenced(RuntimeError):
    """A newer worker with the same transactional id exists; this one must stop, not fence it back."""


@dataclass(frozen=True)
class ClosedNote:
    """A group closed in a transaction, remembered until its staging keys are cleared."""

    partition: int
    group_id: str
    staging_keys: tuple[str, ...]
    last_offset: int
    outcome: str


def _cleared(note: ClosedNote) -> GroupState:
    """The closed entry again, without staging keys: nothing is left to clear after a restart."""
    return GroupState(
        group_id=note.group_id,
        status=CLOSED,
        partition=note.partition,
        first_offset=0,
        last_offset=note.last_offset,
        first_seen_ms=0,
        outcome=note.outcome,
        finalized_at_ms=int(time.time() * 1000),
    )


def _crash_here(config: ReassemblerConfig, point: str) -> None:
    if config.crash_point == point:
        os.kill(os.getpid(), signal.SIGKILL)


class ReassemblerWorker:
    """One consumer-group member; `run` loops `step` until stopped."""

    def __init__(self, kafka: KafkaConfig, store: KVStore, config: ReassemblerConfig, *, metrics=None):
        self.kafka = kafka
        self.store = store
        self.config = config
        self.stats = WorkerStats()
        # An optional workers.metrics.ReassemblerMetrics, updated after each committed step.
        self.metrics = metrics
        # (partition, offset) -> redrive count of buffered receipts that arrived redriven.
        self._redriven: dict[tuple[int, int], int] = {}
        self.parts: dict[int, PartitionGroups] = {}
        self._positions: dict[int, int] = {}
        self._max_ts: dict[int, int] = {}
        self._pending_done: list[GroupState] = []
        self._dirty: set[int] = set()
        self._producer = TransactionalProducer(
            kafka, config.transactional_id, transaction_timeout_ms=config.transaction_timeout_ms
        )
        self._consumer = Consumer(
            kafka.consumer(
                config.consumer_group,
                **{
                    "session.timeout.ms": config.session_timeout_ms,
                    "heartbeat.interval.ms": max(100, config.session_timeout_ms // 6),
                    "max.poll.interval.ms": max(60_000, config.session_timeout_ms),
                    "client.id": config.transactional_id,
                },
            )
        )
        self._consumer.subscribe(
            [config.receipts_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    # ----- rebalance -------------------------------------------------------------------------

    def _on_assign(self, consumer, partitions) -> None:
        for tp in partitions:
            self._restore(tp.partition)
        log.info("%s assigned %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer, partitions) -> None:
        for tp in partitions:
            self.parts.pop(tp.partition, None)
            self._positions.pop(tp.partition, None)
            self._max_ts.pop(tp.partition, None)
            self._redriven = {k: v for k, v in self._redriven.items() if k[0] != tp.partition}
            self._dirty.discard(tp.partition)
        self._pending_done = [s for s in self._pending_done if s.partition in self.parts]
        log.info("%s revoked %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def _restore(self, partition: int) -> None:
        """Rebuild a partition's closed/open bookkeeping from the state topic, then finish pending clears."""
        groups = PartitionGroups(partition)
        # A fetch of committed offsets waits until a predecessor's open transaction (holding offsets
        # for this partition) commits or aborts, so the state read below includes its outcome.
        self._consumer.committed(
            [TopicPartition(self.config.receipts_topic, partition)],
            timeout=self.config.transaction_timeout_ms / 1000 + 30,
        )
        for rec in read_topic(self.kafka, self.config.topics.state, partitions=[partition]):
            if rec.value is None:
                continue
            groups.restore(GroupState.from_bytes(rec.value))
        self.parts[partition] = groups
        for gid, (keys, outcome) in list(groups.pending_clear.items()):
            # Closed by a predecessor that died before clearing staging: clear now, record it next commit.
            if self.config.clear_staging:
                self.store.clear(self.config.actor.staging_partition, list(keys))
            self._pending_done.append(_cleared(ClosedNote(partition, gid, keys, groups.closed[gid], outcome)))
            del groups.pending_clear[gid]

    # ----- the step --------------------------------------------------------------------------

    def step(self) -> int:
        """Poll, finalize what is ready, commit one transaction; returns the number of records consumed."""
        msgs = self._consumer.consume(self.config.max_poll_records, self.config.poll_timeout_s)
        now_ms = int(time.time() * 1000)
        dead: list[DeadLetter] = []
        state_out: list[GroupState] = []
        ready: dict[str, OpenGroup] = {}
        consumed = 0
        for m in msgs:
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(m.error())
            groups = self.parts.get(m.partition())
            if groups is None:
                continue
            consumed += 1
            self._intake(groups, m, now_ms, dead, state_out, ready)
            self._positions[m.partition()] = m.offset() + 1
            self._max_ts[m.partition()] = max(self._max_ts.get(m.partition(), 0), m.timestamp()[1])
            self._dirty.add(m.partition())
        self.stats.receipts += consumed
        if self.metrics is not None and consumed:
            self.metrics.receipts_consumed.inc(consumed)
        timeout_ms = int(self.config.group_timeout_s * 1000)
        for groups in self.parts.values():
            for g in groups.due(self._clock(groups.partition, now_ms), timeout_ms):
                ready.setdefault(g.group_id, g)
                self._dirty.add(groups.partition)
        if ready or dead or state_out or self._pending_done or self._dirty:
            self._commit_step(list(ready.values()), dead, state_out, now_ms)
        self._apply_backpressure()
        if self.metrics is not None:
            self._update_gauges()
        return consumed

    def _update_gauges(self) -> None:
        self.metrics.open_groups.set(self.stats.open_groups)
        lags = {}
        for part, position in self._positions.items():
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.config.receipts_topic, part), cached=True
            ) or (0, -1)
            if high >= 0:
                lags[part] = high - position
        self.metrics.set_lag(self.config.receipts_topic, lags)

    def _clock(self, partition: int, now_ms: int) -> int:
        """Deadline clock of a partition: wall time once caught up, else the newest receipt's timestamp.

        A worker that restarts with a backlog would otherwise find every group past its deadline
        although the missing receipts are already in Kafka, just not read yet. While paused for
        backpressure nothing new is read, so wall time runs: deadlines are what frees memory then.
        """
        if self.stats.paused:
            return now_ms
        position = self._positions.get(partition)
        if position is None:
            return self._max_ts.get(partition, 0)
        _, high = self._consumer.get_watermark_offsets(
            TopicPartition(self.config.receipts_topic, partition), cached=True
        ) or (0, -1)
        if high < 0 or position >= high:
            return now_ms
        return self._max_ts.get(partition, 0)

    def _intake(self, groups: PartitionGroups, m, now_ms: int, dead: list, state_out: list, ready: dict) -> None:
        offset, replay = m.offset(), groups.replaying(m.offset())
        receipt, kind, message = classify(m.value())
        if receipt is None:
            if not replay:
                dead.append(self._dead_letter(m, kind, message, now_ms))
            return
        redriven = redrive_count(m.headers())
        if redriven and not replay:
            # A redriven receipt of a group that was dead-lettered (never finalized) reopens it: the
            # operator fixed the cause, and nothing of that group reached the trainer.
            groups.reopen_dead_lettered(receipt.group_id)
        outcome, group = groups.add(receipt, offset, m.timestamp()[1], (m.key(), m.value()))
        if redriven and outcome in (Added.ADDED, Added.COMPLETED):
            self._redriven[(groups.partition, offset)] = redriven
        if outcome in (Added.ADDED, Added.COMPLETED):
            if group.first_offset == offset and not replay:
                state_out.append(
                    GroupState(
                        group_id=group.group_id,
                        status=OPEN,
                        partition=groups.partition,
                        first_offset=offset,
                        last_offset=offset,
                        first_seen_ms=group.first_seen_ms,
                    )
                )
            if outcome is Added.COMPLETED:
                ready[group.group_id] = group
        elif outcome is not Added.REPLAYED_CLOSED and not replay:
            kinds = {
                Added.DUPLICATE: dl.DUPLICATE_RECEIPT,
                Added.INCONSISTENT: dl.INCONSISTENT_GROUP,
                Added.LATE: dl.LATE_RECEIPT,
            }
            dead.append(
                self._dead_letter(
                    m,
                    kinds[outcome],
                    f"receipt {receipt.rollout_id} of group {receipt.group_id}: {outcome.value}",
                    now_ms,
                )
            )

    def _dead_letter(self, m, kind: str, message: str, now_ms: int) -> DeadLetter:
        return DeadLetter(
            source_topic=m.topic(),
            source_partition=m.partition(),
            source_offset=m.offset(),
            source_key=m.key(),
            original=m.value() or b"",
            error_kind=kind,
            message=message,
            worker_id=self.config.worker_id,
            time_ms=now_ms,
            redrive_count=redrive_count(m.headers()),
        )

    def _commit_step(
        self, ready: list[OpenGroup], dead: list[DeadLetter], state_out: list[GroupState], now_ms: int
    ) -> None:
        t0 = time.perf_counter()
        closed: list[ClosedNote] = []
        try:
            outcomes = (
                finalize_groups(
                    self.store, ready, self.config.actor, receipts_topic=self.config.receipts_topic, now_ms=now_ms
                )
                if ready
                else []
            )
            _crash_here(self.config, "after_tq_put")
            closed = self._close(outcomes, dead, state_out, now_ms)
            self._transact(outcomes, dead, state_out, now_ms)
        except KafkaException as exc:
            self._recover(exc)
            return
        _crash_here(self.config, "after_commit")
        self.stats.finalize_seconds.append(time.perf_counter() - t0)
        if self.metrics is not None:
            if ready:
                self.metrics.finalize_latency.observe(time.perf_counter() - t0)
            self.metrics.groups_finalized.inc(sum(1 for o in outcomes if o.finalized is not None))
            for d in dead:
                self.metrics.dead_letters.labels(d.error_kind).inc()
        self._after_commit(closed)

    def _close(
        self, outcomes: list[GroupOutcome], dead: list[DeadLetter], state_out: list[GroupState], now_ms: int
    ) -> list[ClosedNote]:
        """Close groups in memory and add their dead letters and closed-state entries to the outputs."""
        closed = []
        for o in outcomes:
            g = self.parts[o.group.partition].close(o.group.group_id, dead_lettered=o.finalized is None)
            if o.dead_letter_kind is not None:
                for idx, (key, value) in sorted(g.raw.items()):
                    dead.append(
                        DeadLetter(
                            source_topic=self.config.receipts_topic,
                            source_partition=g.partition,
                            source_offset=g.offsets[idx],
                            source_key=key,
                            original=value,
                            error_kind=o.dead_letter_kind,
                            message=o.dead_letter_message or "",
                            worker_id=self.config.worker_id,
                            time_ms=now_ms,
                            redrive_count=self._redriven.get((g.partition, g.offsets[idx]), 0),
                        )
                    )
            for offset in g.offsets.values():
                self._redriven.pop((g.partition, offset), None)
            keys = o.staging_keys if self.config.clear_staging else ()
            note = ClosedNote(
                g.partition, g.group_id, keys, g.last_offset, FINALIZED if o.finalized is not None else DEAD_LETTERED
            )
            state_out.append(
                GroupState(
                    group_id=g.group_id,
                    status=CLOSED,
                    partition=g.partition,
                    first_offset=g.first_offset,
                    last_offset=g.last_offset,
                    first_seen_ms=g.first_seen_ms,
                    outcome=note.outcome,
                    finalized_at_ms=now_ms,
                    staging_keys=keys,
                )
            )
            closed.append(note)
        return closed

    def _transact(
        self, outcomes: list[GroupOutcome], dead: list[DeadLetter], state_out: list[GroupState], now_ms: int
    ) -> None:
        topics = self.config.topics
        p = self._producer
        p.begin()
        for o in outcomes:
            if o.finalized is not None:
                p.produce(Outgoing(topics.finalized, o.group.group_id.encode(), o.finalized.to_bytes()))
        for d in dead:
            p.produce(Outgoing(topics.deadletter, d.source_key, d.to_bytes()))
        # Cleared-closed entries first: a redriven receipt may reopen the same group in this step,
        # and its OPEN entry must be the one compaction keeps.
        for s in self._pending_done + state_out:
            p.produce(Outgoing(topics.state, s.group_id.encode(), s.to_bytes(), partition=s.partition))
        offsets = []
        for part in sorted(self._dirty):
            groups = self.parts.get(part)
            position = self._positions.get(part)
            if groups is None or position is None:
                continue
            p.produce(
                Outgoing(
                    topics.state,
                    PROGRESS_KEY.encode(),
                    groups.progress_entry(position, now_ms).to_bytes(),
                    partition=part,
                )
            )
            offsets.append(TopicPartition(self.config.receipts_topic, part, groups.safe_offset(position)))
        if offsets:
            p.send_offsets(offsets, self._consumer.consumer_group_metadata())
        _crash_here(self.config, "before_commit")
        p.commit()
        self.stats.transactions += 1
        self.stats.finalized += sum(1 for o in outcomes if o.finalized is not None)
        for d in dead:
            self.stats.dead_letters[d.error_kind] = self.stats.dead_letters.get(d.error_kind, 0) + 1
        self._pending_done = []
        self._dirty.clear()

    def _after_commit(self, closed: list[ClosedNote]) -> None:
        keys = [k for note in closed for k in note.staging_keys]
        if keys:
            self.store.clear(self.config.actor.staging_partition, keys)
        self._pending_done.extend(_cleared(note) for note in closed)

    def _recover(self, exc: KafkaException) -> None:
        """Abort the step and rebuild from committed offsets and the state topic (the step never happened)."""
        self.stats.aborts += 1
        if self.metrics is not None:
            self.metrics.transaction_aborts.inc()
        log.warning(
            "%s: transaction failed (%s); rebuilding from committed state",
            self.config.worker_id,
            exc.args[0].str() if exc.args else exc,
        )
        if is_fenced(exc):
            raise WorkerFenced(
                f"{self.config.worker_id}: another live worker uses transactional id "
                f"{self.config.transactional_id!r}; stopping this one"
            ) from exc
        if is_fatal(exc):
            self._producer = TransactionalProducer(
                self.kafka, self.config.transactional_id, transaction_timeout_ms=self.config.transaction_timeout_ms
            )
        elif self._producer.in_transaction:
            try:
                self._producer.abort()
            except KafkaException:
                self._producer = TransactionalProducer(
                    self.kafka, self.config.transactional_id, transaction_timeout_ms=self.config.transaction_timeout_ms
                )
        self._pending_done = []
        self._dirty.clear()
        self._redriven.clear()
        assigned = [tp.partition for tp in self._consumer.assignment()]
        for part in assigned:
            self._restore(part)
            self._positions.pop(part, None)
        committed = self._consumer.committed(
            [TopicPartition(self.config.receipts_topic, p) for p in assigned], timeout=30
        )
        for tp in committed:
            tp.offset = tp.offset if tp.offset >= 0 else 0
            self._consumer.seek(tp)

    def _apply_backpressure(self) -> None:
        open_groups = sum(len(g.open) for g in self.parts.values())
        self.stats.open_groups = open_groups
        cap = self.config.max_open_groups
        assignment = self._consumer.assignment()
        if not self.stats.paused and open_groups >= cap and assignment:
            self._consumer.pause(assignment)
            self.stats.paused = True
            log.info("%s: %d open groups >= cap %d, pausing", self.config.worker_id, open_groups, cap)
        elif self.stats.paused and open_groups < max(1, int(cap * 0.8)):
            if assignment:
                self._consumer.resume(assignment)
            self.stats.paused = False

    # ----- lifecycle -------------------------------------------------------------------------

    def run(
        self,
        should_stop: Callable[[], bool] | threading.Event,
        *,
        on_tick: Callable[[WorkerStats], None] | None = None,
        tick_s: float = 5.0,
    ) -> WorkerStats:
        stop = should_stop.is_set if isinstance(should_stop, threading.Event) else should_stop
        last = time.monotonic()
        try:
            while not stop():
                self.step()
                if on_tick is not None and time.monotonic() - last >= tick_s:
                    on_tick(self.stats)
                    last = time.monotonic()
        finally:
            self.close()
        return self.stats

    def close(self) -> None:
        try:
            self._consumer.close()
        except RuntimeError:
            pass
        self._producer.flush(5)
