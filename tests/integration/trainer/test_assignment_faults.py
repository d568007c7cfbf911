"""A partition assigned to the trainer is read only once its commit is known, on the real broker (issue 30, 3a).

`committed()` fails for a while when the group coordinator moves (a broker failover). The trainer used
to log it and read the partition from an empty position: records the commit named resolved, whose rows
were cleared, looked new and were handed back to be trained twice. Here the trainer's reader is the
real consumer, through the trainer's client factory, except that its first committed() calls fail, or
meet a coordinator that does not answer for real (the broker SIGSTOPped for the length of that call).
"""

from __future__ import annotations

import os
import signal
import time

from confluent_kafka import Consumer, KafkaError, KafkaException

from schemas.regenerate import Regenerate
from streams.consumer import committed_offsets, read_topic
from streams.tq import TRAIN
from tests.integration.helpers import setup_topics
from tests.integration.trainer.direct import finalized, publish
from tests.integration.trainer.staging import committed_at_end
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first


class CommittedFails(Consumer):
    """The real consumer, except that its first `failures` committed() calls raise (a coordinator moving).

    A subclass, not a wrapper: librdkafka hands the rebalance callbacks the consumer object itself.
    """

    def __init__(self, conf, failures: int):
        super().__init__(conf)
        self.failures = failures
        self.calls = 0

    def committed(self, partitions, timeout=-1):
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "committed offsets: no coordinator (the test)"))
        return super().committed(partitions, timeout=timeout)


class CoordinatorFrozen(Consumer):
    """The real consumer, whose first committed() call meets a coordinator that does not answer: the broker
    (the only one, so the group's coordinator) is SIGSTOPped for that call and SIGCONTinued after it."""

    def __init__(self, conf, broker_pid: int):
        super().__init__(conf)
        self.broker_pid = broker_pid
        self.calls = 0
        self.failed: list[KafkaException] = []

    def committed(self, partitions, timeout=-1):
        self.calls += 1
        if self.calls > 1:
            return super().committed(partitions, timeout=timeout)
        os.kill(self.broker_pid, signal.SIGSTOP)
        try:
            return super().committed(partitions, timeout=timeout)
        except KafkaException as exc:
            self.failed.append(exc)
            raise
        finally:
            os.kill(self.broker_pid, signal.SIGCONT)


class FailingCommitted(KafkaTrainerClients):
    def __init__(self, kafka, failures: int = 0, broker_pid: int | None = None):
        super().__init__(kafka)
        self.failures = failures
        self.broker_pid = broker_pid
        self.made: list[Consumer] = []

    def consumer(self, consumer_group, settings):
        conf = self.consumer_settings(consumer_group, settings)
        frozen = self.broker_pid is not None
        self.made.append(CoordinatorFrozen(conf, self.broker_pid) if frozen else CommittedFails(conf, self.failures))
        return self.made[-1]


def _consumer(kafka, tq_store, names, group, version, clients=None, **config) -> ExperienceConsumer:
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=group, **{"session_timeout_ms": 6000, **config})
    return ExperienceConsumer(kafka, tq_store, cfg, ready_first(), version=version, clients=clients)


def _train(consumer, version: int, until, most: int = 8, timeout_s: float = 60.0) -> list[str]:
    """Select (at most `most` groups in all) and ack until `until(trained)` holds; the group ids trained."""
    trained: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not until(trained):
        assert time.monotonic() < deadline, f"trained {trained}, counts {consumer.counts}"
        if len(trained) >= most:
            consumer.poll(0.1)
            continue
        meta = consumer.select(version, min_groups=1, max_groups=most - len(trained), timeout_s=0.5)
        if meta is not None:
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
    return trained


def _resolve_g0_and_g2(kafka, tq_store, names, group, unique):
    """Four records; g1 and g3 of a version the first trainer never reaches: its commit stops at g1 and names g2."""
    groups = [finalized(f"g{i}-{unique}", 5 * (i % 2)) for i in range(4)]
    publish(kafka, tq_store, names, groups)
    first = _consumer(kafka, tq_store, names, group, 0)
    try:
        assert sorted(_train(first, 0, lambda t: len(t) == 2)) == sorted([groups[0].group_id, groups[2].group_id])
        deadline = time.monotonic() + 30
        while committed_offsets(kafka, group, names.finalized) != {0: 1}:
            assert time.monotonic() < deadline, committed_offsets(kafka, group, names.finalized)
            first.poll(0.1)
    finally:
        first.close()
    assert not tq_store.present(TRAIN, list(groups[2].sample_ids))  # gone: trained, named by the commit
    return groups


def test_a_commit_unreadable_on_assignment_leaves_no_resolved_group_handed_back_or_trained_twice(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"af-{unique}", partitions=1)
    group = f"af-{unique}"
    groups = _resolve_g0_and_g2(kafka, tq_store, names, group, unique)
    clients = FailingCommitted(kafka, failures=3)
    second = _consumer(kafka, tq_store, names, group, 5, clients=clients)
    try:
        trained = _train(second, 5, lambda t: len(t) == 2 and committed_at_end(kafka, group, names.finalized))
    finally:
        second.close()
    assert sorted(trained) == sorted([groups[1].group_id, groups[3].group_id])
    assert [Regenerate.from_bytes(r.value).group_id for r in read_topic(kafka, names.regenerate)] == []
    assert second.counts.missing_rows == 0 and second.counts.reread == 1
    assert clients.made[0].calls > 3  # asked again until the commit was known


def test_a_coordinator_that_does_not_answer_while_the_commit_is_read_leaves_no_resolved_group_handed_back(
    kafka, tq_store, unique, broker
):
    names = setup_topics(kafka, f"afz-{unique}", partitions=1)
    group = f"afz-{unique}"
    groups = _resolve_g0_and_g2(kafka, tq_store, names, group, unique)
    clients = FailingCommitted(kafka, broker_pid=broker.handle.pid)
    # A session longer than the freeze (and than the 30 s the callback used to block for): the member
    # stays in its group, only its commit fetch fails.
    second = _consumer(kafka, tq_store, names, group, 5, clients=clients, session_timeout_ms=60_000)
    try:
        trained = _train(second, 5, lambda t: len(t) == 2 and committed_at_end(kafka, group, names.finalized))
    finally:
        second.close()
    assert [Regenerate.from_bytes(r.value).group_id for r in read_topic(kafka, names.regenerate)] == []
    assert second.counts.reread == 1 and sorted(trained) == sorted([groups[1].group_id, groups[3].group_id])
    (frozen,) = clients.made
    assert len(frozen.failed) == 1 and frozen.calls > 1  # librdkafka's own fetch failed, then was asked again


def test_a_restored_checkpoint_with_its_commit_unreadable_at_first_still_clears_what_it_trained(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"afr-{unique}", partitions=1)
    group = f"afr-{unique}"
    groups = [finalized(f"r{i}-{unique}") for i in range(4)]
    publish(kafka, tq_store, names, groups)
    first = _consumer(kafka, tq_store, names, group, 0, checkpointed=True)
    try:
        trained = _train(first, 0, lambda t: len(t) == 3, most=3)
        state = first.state_dict()
    finally:
        first.close()  # killed before checkpoint_durable: nothing committed, the trained rows kept
    rows = [s for g in groups if g.group_id in trained for s in g.sample_ids]
    assert tq_store.present(TRAIN, rows) == set(rows)
    clients = FailingCommitted(kafka, failures=2)
    second = _consumer(kafka, tq_store, names, group, 0, clients=clients, checkpointed=True)
    try:
        second.load_state_dict(state)
        again = _train(second, 0, lambda t: second.counts.reread == 3 and len(t) == 1)
        second.checkpoint_durable(second.state_dict())
    finally:
        second.close()
    assert again == [g.group_id for g in groups if g.group_id not in trained]
    assert not tq_store.present(TRAIN, rows)  # read again as trained before the mark, and cleared
    assert not list(read_topic(kafka, names.regenerate)) and clients.made[0].calls > 2


class CooperativeCommittedFails(FailingCommitted):
    """The same consumer under cooperative rebalancing: partitions come through incremental_assign."""

    def consumer_settings(self, consumer_group, settings):
        return super().consumer_settings(
            consumer_group, {**settings, "partition.assignment.strategy": "cooperative-sticky"}
        )


def test_a_cooperative_trainer_whose_commit_is_unreadable_at_first_hands_no_resolved_group_back(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"afc-{unique}", partitions=1)
    group = f"afc-{unique}"
    groups = _resolve_g0_and_g2(kafka, tq_store, names, group, unique)
    clients = CooperativeCommittedFails(kafka, failures=3)
    second = _consumer(kafka, tq_store, names, group, 5, clients=clients)
    try:
        assert second._cooperative
        trained = _train(second, 5, lambda t: len(t) == 2 and committed_at_end(kafka, group, names.finalized))
    finally:
        second.close()
    assert sorted(trained) == sorted([groups[1].group_id, groups[3].group_id])
    assert [Regenerate.from_bytes(r.value).group_id for r in read_topic(kafka, names.regenerate)] == []
    assert second.counts.reread == 1 and second.counts.missing_rows == 0 and clients.made[0].calls > 3


def test_a_trainer_restored_from_a_checkpoint_older_than_its_commit_reads_from_the_checkpoint_s_mark(
    kafka, tq_store, unique
):
    """The start of a restored partition is the lower of its mark and its commit: the trainer seeks below the
    committed offset, and the groups trained after that checkpoint, their rows cleared by the next one, are
    found gone (handed back) rather than skipped unseen."""
    names = setup_topics(kafka, f"afs-{unique}", partitions=1)
    group = f"afs-{unique}"
    groups = [finalized(f"s{i}-{unique}") for i in range(6)]
    publish(kafka, tq_store, names, groups)
    first = _consumer(kafka, tq_store, names, group, 0, checkpointed=True)
    try:
        _train(first, 0, lambda t: len(t) == 2, most=2)
        older = first.state_dict()
        first.checkpoint_durable(older)
        _train(first, 0, lambda t: len(t) == 2, most=2)
        first.checkpoint_durable(first.state_dict())
        deadline = time.monotonic() + 30
        while committed_offsets(kafka, group, names.finalized) != {0: 4}:
            assert time.monotonic() < deadline, committed_offsets(kafka, group, names.finalized)
            first.poll(0.1)
    finally:
        first.close()
    second = _consumer(kafka, tq_store, names, group, 0, checkpointed=True)
    try:
        second.load_state_dict(older)  # mark 2, commit 4
        trained = _train(second, 0, lambda t: len(t) == 2 and second.counts.missing_rows == 2)
    finally:
        second.close()
    handed_back = [Regenerate.from_bytes(r.value).group_id for r in read_topic(kafka, names.regenerate)]
    assert sorted(handed_back) == sorted(g.group_id for g in groups[2:4])  # read again from the mark, rows gone
    assert sorted(trained) == sorted(g.group_id for g in groups[4:])
