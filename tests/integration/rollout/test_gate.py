"""The admission gate against a real broker: closed while the trainer's version stays, open on a new one, and
given back the capacity of every group lost on the way, once."""

import dataclasses
import threading

import msgspec

from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, OPEN, PROGRESS_KEY, GroupState, PartitionProgress
from streams.consumer import wait_until
from streams.producer import AckedProducer, Outgoing
from tests.integration.helpers import SMALL, dead_letters, drive, finalized_records, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import make_group
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import windowed
from workers.trainer.version_topic import VersionPublisher


def test_the_gate_blocks_while_the_version_stays_and_opens_when_a_new_one_is_published(kafka, unique):
    names = setup_topics(kafka, f"gate-{unique}", partitions=1)
    trainer = VersionPublisher(kafka, names.trainer_version, trainer_id="t1", consumer_group="cg", batch_groups=2)
    other = VersionPublisher(kafka, names.trainer_version, trainer_id="t2", consumer_group="cg2", batch_groups=2)
    gate = AdmissionGate(kafka, names, max_staleness=0, trainer_id="t1")
    try:
        assert gate.capacity() == 0  # no version read yet: nothing may start
        assert trainer.publish(0) and not trainer.publish(0)  # sent on change only
        assert gate.wait_for_version(timeout=30) == 0
        assert gate.capacity() == 2  # (eta 0 + v 0 + 1) * 2
        assert gate.acquire(2, timeout=0)
        gate.on_finished(accepted=True)
        gate.on_finished(accepted=True)
        # The trainer has not moved: the third group would be trained a version late.
        assert not gate.acquire(1, timeout=1.0)
        other.publish(7)  # another trainer's version is not this gate's business
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(gate.acquire(1, timeout=60)))
        waiter.start()
        waiter.join(timeout=1.5)
        assert waiter.is_alive() and not got
        trainer.publish(1)
        waiter.join(timeout=60)
        assert got == [True]
        assert gate.version == 1 and gate.capacity() == 1  # (0 + 1 + 1) * 2 - 2 accepted - 1 running
        # A gate started late reads the latest record from the compacted topic.
        late = AdmissionGate(kafka, names, max_staleness=0, trainer_id="t1")
        try:
            assert late.wait_for_version(timeout=30) == 1
            wait_until(lambda: late.capacity() == 2, timeout_s=10, what="a fresh gate's capacity")
        finally:
            late.close()
    finally:
        gate.close()
        trainer.close()
        other.close()


def _entry(group_id: str, status: str, outcome: str | None = None, **kw) -> GroupState:
    return GroupState(
        group_id=group_id,
        status=status,
        partition=0,
        first_offset=0,
        last_offset=0,
        first_seen_ms=1,
        outcome=outcome,
        **kw,
    )


def test_groups_lost_at_the_trainer_or_dead_lettered_by_a_reassembler_give_their_capacity_back_once(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"gate-l-{unique}", partitions=1)
    trainer = VersionPublisher(kafka, names.trainer_version, trainer_id="t", consumer_group="cg", batch_groups=2)
    gate = AdmissionGate(kafka, names, max_staleness=0, trainer_id="t")
    state = AckedProducer(kafka)
    worker = consumer = None
    try:
        trainer.publish(0)
        assert gate.wait_for_version(timeout=30) == 0
        assert gate.acquire(2, timeout=0)
        gate.on_finished(accepted=True)
        gate.on_finished(accepted=True)
        assert gate.capacity() == 0  # (0 + 0 + 1) * 2 - 2 accepted

        # Both published (so both accepted): one group whose rollouts all failed, one good one.
        failed = make_group(f"{unique}-f", 0, 0, shape=dataclasses.replace(SMALL, failure_rate=1.0))
        good = make_group(f"{unique}-g", 1, 0, shape=SMALL)
        pub = RolloutPublisher(kafka, tq_store, names.receipts)
        pub.publish(failed + good)
        pub.close()
        worker = ReassemblerWorker(
            kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="w", consumer_group=f"re-{unique}")
        )
        drive(
            [worker],
            lambda: len(dead_letters(kafka, names)) >= len(failed) and len(finalized_records(kafka, names)) == 1,
            timeout_s=60,
        )
        # The reassembler dead-lettered the first: the gate hears of it on the state topic.
        wait_until(lambda: gate.capacity() == 1, timeout_s=30, what="the reassembler's dead letter")

        # The trainer, already a version further, evicts the other as too stale and says so.
        cfg = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}")
        consumer = ExperienceConsumer(kafka, tq_store, cfg, windowed(0), version=1)
        wait_until(lambda: consumer.poll(0.2) >= 0 and consumer.counts.lost == 1, timeout_s=60, what="the eviction")
        assert trainer.publish(1, lost_groups=consumer.counts.lost)
        assert not trainer.publish(1, lost_groups=consumer.counts.lost)  # sent on change only
        # (0 + 1 + 1) * 2 - (2 accepted - 2 lost)
        wait_until(lambda: gate.capacity() == 4, timeout_s=30, what="the trainer's loss")

        # Only a closing as dead-lettered is a loss, and once per group however often it is written
        # (closed, then closed with its staging cleared, then forgotten).
        y = _entry("y", CLOSED, DEAD_LETTERED, staging_keys=("r/0",))
        entries = [
            (b"x", _entry("x", OPEN).to_bytes()),
            (b"x", _entry("x", CLOSED, FINALIZED).to_bytes()),
            (b"y", y.to_bytes()),
            (b"y", msgspec.structs.replace(y, staging_cleared=True).to_bytes()),
            (PROGRESS_KEY, PartitionProgress(partition=0, emitted_through=3, time_ms=1).to_bytes()),
            (b"y", None),
        ]
        state.send([Outgoing(names.state, key, value, partition=0) for key, value in entries])
        wait_until(lambda: gate.capacity() == 5, timeout_s=30, what="a dead-lettered group's capacity")

        # A restarted trainer is a new run counting from 0: its first loss is a new one.
        restarted = VersionPublisher(kafka, names.trainer_version, trainer_id="t", consumer_group="cg", batch_groups=2)
        try:
            restarted.publish(1, lost_groups=1)
            wait_until(lambda: gate.capacity() == 6, timeout_s=30, what="the restarted trainer's loss")
        finally:
            restarted.close()
        assert gate.counts().lost == 4
        # A gate started now owes nothing to losses from before it.
        late = AdmissionGate(kafka, names, max_staleness=0, trainer_id="t")
        try:
            assert late.wait_for_version(timeout=30) == 1
            wait_until(lambda: late.capacity() == 2, timeout_s=10, what="a fresh gate's capacity")
            assert late.counts().lost == 0
        finally:
            late.close()
    finally:
        if consumer is not None:
            consumer.close()
        if worker is not None:
            worker.close()
        state.close()
        gate.close()
        trainer.close()
