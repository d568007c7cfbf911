"""A partition assigned to the trainer starts only from a commit it could read (issue 30, item 3a).

`committed()` can fail on assignment (a broker failover, the coordinator moving); a partition read
on from an empty position then took records its commit named resolved, whose rows are gone, for new
ones and handed them back to be trained twice. Driven here with the in-memory Kafka, whose consumer
fails its first committed() calls; tests/integration/trainer/test_assignment_faults.py does it on the
real broker.
"""

from __future__ import annotations

import pytest

from schemas.errors import InvalidArgument
from schemas.regenerate import Regenerate
from tests.unit.workers.trainer.trainer_kafka import NAMES, Pipeline, group, train
from workers.telemetry.sensors import TrainerSensor


def _handed_back(pipe: Pipeline) -> list[str]:
    return [Regenerate.from_bytes(m.value()).group_id for m in pipe.broker.records(NAMES.regenerate)]


def _first_trainer_resolves_g0_and_g2(pipe: Pipeline) -> None:
    """g1 is of a version the first trainer does not reach: its commit stops at g1 and names g2 resolved."""
    pipe.finalize([group("g0"), group("g1", weight_version=50), group("g2"), group("g3", weight_version=50)])
    first = pipe.consumer(version=10)
    assert sorted(train(first, 2)) == ["g0", "g2"]
    first.close()


def _drain(pipe: Pipeline, consumer, rounds: int = 20) -> list[str]:
    """Poll and train what is usable for `rounds` rounds, a minute apart (retries fall due)."""
    trained = []
    for _ in range(rounds):
        pipe.clock.now += 60
        consumer.poll(0)
        meta = consumer.select(60, min_groups=1, max_groups=10, timeout_s=0.0)
        if meta is not None:
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
    return trained


def test_a_committed_offset_fetch_that_fails_on_assignment_leaves_no_resolved_group_handed_back():
    pipe = Pipeline()
    _first_trainer_resolves_g0_and_g2(pipe)
    pipe.broker.faults.committed = 3  # the coordinator does not answer the first fetches
    second = pipe.consumer(version=60)
    trained = _drain(pipe, second)
    assert _handed_back(pipe) == [] and second.counts.missing_rows == 0
    assert second.counts.reread == 1  # g2: named resolved by the first trainer's commit
    assert sorted(trained) == ["g1", "g3"]
    assert pipe.broker.faults.committed_calls >= 5  # it kept asking until the commit was known
    assert pipe.broker.faults.committed_in_callback == 0  # never inside librdkafka's rebalance callback


def test_a_partition_whose_commit_is_unknown_is_not_read_at_all():
    pipe = Pipeline()
    _first_trainer_resolves_g0_and_g2(pipe)
    pipe.broker.faults.committed = 1_000
    second = pipe.consumer(version=60)
    assert _drain(pipe, second, rounds=5) == []
    assert second.counts.reread == 0 and second.counts.waiting == 0 and _handed_back(pipe) == []
    pipe.broker.faults.committed = 0  # the coordinator is back
    assert sorted(_drain(pipe, second)) == ["g1", "g3"] and _handed_back(pipe) == []


def test_a_restored_checkpoint_whose_commit_is_unreadable_at_first_still_clears_what_it_trained():
    """The checkpoint's state was saved, `checkpoint_durable` never ran: records before its mark were trained
    and their rows are still in TQ. Read as if nothing were committed, the restored consumer started at
    the mark and those rows stayed for good."""
    pipe = Pipeline()
    groups = [group(f"g{i}") for i in range(4)]
    pipe.finalize(groups)
    first = pipe.consumer(checkpointed=True)
    assert sorted(train(first, 3)) == ["g0", "g1", "g2"]
    state = first.state_dict()
    first.close()  # killed before checkpoint_durable: no commit, rows kept
    pipe.broker.faults.committed = 2
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(state)
    assert _drain(pipe, second) == ["g3"]
    second.checkpoint_durable(second.state_dict())
    assert not pipe.present(groups)
    assert second.counts.reread == 3 and _handed_back(pipe) == []


def test_a_partition_whose_commit_is_unknown_stays_paused_when_backpressure_lets_the_others_go():
    pipe = Pipeline(partitions=2)
    pipe.finalize([group(f"a{i}") for i in range(4)], partition=0)
    pipe.finalize([group(f"b{i}") for i in range(2)], partition=1)
    pipe.broker.faults.unreadable = {1}
    consumer = pipe.consumer(max_waiting_groups=2, max_poll_records=1)
    for _ in range(4):
        pipe.clock.now += 60
        consumer.poll(0)
    assert consumer.counts.waiting == 2 and consumer._consumer.paused == {0, 1}  # backpressure holds everything
    trained = _drain(pipe, consumer)
    assert sorted(trained) == ["a0", "a1", "a2", "a3"]  # resumed on the way, partition 1 never read
    pipe.broker.faults.unreadable = set()
    assert sorted(_drain(pipe, consumer)) == ["b0", "b1"]
    assert _handed_back(pipe) == []


def test_a_cooperative_consumer_assigns_incrementally_and_waits_for_its_commits_the_same_way():
    pipe = Pipeline()
    _first_trainer_resolves_g0_and_g2(pipe)
    pipe.broker.faults.committed = 2
    second = pipe.consumer(version=60, client_settings={"partition.assignment.strategy": "cooperative-sticky"})
    assert sorted(_drain(pipe, second)) == ["g1", "g3"]
    assert second.counts.reread == 1 and _handed_back(pipe) == []


def _trained_three_of_four_then_killed(pipe: Pipeline) -> dict:
    """g0-g2 trained by a checkpointed trainer whose state was saved but never declared durable: the commit lags."""
    pipe.finalize([group(f"g{i}") for i in range(4)])
    first = pipe.consumer(checkpointed=True)
    assert sorted(train(first, 3)) == ["g0", "g1", "g2"]
    state = first.state_dict()
    first.close()
    return state


def test_a_state_saved_while_a_restored_partition_waits_for_its_commit_keeps_the_partition_s_mark():
    """The mark moved out of the restored marks into the waiting partition's start: a state cut then left it out,
    and a trainer restored from that state read the partition from the lagging commit and trained g0-g2 again."""
    pipe = Pipeline()
    s1 = _trained_three_of_four_then_killed(pipe)
    pipe.broker.faults.committed = 1_000  # the coordinator does not answer
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(s1)
    assert _drain(pipe, second, rounds=3) == []  # assigned, waiting for its commit
    s2 = second.state_dict()  # the trainer checkpoints meanwhile
    second.close()
    pipe.broker.faults.committed = 0
    third = pipe.consumer(checkpointed=True)
    third.load_state_dict(s2)
    assert _drain(pipe, third) == ["g3"] and _handed_back(pipe) == []


def test_a_state_loaded_once_partitions_are_assigned_is_refused_even_while_they_wait_for_their_commits():
    """Accepted, it was ignored: the waiting partition had taken its (absent) mark at assignment."""
    pipe = Pipeline()
    s1 = _trained_three_of_four_then_killed(pipe)
    pipe.broker.faults.committed = 1_000
    second = pipe.consumer(checkpointed=True)
    second.poll(0)  # assigned, its commit unknown
    with pytest.raises(InvalidArgument, match="before the first"):
        second.load_state_dict(s1)


def test_a_seek_that_keeps_failing_is_asked_again_less_and_less_often():
    """A failed seek put its partition back to wait, but the commit read just before had reset the backoff:
    committed() and a read of the progress topic every 0.5 s for as long as the seek failed."""
    pipe = Pipeline()
    _first_trainer_resolves_g0_and_g2(pipe)
    pipe.broker.faults.seeks = 1_000
    before = pipe.broker.faults.committed_calls
    second = pipe.consumer(version=60)
    for _ in range(40):  # 24 s in steps of 0.6 s: 0.5, 1, 2, 4, 8 (and 16) s apart is six asks at most
        pipe.clock.now += 0.6
        second.poll(0)
    assert 3 <= pipe.broker.faults.committed_calls - before <= 6
    assert second.counts.reread == 0 and _handed_back(pipe) == []  # never read meanwhile
    pipe.broker.faults.seeks = 0
    assert sorted(_drain(pipe, second)) == ["g1", "g3"] and _handed_back(pipe) == []


class _Waiting(TrainerSensor):
    def __init__(self) -> None:
        self.waiting: list[int] = []
        self.failed = 0

    def on_partitions_waiting(self, n: int) -> None:
        if not self.waiting or self.waiting[-1] != n:
            self.waiting.append(n)

    def on_commit_reads_failed(self, n: int = 1) -> None:
        self.failed += n


def test_partitions_waiting_for_their_commits_and_each_failed_read_reach_the_sensor():
    """A partition whose entry is gone waits for good with only a WARNING line: an alert needs a reading."""
    pipe = Pipeline(partitions=2)
    _first_trainer_resolves_g0_and_g2(pipe)
    pipe.broker.faults.unreadable = {1}
    sensor = _Waiting()
    second = pipe.consumer(version=60, sensor=sensor)
    trained = _drain(pipe, second, rounds=4)
    assert sensor.waiting == [2, 1] and sensor.failed == 4  # both assigned, partition 0 started, 1 asked 4 times
    pipe.broker.faults.unreadable = set()
    assert sorted(trained + _drain(pipe, second)) == ["g1", "g3"]
    assert sensor.waiting == [2, 1, 0] and sensor.failed == 4


def test_a_durable_checkpoint_while_a_restored_partition_waits_for_its_commit_leaves_its_rows_to_be_cleared():
    """Found by the explorer (seed 832, tests/explore_seeds/): a restored trainer whose commit
    fetch fails declares an idle checkpoint durable meanwhile. It committed the waiting partition's restored
    mark, so its start became the mark, the records trained before it were never read again and their rows,
    left by a predecessor killed before its own `checkpoint_durable`, stayed in TQ for good."""
    pipe = Pipeline()
    s1 = _trained_three_of_four_then_killed(pipe)
    pipe.broker.faults.committed = 1_000  # the coordinator does not answer
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(s1)
    assert _drain(pipe, second, rounds=3) == []  # assigned, waiting for its commit
    second.checkpoint_durable(second.state_dict())  # an idle checkpoint, declared durable meanwhile
    pipe.broker.faults.committed = 0  # the coordinator is back
    assert _drain(pipe, second) == ["g3"] and _handed_back(pipe) == []
    second.checkpoint_durable(second.state_dict())
    assert not pipe.present([group(f"g{i}") for i in range(4)])
    assert second.counts.reread == 3


def test_a_durable_checkpoint_before_a_restored_partition_is_assigned_leaves_its_rows_to_be_cleared():
    """Found by the explorer (seed 1169): the restored trainer had not been assigned its partition yet (the
    broker went down as it joined) when an idle checkpoint was declared durable. The restored mark was
    committed, the partition then started at it, and the rows of the records trained before it, left by a
    predecessor killed in its commit, stayed in TQ for good."""
    pipe = Pipeline()
    s1 = _trained_three_of_four_then_killed(pipe)
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(s1)
    second.checkpoint_durable(second.state_dict())  # before the first poll: nothing assigned yet
    assert _drain(pipe, second) == ["g3"] and _handed_back(pipe) == []
    second.checkpoint_durable(second.state_dict())
    assert not pipe.present([group(f"g{i}") for i in range(4)])
    assert second.counts.reread == 3


@pytest.mark.parametrize("waiting", [False, True], ids=["not-assigned", "waiting-for-its-commit"])
def test_a_state_cut_before_a_restored_partition_started_and_declared_durable_after_leaves_its_rows_to_be_cleared(
    waiting: bool,
):
    """A checkpoint saved in the background (`begin_checkpoint`, verl's `async_save`) is declared durable after
    the trainer polled on. Cut before the restored partition started (not assigned yet, or waiting for its
    commit), the state holds the restored mark; declared durable once the partition had started below it, the
    mark was committed, although the rows of the records before it, left by a predecessor killed in its
    commit, were not cleared yet (their re-reads come after the cut). A trainer killed before its next
    checkpoint left a successor that started at the mark, and those rows stayed in TQ for good (the window
    the fixes of seeds 832 and 1169 left open)."""
    pipe = Pipeline()
    s1 = _trained_three_of_four_then_killed(pipe)
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(s1)
    if waiting:
        pipe.broker.faults.committed = 1_000  # the coordinator does not answer
        assert _drain(pipe, second, rounds=3) == []  # assigned, waiting for its commit
    s2 = second.state_dict()  # the restored mark
    pipe.broker.faults.committed = 0
    assert _drain(pipe, second) == ["g3"] and second.counts.reread == 3  # started below the mark
    second.checkpoint_durable(s2)  # its save done
    second.close()  # killed before its next checkpoint
    third = pipe.consumer(checkpointed=True)
    third.load_state_dict(s2)
    assert _drain(pipe, third) == ["g3"] and _handed_back(pipe) == []  # acked after s2: trained again
    third.checkpoint_durable(third.state_dict())
    assert not pipe.present([group(f"g{i}") for i in range(4)])
    assert third.counts.reread == 3
