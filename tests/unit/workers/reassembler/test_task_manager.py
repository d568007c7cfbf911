"""The reassembler's task manager on its own: partition tasks restored on assignment, dropped on revoke once
the background clear settled, rebuilt at the committed offsets, restores retried while the brokers are
down; over the in-memory Kafka (`fake_kafka.py`) and store, with no worker around it."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from schemas.state import PROGRESS_KEY, PartitionProgress
from tests.unit.manual_runtime import ManualRuntime
from workers.reassembler.clearing import StagingClearer
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.task_manager import TaskManager
from workers.telemetry.sensors import ReassemblerStats

from .fake_kafka import FakeClients, FakeConsumer
from .fixtures import closed, opened, receipt
from .steps import GROUP, NAMES, RecordingStore, make_broker


class AssignLog(FakeConsumer):
    """A consumer that notes how each assignment was applied: incrementally, or as the whole assignment."""

    def __init__(self, broker, group):
        super().__init__(broker, group)
        self.calls: list[tuple[str, list[int]]] = []

    def incremental_assign(self, partitions) -> None:
        self.calls.append(("incremental_assign", [tp.partition for tp in partitions]))
        super().assign(partitions)

    def assign(self, partitions) -> None:
        self.calls.append(("assign", [tp.partition for tp in partitions]))
        super().assign(partitions)


def _manager(broker, store, *, clients=None, runtime=None, **settings) -> tuple[TaskManager, AssignLog, StagingClearer]:
    config = ReassemblerConfig(prefix="t", worker_id="w0", consumer_group=GROUP, **settings)
    runtime = runtime or ManualRuntime()
    clearer = StagingClearer(store, config.actor.staging_partition, runtime=runtime)
    tasks = TaskManager(config, store, clients or broker.clients(), clearer, sensor=ReassemblerStats(), runtime=runtime)
    consumer = tasks.consumer = AssignLog(broker, GROUP)
    consumer.subscribe([NAMES.receipts], on_assign=tasks.on_assign, on_revoke=tasks.on_revoke, on_lost=tasks.on_lost)
    consumer.generation = broker.generations.get(GROUP, 0)  # joined: each test hands out the assignment itself
    return tasks, consumer, clearer


def _tps(*partitions: int) -> list[TopicPartition]:
    return [TopicPartition(NAMES.receipts, p) for p in partitions]


def _write_state(broker, partition: int, *entries) -> None:
    for e in entries:
        key = PROGRESS_KEY if isinstance(e, PartitionProgress) else e.group_id.encode()
        broker.append(NAMES.state, partition, key, e.to_bytes())


def _receipts(broker, partition: int, n: int) -> None:
    for i in range(n):
        broker.append(NAMES.receipts, partition, b"x", receipt(f"x{i}", 0).to_bytes())


def test_an_assignment_restores_each_partition_from_its_changelog_and_committed_offset():
    broker, store = make_broker(), RecordingStore()
    # Partition 0's predecessor closed g1 and died before recording its staging cleared; g2 is open.
    _write_state(broker, 0, closed("g1", 0, 1, keys=("g1-r0/c0", "g1-r1/c0")), opened("g2", 2))
    broker.offsets[(GROUP, NAMES.receipts, 0)] = 2
    tasks, consumer, _ = _manager(broker, store)
    tasks.paused = True
    tasks.on_assign(consumer, _tps(0, 1))
    assert sorted(tasks) == [0, 1]
    assert tasks[0].committed_offset == 2 and tasks[1].committed_offset is None
    assert "g1" in tasks[0].groups.closed and tasks[0].state_end == 2
    assert tasks.restored_staging == ["g1-r0/c0", "g1-r1/c0"]
    assert consumer.positions == {0: 2, 1: 0}, "the consumer starts each partition at its committed offset"
    assert not tasks.paused, "an assignment resumes fetching"
    tasks.restored_staging_cleared()
    assert tasks.restored_staging == [] and tasks.has_work, "the next commit records g1's staging cleared"


@pytest.mark.parametrize(
    ("assignment", "how"), [("cooperative-sticky", "incremental_assign"), ("range", "assign"), ("roundrobin", "assign")]
)
def test_a_cooperative_assignment_adds_partitions_and_keeps_the_others_an_eager_one_is_whole(assignment, how):
    broker, store = make_broker(), RecordingStore()
    tasks, consumer, _ = _manager(broker, store, partition_assignment=assignment)
    tasks.on_assign(consumer, _tps(0))
    kept = tasks[0]
    tasks.on_assign(consumer, _tps(1))
    assert consumer.calls == [(how, [0]), (how, [1])]
    assert tasks[0] is kept and sorted(tasks) == [0, 1], "a partition that stays keeps its task"


def test_a_revoke_settles_the_background_clear_before_it_drops_the_tasks():
    broker, store = make_broker(), RecordingStore()
    tasks, consumer, clearer = _manager(broker, store)
    tasks.on_assign(consumer, _tps(0, 1))
    held = store.hold_next_clear = threading.Event()
    clearer.submit(["k0"])  # the last step's staging, cleared in the background (held)
    revoke = threading.Thread(target=tasks.on_revoke, args=(consumer, _tps(0)))
    revoke.start()
    revoke.join(0.5)
    assert revoke.is_alive(), "the revoke returned with the clear in flight"
    assert 0 in tasks, "the task was dropped before its clear settled"
    held.set()
    revoke.join(10)
    assert not revoke.is_alive() and store.clears_done == 1
    assert sorted(tasks) == [1]


def test_lost_partitions_are_dropped_as_on_a_revoke():
    broker, store = make_broker(), RecordingStore()
    tasks, consumer, _ = _manager(broker, store)
    tasks.on_assign(consumer, _tps(0, 1))
    tasks.on_lost(consumer, _tps(0, 1))
    assert len(tasks) == 0


def test_a_rebuild_restores_every_task_again_and_seeks_to_the_committed_offsets():
    broker, store = make_broker(), RecordingStore()
    _receipts(broker, 0, 3)
    _receipts(broker, 1, 2)
    tasks, consumer, _ = _manager(broker, store)
    tasks.on_assign(consumer, _tps(0, 1))
    before = dict(tasks)
    consumer.consume(10)  # read ahead of any commit: the aborted step's records
    assert consumer.positions == {0: 3, 1: 2}
    broker.offsets[(GROUP, NAMES.receipts, 0)] = 1  # what committed meanwhile
    _write_state(broker, 0, closed("g0", 0, 0))
    tasks.rebuild()
    assert consumer.positions == {0: 1, 1: 0}, "a partition never committed starts over from 0"
    assert all(tasks[p] is not before[p] for p in (0, 1)), "the tasks of the aborted step were kept"
    assert tasks[0].committed_offset == 1 and "g0" in tasks[0].groups.closed


class FlakyChangelog(FakeClients):
    """State partitions that fail to read `failures` times (the brokers are down), then read."""

    def __init__(self, broker, failures: list[KafkaException]):
        super().__init__(broker)
        self.failures = failures

    def changelog(self, topic, partition):
        if self.failures:
            raise self.failures.pop(0)
        return super().changelog(topic, partition)


def test_a_restore_that_fails_while_the_brokers_are_down_is_retried_with_backoff():
    broker, store, runtime = make_broker(), RecordingStore(), ManualRuntime()
    down = [KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down")) for _ in range(2)]
    tasks, consumer, _ = _manager(broker, store, clients=FlakyChangelog(broker, down), runtime=runtime)
    tasks.on_assign(consumer, _tps(0))
    assert sorted(tasks) == [0] and runtime.slept == [1, 2] and tasks.sensor.retries == 2


def test_a_restore_failing_fatally_is_not_retried():
    broker, store, runtime = make_broker(), RecordingStore(), ManualRuntime()
    fatal = [KafkaException(KafkaError(KafkaError._FATAL, "fatal", fatal=True))]
    tasks, consumer, _ = _manager(broker, store, clients=FlakyChangelog(broker, fatal), runtime=runtime)
    with pytest.raises(KafkaException):
        tasks.on_assign(consumer, _tps(0))
    assert len(tasks) == 0 and runtime.slept == []


def test_a_reset_drops_every_task_once_the_clear_settled_and_resumes_fetching():
    broker, store = make_broker(), RecordingStore()
    tasks, consumer, clearer = _manager(broker, store)
    tasks.on_assign(consumer, _tps(0, 1))
    clearer.submit(["k0"])
    tasks.paused = True
    tasks.reset()
    assert len(tasks) == 0 and not tasks.paused and store.clears_done == 1


def test_an_assignment_served_while_the_consumer_closes_restores_nothing():
    broker, store = make_broker(), RecordingStore()
    tasks, consumer, _ = _manager(broker, store)
    tasks.closing = True
    tasks.on_assign(consumer, _tps(0, 1))
    assert len(tasks) == 0 and consumer.calls == []


def test_a_failed_background_clear_aborts_the_step_only_when_strict():
    from workers.reassembler.errors import StepAborted

    class Failing(RecordingStore):
        def clear(self, partition, keys):
            raise RuntimeError("TQ is gone")

    broker, store = make_broker(), Failing()
    tasks, _, clearer = _manager(broker, store)
    clearer.submit(["k"])
    tasks.settle_clear()  # a revoke or rebuild goes on: the restore clears the same keys again
    clearer.submit(["k"])
    with pytest.raises(StepAborted, match="TQ is gone"):
        tasks.settle_clear(strict=True)  # the step must not record the staging cleared
