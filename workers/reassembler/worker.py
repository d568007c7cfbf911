"""The reassembler worker: a consumer-group member that turns receipts into finalized prompt groups exactly once.

Modelled on Kafka Streams' commit cycle: one `PartitionTask` per assigned receipts partition. Each
step polls, routes every record to its task, finalizes the groups the tasks report ready, lets each
task prepare its outputs, commits them all with the input offsets in one transaction
(`workers.reassembler.commit`), then lets each task clean up. Any Kafka failure inside a step aborts
it and rebuilds every task from the committed offsets and the state topic, so a step either happened
entirely or not at all.

Unlike a StreamTask's prepareCommit, `PartitionTask.prepare` closes the groups it is handed: an
aborted step leaves them closed in memory, which is safe only because every abort ends in
`_rebuild`, which replaces every task with one restored from what was committed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig
from streams.consumer import Record, partitions_of
from streams.errors import ReadTimeout, TQError, TQTimeout
from streams.producer import TransactionalProducer, is_fatal, is_fenced
from streams.tq import KVStore, with_call_deadline
from workers.reassembler.clearing import StagingClearer
from workers.reassembler.clients import KafkaClients, WorkerClients
from workers.reassembler.commit import PartitionCommit, commit_transaction, confirm_membership, dead_letter_counts
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.errors import LeaseRefused, MemberFenced, StepAborted
from workers.reassembler.faults import NO_FAULTS, Faults
from workers.reassembler.fencing import TwinWatch
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup
from workers.reassembler.lease import Lease, call_budget_s
from workers.reassembler.poll_errors import check_poll_error
from workers.reassembler.restore import restore_partition
from workers.reassembler.stepsize import StepSize
from workers.reassembler.sweeper import StagingSweeper
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
    """One consumer-group member; `run` loops `step` until stopped.

    `faults` (tests and drills only) is called at fixed points of every step; `clients` makes the
    Kafka clients (real ones by default); `clock` is the monotonic clock of the lease and of the
    transaction timing. Every TQ call through `store` is given up at `lease.call_budget_s` (a TQ
    store gets that deadline here, wherever the worker runs: a pool child, a Ray actor, a thread).
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        config: ReassemblerConfig,
        *,
        sensor: ReassemblerSensor | None = None,
        faults: Faults = NO_FAULTS,
        clients: WorkerClients | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not config.worker_id:
            # It names the transactional id: two workers sharing one would fence each other.
            raise InvalidArgument("ReassemblerConfig.worker_id is empty: every worker needs a stable id of its own")
        self.kafka = kafka
        self.store = with_call_deadline(store, call_budget_s(config.max_poll_interval_ms / 1000))
        self.config = config
        self.sensor = sensor if sensor is not None else ReassemblerSensor()
        self.faults = faults
        self._clients = clients if clients is not None else KafkaClients(kafka)
        self._clock = clock
        self._tasks: dict[int, PartitionTask] = {}
        self._lease = Lease(config.session_timeout_ms / 1000, config.max_poll_interval_ms / 1000, clock=clock)
        self._paused = False
        self._clearer = StagingClearer(self.store, config.actor.staging_partition)
        self._sweeper = StagingSweeper(self.store, config, clock=clock)
        self._warned: dict[int, float] = {}
        self._step = StepSize(config.worker_id, config.max_poll_records, config.max_poll_interval_ms)
        # When the open transaction began (None: none open): a fence after its timeout is the
        # coordinator aborting it, not a twin.
        self._txn_began: float | None = None
        self._closing = False
        self._twins = TwinWatch(
            config.worker_id,
            config.transactional_id,
            session_timeout_s=config.session_timeout_ms / 1000,
            transaction_timeout_s=config.transaction_timeout_ms / 1000,
            clock=clock,
        )
        self._producer = self._new_producer()
        self._consumer = self._new_consumer()

    def _new_consumer(self):
        config = self.config
        consumer = self._clients.consumer(
            config.consumer_group,
            {
                "session.timeout.ms": config.session_timeout_ms,
                "heartbeat.interval.ms": max(100, config.session_timeout_ms // 6),
                "max.poll.interval.ms": config.max_poll_interval_ms,
                "client.id": config.transactional_id,
                "partition.assignment.strategy": config.partition_assignment,
                **({"group.instance.id": config.transactional_id} if config.static_membership else {}),
            },
        )
        consumer.subscribe(
            [config.receipts_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )
        return consumer

    def _rejoin(self, fenced: MemberFenced) -> None:
        """A static member fenced by the coordinator joins again with a new consumer (its partitions
        restore as after any rebalance), unless it has a live twin (`fencing.py`)."""
        self._twins.member_fenced(fenced)
        self._settle_clear()
        self._tasks = {}
        self._paused = False
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError):
            pass  # a fatally failed consumer may refuse its own close: it is dropped all the same
        self._consumer = self._new_consumer()

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
            lambda: self._clients.producer(self.config.transactional_id, self.config.transaction_timeout_ms),
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
        if self._closing:
            # An assignment served while the consumer closes (a rebalance under way): restoring
            # partitions now is wasted, and the client refuses calls made from it once destroyed.
            return
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
        # Before the partitions are given up: their next owner clears what this worker did not
        # record cleared, and two clears of one key must never overlap (`_settle_clear`).
        self._settle_clear()
        for tp in partitions:
            self._tasks.pop(tp.partition, None)
        log.info("%s revoked %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def _restore_task(self, partition: int) -> PartitionTask:
        """A task rebuilt from the partition's state changelog; the next step clears its predecessor's leftovers."""
        return self._retrying(f"restore of partition {partition}", lambda: self._read_task(partition))

    def _read_task(self, partition: int) -> PartitionTask:
        # A fetch of committed offsets waits until a predecessor's open transaction (holding offsets
        # for this partition) commits or aborts, so the state read below includes its outcome.
        (tp,) = self._consumer.committed(
            [TopicPartition(self.config.receipts_topic, partition)],
            timeout=self.config.transaction_timeout_ms / 1000 + 30,
        )
        changelog = self._clients.changelog(self.config.topics.state, partition)
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
                try:
                    check_poll_error(m.error(), self.config.worker_id, self.config.consumer_group)
                except MemberFenced as fenced:
                    self._rejoin(fenced)
                    return 0
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
        # What does not fit this step stays ready for the next one (`PartitionTask.prepare`).
        ready = ready[: self._step.groups]
        if ready or any(task.has_work for task in self._tasks.values()):
            self._commit_step(ready, now_ms)
        self._apply_backpressure()
        self._sweep()
        self.sensor.on_lag(self.config.receipts_topic, self._lags())
        return consumed

    def _lease_refusal(self, put: int, sample_ids: list[str]) -> str | None:
        """Asked before each TQ put: why this worker may be a zombie by now, or None (see `lease.py`)."""
        self.faults.before_put(put, sample_ids)
        return self._lease.refusal()

    def _warn_once(self, error: KafkaError) -> None:
        # A missing topic or a broker down repeats on every poll: one line per error kind a minute.
        now = time.monotonic()
        if now - self._warned.get(error.code(), -1e9) >= 60:
            self._warned[error.code()] = now
            log.warning("%s: consumer error, retried by the client: %s", self.config.worker_id, error.str())

    def _commit_step(self, ready: list[OpenGroup], now_ms: int) -> None:
        t0 = self._clock()
        tasks = list(self._tasks.values())
        try:
            restored = [k for task in tasks for k in task.restored_staging]
            if (ready or restored) and self._lease.unconfirmed:
                self._confirm_membership(tasks)
            outcomes = (
                finalize_groups(
                    self.store,
                    ready,
                    self.config.actor,
                    receipts_topic=self.config.receipts_topic,
                    now_ms=now_ms,
                    lease_refusal=self._lease_refusal,
                    placeholder_groups=self.config.placeholder_groups,
                )
                if ready
                else []
            )
            self.faults.after_put()
            # The previous step's clear is done before this transaction records it as done.
            self._settle_clear(strict=True)
            if restored:
                self._clear_restored(tasks, restored)
            by_partition: dict[int, list] = {}
            for o in outcomes:
                by_partition.setdefault(o.group.partition, []).append(o)
            commits = [task.prepare(by_partition.get(task.partition, ()), now_ms) for task in tasks]
            self._txn_began = self._clock()
            writes = commit_transaction(
                self._producer,
                [c for c in commits if not c.empty],
                topics=self.config.topics,
                receipts_topic=self.config.receipts_topic,
                consumer_group_metadata=self._consumer.consumer_group_metadata(),
                before_commit=self.faults.before_commit,
            )
        except KafkaException as exc:
            self._recover(exc, len(ready))
            return
        except StepAborted as exc:
            self._abort(exc, len(ready))
            return
        except TQTimeout as exc:
            # Nothing of the step is committed: rebuilt, it puts the same rows again (idempotent).
            self._abort(StepAborted(f"TQ did not answer in time ({exc})"), len(ready))
            return
        finally:
            self._txn_began = None
        self.faults.after_commit()
        seconds = self._clock() - t0
        self._report_commit(commits, seconds)
        self._step.committed(len(ready), seconds)
        staging_to_clear: list[str] = []
        try:
            for task, commit in zip(tasks, commits):
                task.post_commit(commit, writes.get(task.partition), staging_to_clear=staging_to_clear)
        except TQError as exc:  # clearing refused receipts' rows: the sweeper finds what is left
            log.warning("%s: after the commit: %s; rebuilding from committed state", self.config.worker_id, exc)
            self._rebuild()
            return
        self._clearer.submit(staging_to_clear)

    def _confirm_membership(self, tasks: list[PartitionTask]) -> None:
        """After a freeze: prove to the group coordinator that this member's generation is current.

        A transaction that sends the committed offsets again is refused from an older generation
        (KIP-447), so it fails for a worker whose partitions moved while it was frozen; then the
        step aborts and the next poll hands the consumer its rebalance. Puts resume only if no new
        freeze was seen while the confirmation ran.
        """
        mark = self._lease.freezes()
        self._txn_began = self._clock()
        confirm_membership(
            self._producer,
            {t.partition: t.committed_offset for t in tasks},
            receipts_topic=self.config.receipts_topic,
            consumer_group_metadata=self._consumer.consumer_group_metadata(),
        )
        self._txn_began = None
        if not self._lease.confirmed(mark):
            raise LeaseRefused("frozen again while confirming consumer-group membership")
        log.info("%s: consumer-group membership confirmed after a freeze; puts resume", self.config.worker_id)

    def _abort(self, exc: StepAborted, groups: int) -> None:
        log.warning("%s: %s; rebuilding from committed state", self.config.worker_id, exc)
        self.sensor.on_abort()
        if self._lease.slow_step():  # the same records come back after the rebuild (`stepsize.py`)
            self._step.too_slow(groups)
        self._rebuild()

    def _report_commit(self, commits: list[PartitionCommit], seconds: float) -> None:
        self.sensor.on_commit(
            seconds=seconds,
            finalized=sum(len(c.finalized) for c in commits),
            dead_letters=dead_letter_counts(commits),
        )
        self.sensor.on_handed_back(sum(len(c.regenerate) for c in commits))

    def _recover(self, exc: KafkaException, groups: int) -> None:
        """Abort the step and rebuild from committed offsets and the state topic (the step never happened)."""
        self.sensor.on_abort()
        if self._lease.slow_step():  # e.g. a step of dead letters only: refused at its commit, not a put
            self._step.too_slow(groups)
        open_s = self._clock() - self._txn_began if self._txn_began is not None else 0.0
        log.warning(
            "%s: transaction failed (%s); rebuilding from committed state",
            self.config.worker_id,
            exc.args[0].str() if exc.args else exc,
        )
        if is_fenced(exc):
            self._fenced(open_s)
        elif is_fatal(exc):
            self._producer = self._new_producer()
        elif self._producer.in_transaction:
            try:
                self._producer.abort()
            except KafkaException as abort_exc:
                if is_fenced(abort_exc):
                    self._fenced(self._clock() - self._txn_began if self._txn_began is not None else 0.0)
                else:
                    log.warning("%s: abort failed (%s); starting a new producer", self.config.worker_id, abort_exc)
                    self._producer = self._new_producer()
        self._rebuild()

    def _fenced(self, open_s: float) -> None:
        """A fence `open_s` into a transaction: a new producer, unless a live twin holds the id (`fencing.py`)."""
        self._twins.producer_fenced(open_s)
        self._producer = self._new_producer()

    def _clear_restored(self, tasks: list[PartitionTask], keys: list[str]) -> None:
        """Clear the staging restored partitions' predecessors left, for this step to record cleared.

        Here, not in the restore: a restore also follows a step aborted because this worker may be a
        zombie, and then no TQ write of its is safe until its membership is confirmed (done above).
        """
        refusal = self._lease.refusal()
        if refusal is not None:
            raise LeaseRefused(f"not clearing the staging restored partitions left: {refusal}")
        try:
            self.store.clear(self.config.actor.staging_partition, keys)
        except Exception as exc:  # noqa: BLE001 - a TQ failure: the next step clears them again
            raise StepAborted(f"clearing restored staging failed ({type(exc).__name__}: {exc})") from exc
        for task in tasks:
            task.restored_staging_cleared()

    def _settle_clear(self, *, strict: bool = False) -> None:
        """Wait for the background clear; with `strict`, a failed one aborts the step.

        Two clears of one key must never overlap: TQ clears by row index, and a put may reuse the
        index once the first clear released it, so the second would delete another key's row. Every
        other clear of staging (a restored partition's, a sweep's) therefore waits for this one
        first, and so does a revoke: the partition's next owner clears what was not recorded cleared.
        """
        try:
            self._clearer.settle()
        except Exception as exc:  # noqa: BLE001 - a TQ failure: the restore clears the same keys again
            if strict:
                raise StepAborted(f"clearing the last step's staging failed ({type(exc).__name__}: {exc})") from exc
            log.warning("%s: clearing staging failed (%s); the restore clears it again", self.config.worker_id, exc)

    def _rebuild(self) -> None:
        """Every task again from the state topic, and the consumer back at the committed offsets."""
        self._settle_clear()
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

    def _sweep(self) -> None:
        """Now and then, clear staged rows that no receipt will use (`sweeper.py`)."""
        if not self._sweeper.due() or self._lease.refusal() is not None:
            return  # a worker that may have lost its partitions judges no row of them
        self._settle_clear()  # never two clears of one key at once
        try:
            partitions = len(partitions_of(self._consumer, self.config.receipts_topic))
            found = self._sweeper.sweep(
                self._tasks, caught_up={p: self._caught_up(p) for p in self._tasks}, partitions=partitions
            )
        except Exception as exc:  # noqa: BLE001 - a broker or TQ hiccup: the next sweep tries again
            log.warning("%s: sweeping staging failed (%s); trying again later", self.config.worker_id, exc)
            return
        self.sensor.on_swept(found)

    def _caught_up(self, partition: int) -> bool:
        """Whether this partition was read to its end (wall-time deadlines) or is behind (event time)."""
        end = self._end_offset(partition)
        if end is None:
            return True
        # The consumer's position moves past transaction markers, which a record's offset never does:
        # a partition ending in a commit marker still counts as read to its end.
        (tp,) = self._consumer.position([TopicPartition(self.config.receipts_topic, partition)])
        task = self._tasks.get(partition)
        known = [tp.offset] + ([task.position, task.committed_offset] if task is not None else [])
        # Before its first fetch a partition has no position: it starts from its commit, else 0.
        position = next((p for p in known if p is not None and p >= 0), 0)
        return position >= end

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
        self._closing = True
        try:
            self._consumer.close()
        except RuntimeError:
            pass
        self._producer.flush(5)
        # Last: a failed clear leaves rows that the partition's next owner clears when it restores.
        self._clearer.close()
