"""The reassembler worker: a consumer-group member that turns receipts into finalized prompt groups exactly once.

Modelled on Kafka Streams' commit cycle: one `PartitionTask` per assigned receipts partition. Each
step polls, routes every record to its task, finalizes the groups the tasks report ready, lets each
task prepare its outputs, commits them all with the input offsets in one transaction
(`workers.reassembler.commit`), then lets each task clean up. Any Kafka failure inside a step aborts
it and rebuilds every task from the committed offsets and the state topic, so a step either happened
entirely or not at all.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig
from streams.consumer import ReadTimeout, Record
from streams.producer import TransactionalProducer, is_fatal, is_fenced
from streams.tq import KVStore
from workers.reassembler.changelog import read_changelog
from workers.reassembler.clearing import StagingClearer
from workers.reassembler.commit import PartitionCommit, commit_transaction, dead_letter_counts
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.drills import crash_here, stop_here
from workers.reassembler.finalize import StepAborted, finalize_groups
from workers.reassembler.groups import OpenGroup
from workers.reassembler.lease import Lease
from workers.reassembler.poll_errors import WorkerFenced, check_poll_error
from workers.reassembler.restore import restore_partition
from workers.reassembler.task import PartitionTask
from workers.telemetry.sensors import ReassemblerSensor

log = logging.getLogger("rlstream.reassembler")
T = TypeVar("T")
# Longest wait between retries of a Kafka call the worker cannot go on without.
MAX_RETRY_DELAY_S = 30.0


def retry_delay(attempt: int) -> float:
    """Seconds before retry `attempt` (0-based): 1, 2, 4 ... capped at MAX_RETRY_DELAY_S."""
    return min(MAX_RETRY_DELAY_S, 2.0 ** min(attempt, 16))


class ReassemblerWorker:
    """One consumer-group member; `run` loops `step` until stopped."""

    def __init__(
        self, kafka: KafkaConfig, store: KVStore, config: ReassemblerConfig, *, sensor: ReassemblerSensor | None = None
    ):
        if not config.worker_id:
            # It names the transactional id: two workers sharing one would fence each other.
            raise InvalidArgument("ReassemblerConfig.worker_id is empty: every worker needs a stable id of its own")
        self.kafka = kafka
        self.store = store
        self.config = config
        self.sensor = sensor if sensor is not None else ReassemblerSensor()
        self._tasks: dict[int, PartitionTask] = {}
        max_poll_interval_ms = max(60_000, config.session_timeout_ms)
        self._lease = Lease(config.session_timeout_ms / 1000, max_poll_interval_ms / 1000)
        self._drilled = False  # the stop drill freezes a worker once
        self._paused = False
        self._clearer = StagingClearer(store, config.actor.staging_partition)
        self._warned: dict[int, float] = {}
        self._producer = self._new_producer()
        self._consumer = Consumer(
            kafka.consumer(
                config.consumer_group,
                **{
                    "session.timeout.ms": config.session_timeout_ms,
                    "heartbeat.interval.ms": max(100, config.session_timeout_ms // 6),
                    "max.poll.interval.ms": max_poll_interval_ms,
                    "client.id": config.transactional_id,
                    "partition.assignment.strategy": config.partition_assignment,
                    **({"group.instance.id": config.transactional_id} if config.static_membership else {}),
                },
            )
        )
        self._consumer.subscribe(
            [config.receipts_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    @property
    def paused(self) -> bool:
        """Whether fetching is paused because too many prompt groups are open."""
        return self._paused

    @property
    def open_groups(self) -> int:
        return sum(len(task.groups.open) for task in self._tasks.values())

    def _new_producer(self) -> TransactionalProducer:
        return self._retrying(
            "producer",
            lambda: TransactionalProducer(
                self.kafka, self.config.transactional_id, transaction_timeout_ms=self.config.transaction_timeout_ms
            ),
        )

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried with backoff while Kafka fails it for a reason that can pass (a broker down).

        Restoring a partition and creating a producer need the brokers; a long outage must not end
        the worker (its supervisor would only start it into the same outage, again and again).
        """
        for attempt in itertools.count():
            try:
                return call()
            except (KafkaException, ReadTimeout) as exc:
                error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
                if isinstance(error, KafkaError) and (error.fatal() or is_fenced(exc)):
                    raise
                delay = retry_delay(attempt)
                self.sensor.on_retry(what)
                reason = error.str() if isinstance(error, KafkaError) else exc
                log.warning("%s: %s failed (%s); retrying in %.0fs", self.config.worker_id, what, reason, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # ----- rebalance -------------------------------------------------------------------------

    def _on_assign(self, consumer, partitions) -> None:
        for tp in partitions:
            self._tasks[tp.partition] = self._restore_task(tp.partition)
        # librdkafka keeps a partition's paused state across revoke and re-assign: assign (what the
        # library would do after this callback) and resume the whole assignment (a cooperative one
        # keeps partitions paused before), and let the next step pause again if the cap still holds.
        if self.config.partition_assignment == "cooperative-sticky":
            consumer.incremental_assign(partitions)  # only these partitions move; the others keep flowing
        else:
            consumer.assign(partitions)
        consumer.resume(consumer.assignment())
        self._paused = False
        log.info("%s assigned %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer, partitions) -> None:
        for tp in partitions:
            self._tasks.pop(tp.partition, None)
        log.info("%s revoked %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def _restore_task(self, partition: int) -> PartitionTask:
        """A task rebuilt from the partition's state changelog, its predecessor's leftovers cleared."""
        return self._retrying(f"restore of partition {partition}", lambda: self._read_task(partition))

    def _read_task(self, partition: int) -> PartitionTask:
        # A fetch of committed offsets waits until a predecessor's open transaction (holding offsets
        # for this partition) commits or aborts, so the state read below includes its outcome.
        (tp,) = self._consumer.committed(
            [TopicPartition(self.config.receipts_topic, partition)],
            timeout=self.config.transaction_timeout_ms / 1000 + 30,
        )
        changelog = read_changelog(self.kafka, self.config.topics.state, partition)
        restored = restore_partition(partition, changelog.entries, closed_capacity=self.config.max_closed_groups)
        log.debug(
            "%s: partition %d restored from %d state records (offsets %d..%d)",
            self.config.worker_id,
            partition,
            len(changelog.entries),
            changelog.read_from,
            changelog.end_offset,
        )
        committed = tp.offset if tp.offset >= 0 else None
        return PartitionTask.resume(
            restored, self.store, self.config, committed_offset=committed, state_end=changelog.end_offset
        )

    # ----- the step --------------------------------------------------------------------------

    def step(self) -> int:
        """Poll, finalize what is ready, commit one transaction; returns the number of records consumed."""
        # Wait for the first receipt only, then take what else has arrived without waiting: a batch
        # consume would hold a lone last receipt until the poll timeout ran out.
        msgs = self._consumer.consume(1, self.config.poll_timeout_s)
        if msgs and self.config.max_poll_records > 1:
            msgs += self._consumer.consume(self.config.max_poll_records - 1, 0)
        self._lease.polled()
        now_ms = int(time.time() * 1000)
        consumed = 0
        for m in msgs:
            if m.error() is not None:
                check_poll_error(m.error(), self.config.worker_id, self.config.consumer_group)
                if m.error().code() != KafkaError._PARTITION_EOF:
                    self._warn_once(m.error())
                continue
            task = self._tasks.get(m.partition())
            if task is None:  # revoked during this poll
                continue
            consumed += 1
            task.intake(Record.of(m), now_ms)
        self.sensor.on_receipts(consumed)
        timeout_ms = int(self.config.group_timeout_s * 1000)
        ready = [
            g
            for part, task in self._tasks.items()
            for g in task.ready(task.clock(now_ms, caught_up=self._caught_up(part), paused=self._paused), timeout_ms)
        ]
        if ready or any(task.has_work for task in self._tasks.values()):
            self._commit_step(ready, now_ms)
        self._apply_backpressure()
        self.sensor.on_lag(self.config.receipts_topic, self._lags())
        return consumed

    def _may_put(self) -> str | None:
        """Asked before each TQ put: why this worker may be a zombie by now, or None (see `lease.py`)."""
        if self.config.stop_point == "before_put" and not self._drilled:
            self._drilled = True
            stop_here(self.config.stop_point, "before_put")
        return self._lease.expired()

    def _warn_once(self, error: KafkaError) -> None:
        # A missing topic or a broker down repeats on every poll: one line per error kind a minute.
        now = time.monotonic()
        if now - self._warned.get(error.code(), -1e9) >= 60:
            self._warned[error.code()] = now
            log.warning("%s: consumer error, retried by the client: %s", self.config.worker_id, error.str())

    def _commit_step(self, ready: list[OpenGroup], now_ms: int) -> None:
        t0 = time.perf_counter()
        tasks = list(self._tasks.values())
        try:
            outcomes = (
                finalize_groups(
                    self.store,
                    ready,
                    self.config.actor,
                    receipts_topic=self.config.receipts_topic,
                    now_ms=now_ms,
                    lease=self._may_put,
                )
                if ready
                else []
            )
            crash_here(self.config.crash_point, "after_tq_put")
            # The previous step's clear is done before this transaction records it as done.
            self._clearer.settle()
            by_partition: dict[int, list] = {}
            for o in outcomes:
                by_partition.setdefault(o.group.partition, []).append(o)
            commits = [task.prepare(by_partition.get(task.partition, ()), now_ms) for task in tasks]
            writes = commit_transaction(
                self._producer,
                [c for c in commits if not c.empty],
                topics=self.config.topics,
                receipts_topic=self.config.receipts_topic,
                consumer_group_metadata=self._consumer.consumer_group_metadata(),
                before_commit=lambda: crash_here(self.config.crash_point, "before_commit"),
            )
        except KafkaException as exc:
            self._recover(exc)
            return
        except StepAborted as exc:
            log.warning("%s: %s; rebuilding from committed state", self.config.worker_id, exc)
            self.sensor.on_abort()
            self._rebuild()
            return
        crash_here(self.config.crash_point, "after_commit")
        self._report_commit(commits, time.perf_counter() - t0)
        to_clear: list[str] = []
        for task, commit in zip(tasks, commits):
            task.post_commit(commit, writes.get(task.partition), to_clear=to_clear)
        self._clearer.submit(to_clear)

    def _report_commit(self, commits: list[PartitionCommit], seconds: float) -> None:
        self.sensor.on_commit(
            seconds=seconds,
            finalized=sum(len(c.finalized) for c in commits),
            dead_letters=dead_letter_counts(commits),
        )

    def _recover(self, exc: KafkaException) -> None:
        """Abort the step and rebuild from committed offsets and the state topic (the step never happened)."""
        self.sensor.on_abort()
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
            self._producer = self._new_producer()
        elif self._producer.in_transaction:
            try:
                self._producer.abort()
            except KafkaException as abort_exc:
                if is_fenced(abort_exc):
                    raise WorkerFenced(f"{self.config.worker_id}: fenced while aborting; stopping") from abort_exc
                log.warning("%s: abort failed (%s); starting a new producer", self.config.worker_id, abort_exc)
                self._producer = self._new_producer()
        self._rebuild()

    def _rebuild(self) -> None:
        """Every task again from the state topic, and the consumer back at the committed offsets."""
        assigned = [tp.partition for tp in self._consumer.assignment()]
        self._tasks = {part: self._restore_task(part) for part in assigned}
        committed = self._retrying(
            "committed offsets",
            lambda: self._consumer.committed(
                [TopicPartition(self.config.receipts_topic, p) for p in assigned], timeout=30
            ),
        )
        for tp in committed:
            tp.offset = tp.offset if tp.offset >= 0 else 0
            self._consumer.seek(tp)

    def _caught_up(self, partition: int) -> bool:
        """Whether this partition was read to its end (wall-time deadlines) or is behind (event time)."""
        end = self._end_offset(partition)
        if end is None:
            return True
        # The consumer's position moves past transaction markers, which a record's offset never does:
        # a partition ending in a commit marker still counts as read to its end.
        (tp,) = self._consumer.position([TopicPartition(self.config.receipts_topic, partition)])
        task = self._tasks.get(partition)
        position = tp.offset if tp.offset >= 0 else (task.position if task is not None else None)
        return position is not None and position >= end

    def _end_offset(self, partition: int) -> int | None:
        _, high = self._consumer.get_watermark_offsets(
            TopicPartition(self.config.receipts_topic, partition), cached=True
        ) or (0, -1)
        return high if high >= 0 else None

    def _lags(self) -> dict[int, int]:
        lags = {}
        for part, task in self._tasks.items():
            end = self._end_offset(part)
            if end is not None and task.position is not None:
                lags[part] = end - task.position
        return lags

    def _apply_backpressure(self) -> None:
        open_groups = self.open_groups
        cap = self.config.max_open_groups
        assignment = self._consumer.assignment()
        if not self._paused and open_groups >= cap and assignment:
            self._consumer.pause(assignment)
            self._paused = True
            log.info("%s: %d open groups >= cap %d, pausing", self.config.worker_id, open_groups, cap)
        elif self._paused and open_groups < max(1, int(cap * 0.8)):
            if assignment:
                self._consumer.resume(assignment)
            self._paused = False
        self.sensor.on_open_groups(open_groups, paused=self._paused)

    # ----- lifecycle -------------------------------------------------------------------------

    def run(
        self,
        should_stop: Callable[[], bool] | threading.Event,
        *,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 5.0,
    ) -> None:
        """Step until `should_stop`, calling `on_tick` about every `tick_s` seconds; closes the worker."""
        stop = should_stop.is_set if isinstance(should_stop, threading.Event) else should_stop
        last = time.monotonic()
        try:
            while not stop():
                self.step()
                if on_tick is not None and time.monotonic() - last >= tick_s:
                    on_tick()
                    last = time.monotonic()
        finally:
            self.close()

    def close(self) -> None:
        self._lease.close()
        try:
            self._consumer.close()
        except RuntimeError:
            pass
        self._producer.flush(5)
        # Last: a failed clear leaves rows that the partition's next owner clears when it restores.
        self._clearer.close()
