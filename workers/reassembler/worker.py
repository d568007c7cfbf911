"""The reassembler worker: a consumer-group member that turns receipts into finalized prompt groups exactly once.

Modelled on Kafka Streams' commit cycle: one `PartitionTask` per assigned receipts partition, owned
by the worker's `TaskManager` (`task_manager.py`: assignment, revocation, restore, rebuild), as a
StreamThread runs the loop over its TaskManager's tasks. Each step polls, routes every record to its
task, finalizes the groups the tasks report ready, lets each task prepare its outputs, commits them
all with the input offsets in one transaction (`workers.reassembler.commit`), then lets each task
clean up. Any Kafka failure inside a step aborts it and rebuilds every task from the committed
offsets and the state topic, so a step either happened entirely or not at all.

Unlike a StreamTask's prepareCommit, `PartitionTask.prepare` closes the groups it is handed: an
aborted step leaves them closed in memory, which is safe only because every abort ends in
`TaskManager.rebuild`, which replaces every task with one restored from what was committed.

The step is pipelined: once its own rows are read it polls again, and the staging read of the
groups ready then runs in the background (`prefetch.py`) while it builds, puts and commits; the
next step also takes the groups its own poll completed, reading their rows itself. An
abort, or any change of tasks, drops that read: no step commits on what an abort threw away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from confluent_kafka import KafkaException

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig
from streams.consumer import Record, partitions_of
from streams.errors import TQError
from streams.producer import TransactionalProducer, is_fatal, is_fenced
from streams.tq import KVStore, with_call_deadline, with_clear_guard
from workers.reassembler.clearing import StagingClearer
from workers.reassembler.clients import KafkaClients, WorkerClients, consumer_settings
from workers.reassembler.commit import commit_transaction, confirm_membership, member_metadata, report_commit
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.errors import LeaseRefused, MemberFenced, StepAborted
from workers.reassembler.faults import NO_FAULTS, Faults
from workers.reassembler.fencing import TwinWatch
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup
from workers.reassembler.lease import Lease, call_budget_s
from workers.reassembler.poll_errors import PollWarnings, check_poll_error
from workers.reassembler.prefetch import StagingPrefetch, just_closed
from workers.reassembler.retry import retrying
from workers.reassembler.stepsize import StepSize
from workers.reassembler.sweeper import StagingSweeper
from workers.reassembler.task import PartitionTask
from workers.reassembler.task_manager import TaskManager
from workers.runtime import REAL_RUNTIME, Runtime
from workers.telemetry.sensors import ReassemblerSensor

log = logging.getLogger("rlstream.reassembler")


class ReassemblerWorker:
    """One consumer-group member; `run` loops `step` until stopped.

    `faults` (tests and drills only) is called at fixed points of every step; `clients` makes the
    Kafka clients (real ones by default); `runtime` gives it every clock, sleep and background thread
    it uses (`workers.runtime`: the process's own by default, a simulator's virtual ones). Every TQ
    call through `store` is given up at `lease.call_budget_s` (a TQ store gets that deadline here,
    wherever the worker runs: a pool child, a Ray actor, a thread).
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
        runtime: Runtime = REAL_RUNTIME,
    ):
        if not config.worker_id:
            # It names the transactional id: two workers sharing one would fence each other.
            raise InvalidArgument("ReassemblerConfig.worker_id is empty: every worker needs a stable id of its own")
        self.kafka = kafka
        self.runtime = runtime
        self._clock = runtime.monotonic
        self._lease = Lease(config.session_timeout_ms / 1000, config.max_poll_interval_ms / 1000, runtime=runtime)
        # Every clear asks the lease before each request that deletes (`streams.tq.with_clear_guard`).
        bounded = with_call_deadline(store, call_budget_s(config.max_poll_interval_ms / 1000))
        self.store = with_clear_guard(bounded, self._lease.refusal)
        self.config = config
        self.sensor = sensor if sensor is not None else ReassemblerSensor()
        self.faults = faults
        self._clients = clients if clients is not None else KafkaClients(kafka, runtime=runtime)
        # Everything below gets the guarded store: a clear made through the bare one would skip the lease.
        self._clearer = StagingClearer(self.store, config.actor.staging_partition, runtime=runtime)
        # The partition tasks, by partition (a mapping), and their assignment, restore and rebuild.
        self._tasks = TaskManager(config, self.store, self._clients, self._clearer, sensor=self.sensor, runtime=runtime)
        self._sweeper = StagingSweeper(self.store, config, runtime=runtime)
        self._prefetch = StagingPrefetch(self.store, config.actor, runtime=runtime)
        self._warnings = PollWarnings(config.worker_id, runtime.monotonic)
        self._step = StepSize(config.worker_id, config.max_poll_records, config.max_poll_interval_ms)
        # When the open transaction began (None: none open): a fence after its timeout is the
        # coordinator aborting it, not a twin.
        self._txn_began: float | None = None
        self._twins = TwinWatch(
            config.worker_id,
            config.transactional_id,
            session_timeout_s=config.session_timeout_ms / 1000,
            transaction_timeout_s=config.transaction_timeout_ms / 1000,
            clock=runtime.monotonic,
        )
        self._producer = self._new_producer()
        self._consumer = self._new_consumer()

    def _new_consumer(self):
        consumer = self._clients.consumer(self.config.consumer_group, consumer_settings(self.config))
        self._tasks.consumer = consumer  # the one its rebalance callbacks restore and rebuild with
        tasks = self._tasks
        consumer.subscribe(
            [self.config.receipts_topic], on_assign=tasks.on_assign, on_revoke=tasks.on_revoke, on_lost=tasks.on_lost
        )
        return consumer

    def _rejoin(self, fenced: MemberFenced) -> None:
        """A static member fenced by the coordinator joins again with a new consumer (its partitions
        restore as after any rebalance), unless it has a live twin (`fencing.py`)."""
        self.sensor.on_fenced("member")
        self._twins.member_fenced(fenced)
        self._tasks.reset()
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError):
            pass  # a fatally failed consumer may refuse its own close: it is dropped all the same
        self._consumer = self._new_consumer()

    @property
    def paused(self) -> bool:
        """Whether fetching is paused because too many prompt groups are open."""
        return self._tasks.paused

    @property
    def open_groups(self) -> int:
        return self._tasks.open_groups

    def _new_producer(self) -> TransactionalProducer:
        # Creating a producer needs the brokers: retried while they are down (`retry.py`).
        return retrying(
            "producer",
            lambda: self._clients.producer(self.config.transactional_id, self.config.transaction_timeout_ms),
            worker_id=self.config.worker_id,
            sensor=self.sensor,
            runtime=self.runtime,
        )

    # ----- the step --------------------------------------------------------------------------

    def step(self) -> int:
        """Poll, finalize what is ready, commit one transaction; returns the number of records consumed."""
        # With the next step's rows being read already, there is work now: no waiting for receipts.
        consumed = self._poll(0.0 if self._prefetch.pending else self.config.poll_timeout_s)
        if consumed is None:
            return 0
        now_ms = self.runtime.wall_ms()
        # The groups whose rows the previous step started reading, if this worker still holds them;
        # else what is ready. What does not fit stays ready for the next step (`PartitionTask.prepare`).
        taken = self._prefetch.take(self._tasks)
        late: list[OpenGroup] = []
        if taken is None:
            groups, prefetched = self._tasks.ready(now_ms)[: self._step.groups], None
        else:
            # Groups this poll completed join the step, read beside the prefetched ones: left for
            # the next prefetch they would wait for this whole step too (`prefetch.just_closed`).
            groups, prefetched = taken
            late = just_closed(groups, self._tasks.ready(now_ms), self._step.groups - len(groups))
            groups = groups + late
        if groups or self._tasks.has_work:
            self._commit_step(groups, now_ms, prefetched, late)
        self._tasks.apply_backpressure()
        self._sweep()
        self.sensor.on_lag(self.config.receipts_topic, self._tasks.lags())
        return consumed

    def _poll(self, timeout_s: float) -> int | None:
        """Take in the receipts that arrive within `timeout_s`; the number taken, None if the member rejoined."""
        # Wait for the first receipt only, then take what else has arrived without waiting: a batch
        # consume would hold a lone last receipt until the poll timeout ran out.
        msgs = self._consumer.consume(1, timeout_s)
        if msgs and self.config.max_poll_records > 1:
            msgs += self._consumer.consume(self.config.max_poll_records - 1, 0)
        self._lease.polled()
        now_ms = self.runtime.wall_ms()
        consumed = 0
        for m in msgs:
            if m.error() is not None:
                try:
                    check_poll_error(m.error(), self.config.worker_id, self.config.consumer_group)
                except MemberFenced as fenced:
                    self._rejoin(fenced)
                    return None
                self._warnings.warn(m.error())
                continue
            task = self._tasks.get(m.partition())
            if task is None:  # revoked during this poll
                continue
            consumed += 1
            task.intake(Record.of(m), now_ms)
        self.sensor.on_receipts(consumed)
        return consumed

    def _lease_refusal(self, put: int, sample_ids: list[str]) -> str | None:
        """Asked before each TQ put: why this worker may be a zombie by now, or None (see `lease.py`)."""
        self.faults.before_put(put, sample_ids)
        return self._lease.refusal()

    def _overlap(self, ready: list[OpenGroup], now_ms: int) -> list[OpenGroup] | None:
        """The next step's poll and staging read, run while this step builds, puts and commits; this
        step's groups less those that took a receipt since their rows were read, None if tasks changed."""
        claims, epoch = {g.group_id: g.staging_keys() for g in ready}, self._tasks.epoch
        # A read past the lease's share of max.poll.interval may have left the group, and the poll
        # below can return before the revoke: it must not renew the lease (an abort as a slow step).
        if ready and (refusal := self._lease.refusal()) is not None:
            names = ", ".join(g.group_id for g in ready[:3]) + (" ..." if len(ready) > 3 else "")
            raise LeaseRefused(f"not putting the rows of group(s) {names} read since the last poll: {refusal}")
        if self._poll(0.0) is None or self._tasks.epoch != epoch:
            return None
        ready = [g for g in ready if g.staging_keys() == claims[g.group_id]]
        chosen = {g.group_id for g in ready}
        following = [g for g in self._tasks.ready(now_ms) if g.group_id not in chosen]
        self._prefetch.start(following[: self._step.groups], epoch)
        return ready

    def _commit_step(
        self, ready: list[OpenGroup], now_ms: int, prefetched: Future | None = None, late: Sequence[OpenGroup] = ()
    ) -> None:
        t0 = self._clock()
        tasks = list(self._tasks.values())
        try:
            restored = self._tasks.restored_staging
            if ready or restored:  # a removed member writes nothing, with no freeze for the lease to see
                self._member_metadata()
                if self._lease.unconfirmed:
                    self._confirm_membership(tasks)
            # This step's rows first (read now, or waited for), then the next step's poll and read.
            staged = self._prefetch.rows(ready, prefetched, late) if ready else None
            if (ready := self._overlap(ready, now_ms)) is None:
                return  # uncommitted, nothing written: the next step chooses again from the tasks it has
            outcomes = (
                finalize_groups(
                    self.store,
                    ready,
                    self.config.actor,
                    receipts_topic=self.config.receipts_topic,
                    now_ms=now_ms,
                    lease_refusal=self._lease_refusal,
                    runtime=self.runtime,
                    staged=staged,
                    placeholder_groups=self.config.placeholder_groups,
                    may_hold_earlier_attempt=lambda g: self._tasks[g.partition].may_hold_earlier_attempt,
                )
                if ready
                else []
            )
            self.faults.after_put()
            # The previous step's clear is done before this transaction records it as done.
            self._tasks.settle_clear(strict=True)
            if restored:
                self._tasks.clear_restored(restored, self._lease.refusal())
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
                consumer_group_metadata=self._member_metadata(),
                before_commit=self.faults.before_commit,
            )
        except KafkaException as exc:
            self._recover(exc, len(ready))
            return
        except StepAborted as exc:
            self._abort(exc, len(ready))
            return
        except TQError as exc:
            # A deadline or a TQ failure; nothing of the step is committed: rebuilt, it puts the same rows again.
            self._abort(StepAborted(f"TQ did not answer ({exc})"), len(ready))
            return
        finally:
            self._txn_began = None
        self.faults.after_commit()
        seconds = self._clock() - t0
        report_commit(self.sensor, commits, seconds)
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
        step aborts and the next poll hands the consumer its rebalance. A consumer already told it was
        removed has no generation to prove, and is refused before it asks (`member_metadata`). Puts
        resume only if no new freeze was seen while the confirmation ran.
        """
        mark, metadata = self._lease.freezes(), self._member_metadata()
        self._txn_began = self._clock()
        confirm_membership(
            self._producer,
            {t.partition: t.committed_offset for t in tasks},
            receipts_topic=self.config.receipts_topic,
            consumer_group_metadata=metadata,
        )
        self._txn_began = None
        if not self._lease.confirmed(mark):
            raise LeaseRefused("frozen again while confirming consumer-group membership")
        log.info("%s: consumer-group membership confirmed after a freeze; puts resume", self.config.worker_id)

    def _member_metadata(self):
        config, member = self.config, self._tasks.member_id
        return member_metadata(self._consumer, member, worker_id=config.worker_id, consumer_group=config.consumer_group)

    def _abort(self, exc: StepAborted, groups: int) -> None:
        log.warning("%s: %s; rebuilding from committed state", self.config.worker_id, exc)
        self.sensor.on_abort()
        if self._lease.slow_step():  # the same records come back after the rebuild (`stepsize.py`)
            self._step.too_slow(groups)
        self._rebuild()

    def _rebuild(self) -> None:
        """Every task from committed state; the next step's prefetched read goes with the old tasks."""
        self._prefetch.discard()
        self._tasks.rebuild()

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
        self.sensor.on_fenced("producer")
        self._twins.producer_fenced(open_s)
        self._producer = self._new_producer()

    def _sweep(self) -> None:
        """Now and then, clear staged rows that no receipt will use (`sweeper.py`)."""
        if not self._sweeper.due():
            return
        try:  # a worker frozen with no work left confirms here, or no step ever would and rows stay
            if self._lease.unconfirmed and (tasks := list(self._tasks.values())):
                self._confirm_membership(tasks)
        except (KafkaException, StepAborted) as exc:
            return self._recover(exc, 0) if isinstance(exc, KafkaException) else self._abort(exc, 0)
        if self._lease.refusal() is not None:
            return  # a worker that may have lost its partitions judges no row of them
        self._tasks.settle_clear()  # never two clears of one key at once
        try:
            partitions = len(partitions_of(self._consumer, self.config.receipts_topic))
            found = self._sweeper.sweep(self._tasks, caught_up=self._tasks.caught_up_inputs(), partitions=partitions)
        except Exception as exc:  # noqa: BLE001 - a broker or TQ hiccup: the next sweep tries again
            log.warning("%s: sweeping staging failed (%s); trying again later", self.config.worker_id, exc)
            return
        self.sensor.on_swept(found)

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
        last = self._clock()
        try:
            while not stop():
                self.step()
                if on_tick is not None and self._clock() - last >= tick_s:
                    on_tick()
                    last = self._clock()
        finally:
            self.close()

    def close(self) -> None:
        self._lease.close()
        self._tasks.closing = True
        try:
            self._consumer.close()
        except RuntimeError:
            pass
        self._producer.flush(5)
        self._prefetch.close()
        # Last: a failed clear leaves rows that the partition's next owner clears when it restores.
        self._clearer.close()
