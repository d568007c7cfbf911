"""The partition tasks of one reassembler worker: which it has, and how they come and go.

As Kafka Streams separates its `TaskManager` from the `StreamThread` that runs the loop: the worker
(`worker.py`) polls, finalizes, commits and fences; this module owns the `PartitionTask` of every
assigned receipts partition. It handles the consumer's rebalance callbacks (`on_assign` restores a
task for each partition it is given, `on_revoke`/`on_lost` drop them once the background staging
clear has settled), restores a task from the committed offset and the state changelog (retried while
the brokers are down), rebuilds every task after an aborted step, drops them all when a fenced static
member joins again, and answers what a step asks of the assignment: the tasks by partition (it is a
mapping), the ready groups, the open groups, restored staging, and whether each input was read to
its end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from confluent_kafka import TopicPartition

from streams.tq import KVStore
from workers.reassembler.clearing import StagingClearer
from workers.reassembler.clients import WorkerClients
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.errors import LeaseRefused, StepAborted
from workers.reassembler.groups import OpenGroup
from workers.reassembler.restore import restore_partition
from workers.reassembler.retry import MAX_REBUILD_DELAY_S, retry_delay, retrying
from workers.reassembler.task import PartitionTask
from workers.runtime import Runtime
from workers.telemetry.sensors import ReassemblerSensor

log = logging.getLogger("rlstream.reassembler")


class TaskManager(Mapping[int, PartitionTask]):
    """The tasks of the partitions assigned to one worker, by partition.

    `consumer` is the worker's current consumer (set by the worker with each one it makes); the
    rebalance callbacks are subscribed with it. `clearer` is the worker's background staging clear,
    which every change of tasks waits for (`settle_clear`). `runtime` is the worker's: the backoff
    of a restore retried and the wall clock a restored task starts from.
    """

    def __init__(
        self,
        config: ReassemblerConfig,
        store: KVStore,
        clients: WorkerClients,
        clearer: StagingClearer,
        *,
        sensor: ReassemblerSensor,
        runtime: Runtime,
    ):
        self.config = config
        self.store = store
        self.sensor = sensor
        self.runtime = runtime
        self._clients = clients
        self._clearer = clearer
        self._tasks: dict[int, PartitionTask] = {}
        self.consumer = None
        # Whether fetching is paused for backpressure (the worker's); an assignment resumes it.
        self.paused = False
        # The consumer is closing: an assignment served now is not restored (see `on_assign`).
        self.closing = False
        # Moves with every change of tasks (assignment, revocation, rebuild, reset): what was read for
        # the tasks of an older epoch (a prefetched staging read, `prefetch.py`) is no longer theirs.
        self.epoch = 0
        # Rebuilds in a row at the same committed offsets (no commit landed between), and those offsets:
        # each one after the first waits longer before its records are taken in again (`rebuild`).
        self._idle_rebuilds = 0
        self._rebuilt_at: list[tuple[int, int]] | None = None
        # The consumer's member id when its last rebalance callback was served: the membership the
        # tasks belong to. A consumer that joined again under a new id before serving what that
        # did to its partitions holds tasks of an old membership (`commit.member_metadata`).
        self.member_id: str | None = None

    # ----- the tasks, by partition -------------------------------------------------------------

    def __getitem__(self, partition: int) -> PartitionTask:
        return self._tasks[partition]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    # ----- rebalance -------------------------------------------------------------------------

    def on_assign(self, consumer, partitions) -> None:
        if self.closing:
            # An assignment served while the consumer closes (a rebalance under way): restoring
            # partitions now is wasted, and the client refuses calls made from it once destroyed.
            return
        self.epoch += 1
        self.member_id = consumer.memberid()
        for tp in partitions:
            self._tasks[tp.partition] = self.restore_task(tp.partition)
        # librdkafka keeps a partition's paused state across revoke and re-assign: assign (what the
        # library would do after this callback) and resume the whole assignment (a cooperative one
        # keeps partitions paused before), and let the next step pause again if the cap still holds.
        if self.config.partition_assignment == "cooperative-sticky":
            consumer.incremental_assign(partitions)  # only these partitions move; the others keep flowing
        else:
            consumer.assign(partitions)
        consumer.resume(consumer.assignment())
        self.paused = False
        log.info("%s assigned %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def on_revoke(self, consumer, partitions) -> None:
        # Before the partitions are given up: their next owner clears what this worker did not
        # record cleared, and two clears of one key must never overlap (`settle_clear`).
        self.settle_clear()
        self.epoch += 1
        self.member_id = consumer.memberid()
        for tp in partitions:
            self._tasks.pop(tp.partition, None)
        log.info("%s revoked %s", self.config.worker_id, sorted(tp.partition for tp in partitions))

    def on_lost(self, consumer, partitions) -> None:
        """Partitions lost without a revoke (the member left its group): dropped as on a revoke."""
        self.on_revoke(consumer, partitions)

    def reset(self) -> None:
        """Every task dropped, for a static member fenced by the coordinator that joins again with a new
        consumer (its partitions restore as after any rebalance)."""
        self.settle_clear()
        self.epoch += 1
        self._tasks = {}
        self.paused = False
        self.member_id = None

    def restore_task(self, partition: int) -> PartitionTask:
        """A task rebuilt from the partition's state changelog; the next step clears its predecessor's leftovers."""
        return self._retrying(f"restore of partition {partition}", lambda: self._read_task(partition))

    def _retrying(self, what, call):
        return retrying(what, call, worker_id=self.config.worker_id, sensor=self.sensor, runtime=self.runtime)

    def _read_task(self, partition: int) -> PartitionTask:
        # A fetch of committed offsets waits until a predecessor's open transaction (holding offsets
        # for this partition) commits or aborts, so the state read below includes its outcome.
        (tp,) = self.consumer.committed(
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
            restored,
            self.store,
            self.config,
            committed_offset=committed,
            state_end=changelog.end_offset,
            now_ms=self.runtime.wall_ms(),
        )

    def rebuild(self) -> None:
        """Every task again from the state topic, and the consumer back at the committed offsets."""
        self.settle_clear()
        self.epoch += 1
        assigned = [tp.partition for tp in self.consumer.assignment()]
        self._tasks = {part: self.restore_task(part) for part in assigned}
        committed = self._retrying(
            "committed offsets",
            lambda: self.consumer.committed(
                [TopicPartition(self.config.receipts_topic, p) for p in assigned], timeout=30
            ),
        )
        for tp in committed:
            tp.offset = tp.offset if tp.offset >= 0 else 0
            self.consumer.seek(tp)
        self._back_off(sorted((tp.partition, tp.offset) for tp in committed))

    def _back_off(self, offsets: list[tuple[int, int]]) -> None:
        """Wait before a rebuild's records come back if the last rebuild was at these very offsets.

        A step refused for a reason only time ends (a confirmation from a generation the coordinator
        has moved on from, until the consumer learns of its rebalance; a TQ that keeps failing) would
        otherwise be retried at once on the same records, a hot loop of transactions and rebuilds.
        1, 2, 4 ... seconds, at most MAX_REBUILD_DELAY_S; a commit that moved an offset starts over.
        """
        self._idle_rebuilds = self._idle_rebuilds + 1 if offsets == self._rebuilt_at else 0
        self._rebuilt_at = offsets
        if self._idle_rebuilds:
            delay = retry_delay(self._idle_rebuilds - 1, MAX_REBUILD_DELAY_S)
            log.warning(
                "%s: rebuilt %d times in a row with no commit between; waiting %.0fs before the next step",
                self.config.worker_id,
                self._idle_rebuilds + 1,
                delay,
            )
            self.runtime.sleep(delay)

    def settle_clear(self, *, strict: bool = False) -> None:
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

    # ----- what a step asks ------------------------------------------------------------------

    def holds(self, group: OpenGroup) -> bool:
        """Whether `group` is still open in the task this manager has for its partition (the same object)."""
        task = self._tasks.get(group.partition)
        return task is not None and task.groups.open.get(group.group_id) is group

    @property
    def open_groups(self) -> int:
        return sum(len(task.groups.open) for task in self._tasks.values())

    @property
    def has_work(self) -> bool:
        """Whether the next step must commit for some partition even when no group is ready."""
        return any(task.has_work for task in self._tasks.values())

    def ready(self, now_ms: int) -> list[OpenGroup]:
        """Every task's groups to finalize now, each on its partition's deadline clock (`PartitionTask.clock`)."""
        timeout_ms = int(self.config.group_timeout_s * 1000)
        return [
            g
            for part, task in self._tasks.items()
            for g in task.ready(task.clock(now_ms, caught_up=self.caught_up(part), paused=self.paused), timeout_ms)
        ]

    def clear_restored(self, keys: list[str], refusal: str | None) -> None:
        """Clear the staging restored partitions' predecessors left, for this step to record cleared.

        In a step, not in the restore: a restore also follows a step aborted because the worker may be
        a zombie, and then no TQ write of its is safe until its membership is confirmed. `refusal` is
        the worker's lease's answer, asked like before a put.
        """
        if refusal is not None:
            raise LeaseRefused(f"not clearing the staging restored partitions left: {refusal}")
        try:
            self.store.clear(self.config.actor.staging_partition, keys)
        except Exception as exc:  # noqa: BLE001 - a TQ failure: the next step clears them again
            raise StepAborted(f"clearing restored staging failed ({type(exc).__name__}: {exc})") from exc
        self.restored_staging_cleared()

    def apply_backpressure(self) -> None:
        """Pause every assigned partition at `max_open_groups` open groups; resume below 80% of it."""
        open_groups, cap = self.open_groups, self.config.max_open_groups
        assignment = self.consumer.assignment()
        if not self.paused and open_groups >= cap and assignment:
            self.consumer.pause(assignment)
            self.paused = True
            log.info("%s: %d open groups >= cap %d, pausing", self.config.worker_id, open_groups, cap)
        elif self.paused and open_groups < max(1, int(cap * 0.8)):
            if assignment:
                self.consumer.resume(assignment)
            self.paused = False
        self.sensor.on_open_groups(open_groups, paused=self.paused)

    @property
    def restored_staging(self) -> list[str]:
        """The staging keys restored partitions' predecessors closed and did not record cleared."""
        return [k for task in self._tasks.values() for k in task.restored_staging]

    def restored_staging_cleared(self) -> None:
        """The `restored_staging` keys are gone: each task's next commit records their groups cleared."""
        for task in self._tasks.values():
            task.restored_staging_cleared()

    def caught_up(self, partition: int) -> bool:
        """Whether this partition was read to its end (wall-time deadlines) or is behind (event time)."""
        end = self._end_offset(partition)
        if end is None:
            return True
        # The consumer's position moves past transaction markers, which a record's offset never does:
        # a partition ending in a commit marker still counts as read to its end.
        (tp,) = self.consumer.position([TopicPartition(self.config.receipts_topic, partition)])
        task = self._tasks.get(partition)
        known = [tp.offset] + ([task.position, task.committed_offset] if task is not None else [])
        # Before its first fetch a partition has no position: it starts from its commit, else 0.
        position = next((p for p in known if p is not None and p >= 0), 0)
        return position >= end

    def caught_up_inputs(self) -> dict[int, bool]:
        """`caught_up` of every assigned partition."""
        return {p: self.caught_up(p) for p in self._tasks}

    def _end_offset(self, partition: int) -> int | None:
        _, high = self.consumer.get_watermark_offsets(
            TopicPartition(self.config.receipts_topic, partition), cached=True
        ) or (0, -1)
        return high if high >= 0 else None

    def lags(self) -> dict[int, int]:
        """Per partition read since the task was built, how many records lie between its position and its end."""
        lags = {}
        for part, task in self._tasks.items():
            end = self._end_offset(part)
            if end is not None and task.position is not None:
                lags[part] = end - task.position
        return lags
