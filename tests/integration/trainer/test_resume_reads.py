"""`resume` on the real broker where the dead job left Kafka untidy (issue 30): a transaction still open,
records its topics' retention deleted, hand-backs its rollout workers had generated already."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from schemas.regenerate import STAGING_LOST, Regenerate, regenerated_group_id
from streams.consumer import end_offsets
from streams.producer import AckedProducer, Outgoing
from tests.integration.helpers import SMALL, drive, finalized_records, setup_topics
from tests.integration.trainer.staging import finalize_groups
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.regenerate_feed import RegenerateFeed
from workers.rollout.synthetic import make_group
from workers.trainer.checkpoint_dir import save_into_checkpoint
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first
from workers.trainer.resume import resume

ROOT = Path(__file__).resolve().parents[3]

# A reassembler's step killed inside its transaction: its records flushed to the broker, no commit.
_DIE_IN_TRANSACTION = """
import os, signal, sys
from streams.config import KafkaConfig
from streams.producer import Outgoing, TransactionalProducer
servers, tid, topic, timeout_ms = sys.argv[1:5]
p = TransactionalProducer(KafkaConfig(servers), tid, transaction_timeout_ms=int(timeout_ms))
p.begin()
p.produce(Outgoing(topic, b"dead-g", b"not yet a record", partition=0))
assert p.flush(30) == 0
os.kill(os.getpid(), signal.SIGKILL)
"""


def _die_in_transaction(kafka, transactional_id: str, topic: str, timeout_ms: int) -> None:
    cmd = [sys.executable, "-c", _DIE_IN_TRANSACTION, kafka.bootstrap_servers, transactional_id, topic, str(timeout_ms)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]


def _finalize_one_after(kafka, tq_store, names, reassemblers: str, gid: str) -> None:
    """Group `gid` finalized and committed by a live worker: its record lies after the open transaction's."""
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(make_group(gid, 3, 1, shape=SMALL))
    pub.close()
    worker = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="live", consumer_group=reassemblers)
    )
    uncommitted = lambda: end_offsets(kafka, names.finalized, read_committed=False)[0][1]  # noqa: E731
    before = uncommitted()
    try:
        drive([worker], lambda: uncommitted() > before + 1, timeout_s=120)  # its record and its commit marker
    finally:
        worker.close()
    assert not [r for r in finalized_records(kafka, names) if r.group_id == gid], "hidden behind the open one"


def test_resume_waits_out_a_transaction_a_dead_reassembler_left_open_and_finds_what_came_after_it(
    kafka, tq_store, unique
):
    # Before, resume read up to the last stable offset: the group finalized after the open transaction
    # was hidden, counted unaccounted for, and `rlstream resume` exited 1.
    names = setup_topics(kafka, f"rtx-{unique}", partitions=1)
    reassemblers = f"re-{names.prefix}"
    _die_in_transaction(kafka, f"{reassemblers}.dead", names.finalized, timeout_ms=10_000)
    _finalize_one_after(kafka, tq_store, names, reassemblers, f"rtx-{unique}-g")
    lines: list[str] = []
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}", checkpointed=True)
    t0 = time.monotonic()
    report = resume(kafka, tq_store, config, None, reassembler_consumer_group=reassemblers, say=lines.append)
    assert report.unaccounted == [] and report.hand_back_finalized == 1, report.lines()
    assert 5 <= report.waited_s <= time.monotonic() - t0, lines
    assert any(line.startswith("resume: waiting for an open transaction to end on") for line in lines), lines


def test_resume_aborts_the_open_transaction_of_a_dead_worker_it_is_named_at_once(kafka, tq_store, unique):
    names = setup_topics(kafka, f"rab-{unique}", partitions=1)
    reassemblers = f"re-{names.prefix}"
    _die_in_transaction(kafka, f"{reassemblers}.dead", names.finalized, timeout_ms=600_000)
    _finalize_one_after(kafka, tq_store, names, reassemblers, f"rab-{unique}-g")
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}", checkpointed=True)
    lines: list[str] = []
    report = resume(
        kafka, tq_store, config, None, reassembler_consumer_group=reassemblers, reassembler_worker_ids=["dead"],
        transaction_wait_s=60, say=lines.append,
    )  # fmt: skip
    assert report.unaccounted == [] and report.hand_back_finalized == 1, report.lines()
    assert report.waited_s < 30 and any("dead: any transaction it left open is aborted" in x for x in lines), lines


def _delete_before(kafka, topic: str, offsets: dict[int, int]) -> None:
    admin = AdminClient(kafka.admin())
    for fut in admin.delete_records([TopicPartition(topic, p, o) for p, o in offsets.items()]).values():
        fut.result(timeout=30)


def test_finalized_records_expired_before_or_past_the_cut_never_stop_a_resume(kafka, tq_store, unique, tmp_path):
    # The week-long outage: the reassemblers still remember groups (event time stopped with the
    # receipts) whose finalized records the topic's retention deleted. Before, each was unaccounted for
    # and resume failed every time, with no way forward.
    names, finalized = finalize_groups(kafka, tq_store, f"rex-{unique}", versions=range(1), per_version=4, partitions=1)
    group = f"rex-trainer-{unique}"
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True),
        ready_first(),
        version=10,
    )
    try:
        batch = consumer.select(10, min_groups=2, max_groups=2, timeout_s=60)
        assert batch is not None
        consumer.ack(batch)
        state, _ = save_into_checkpoint(tmp_path, consumer, tq_store)
        consumer.checkpoint_durable(state)
    finally:
        consumer.close()
    cut = state["partitions"][0]["offset"]
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True)
    _delete_before(kafka, names.finalized, {0: cut})  # what the checkpoint covers: expired
    report = resume(kafka, tq_store, config, tmp_path, reassembler_consumer_group=f"re-{names.prefix}")
    assert report.unaccounted == [] and not report.expired.ranges, report.lines()
    assert report.restored + report.hand_back_finalized + report.trained == report.finalized_read >= 2

    end = end_offsets(kafka, names.finalized)[0][1]
    _delete_before(kafka, names.finalized, {0: end})  # and what it does not: lost, said apart
    report = resume(kafka, tq_store, config, tmp_path, reassembler_consumer_group=f"re-{names.prefix}")
    assert report.unaccounted == [] and report.expired.ranges == [(names.finalized, 0, cut, end)], report.lines()
    assert any("expired before they were read" in line for line in report.lines())


def _hand_back(gid: str, i: int) -> Regenerate:
    return Regenerate(
        prompt_idx=i, group_id=gid, new_group_id=regenerated_group_id(gid), group_size=SMALL.group_size,
        weight_version=1, reason=STAGING_LOST, source=f"t[0]@{i}", worker_id="w", time_ms=1,
    )  # fmt: skip


def test_hand_backs_generated_before_the_job_died_are_not_generated_again_after_resume(kafka, tq_store, unique):
    # Three hand-backs not yet committed past by the rollout workers' feed; the second one's regeneration
    # was published before the kill. A feed started afterwards must take the other two, once each.
    names = setup_topics(kafka, f"rfd-{unique}", partitions=1)
    backs = [_hand_back(f"rfd-{unique}-{x}", i) for i, x in enumerate("abc")]
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.regenerate, b.group_id.encode(), b.to_bytes()) for b in backs])
    producer.close()
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(make_group(backs[1].new_group_id, 1, 1, shape=SMALL))
    pub.close()

    feed_group = f"rollouts-{unique}"
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}", checkpointed=True)
    report = resume(
        kafka, tq_store, config, None, reassembler_consumer_group=f"re-{unique}", rollout_consumer_group=feed_group,
        feed_from_start=True,  # the feed died before its first commit
    )  # fmt: skip
    assert report.feed is not None and (report.feed.owed, report.feed.generated, report.feed.requeued) == (3, 1, 2)
    feed = RegenerateFeed(kafka, names, feed_group)
    taken: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while len(taken) < 2 and time.monotonic() < deadline:
            for back in feed.take(5, 1.0):
                taken.append(back.regenerate.new_group_id)
                feed.done(back)
        taken += [b.regenerate.new_group_id for b in feed.take(5, 3.0)]
    finally:
        feed.close()
    assert sorted(taken) == sorted([backs[0].new_group_id, backs[2].new_group_id])
