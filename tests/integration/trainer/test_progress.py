"""A restart with more resolved records past the commit than its metadata holds hands nothing back, on the
real broker (issue 30, item 3b).

Commit metadata was cut at 3,500 characters (about 870 alternating ranges): the records left out,
trained already, were read again as new after a restart and trained twice (or, their rows gone, handed
back). Past that size the ranges now go to `<prefix>.trainer.progress`, acknowledged before the commit
that names them.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from schemas.trainer_progress import TrainerProgress, progress_chunks
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from streams.runtime import RealRuntime
from streams.tq import TRAIN
from tests.integration.helpers import setup_topics
from tests.integration.trainer.direct import finalized, publish
from tests.integration.trainer.staging import committed_at_end
from workers.cli.main import main
from workers.telemetry.sensors import TrainerSensor
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.errors import CommitUnreadable
from workers.trainer.policies import ready_first
from workers.trainer.position import MAX_METADATA_CHARS, carried, carried_metadata
from workers.trainer.progress import entry_key
from workers.trainer.resume import resume

N = 2_000  # every other one held: 999 resolved ranges past the commit, about 4,000 characters inline


def _train(consumer, version: int, done, timeout_s: float = 120.0) -> list[str]:
    trained: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done(trained):
        assert time.monotonic() < deadline, f"trained {len(trained)}, counts {consumer.counts}"
        meta = consumer.select(version, min_groups=1, max_groups=500, timeout_s=0.5)
        if meta is not None:
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
    return trained


def _commit(kafka, group: str, topic: str) -> TopicPartition:
    c = Consumer(kafka.consumer(group))
    try:
        (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
        return tp
    finally:
        c.close()


def test_a_restart_with_more_resolved_ranges_than_commit_metadata_holds_hands_nothing_back(kafka, tq_store, unique):
    names = setup_topics(kafka, f"pg-{unique}", partitions=1)
    group = f"pg-{unique}"
    groups = [finalized(f"g{i}-{unique}", 5 * (i % 2)) for i in range(N)]
    publish(kafka, tq_store, names, groups)
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=group)
    first = ExperienceConsumer(kafka, tq_store, cfg, ready_first(), version=0)
    try:
        assert len(_train(first, 0, lambda t: len(t) == N // 2)) == N // 2
        deadline = time.monotonic() + 30
        while _commit(kafka, group, names.finalized).offset != 1:
            assert time.monotonic() < deadline
            first.poll(0.1)
    finally:
        first.close()
    tp = _commit(kafka, group, names.finalized)
    token, chunks = carried(tp.metadata)  # the ranges did not fit: the commit names its entry
    assert len(tp.metadata) < MAX_METADATA_CHARS
    entries = [TrainerProgress.from_bytes(r.value) for r in read_topic(kafka, names.trainer_progress) if r.value]
    assert [(e.token, e.offset, e.chunks) for e in entries][-1] == (token, 1, chunks)
    assert not tq_store.present(TRAIN, [s for g in groups[::2] for s in g.sample_ids])  # trained and cleared

    second = ExperienceConsumer(kafka, tq_store, cfg, ready_first(), version=5)
    try:
        again = _train(second, 5, lambda t: len(t) == N // 2 and committed_at_end(kafka, group, names.finalized))
    finally:
        second.close()
    assert sorted(again) == sorted(g.group_id for g in groups[1::2])  # none of the first trainer's again
    assert second.counts.reread == N // 2 - 1 and second.counts.missing_rows == 0
    assert not list(read_topic(kafka, names.regenerate))
    latest = {}
    for r in read_topic(kafka, names.trainer_progress):
        latest[r.key] = r.value
    assert [v for v in latest.values() if v is not None] == []  # the entry no commit needs is tombstoned


class _Waiting(TrainerSensor):
    def __init__(self) -> None:
        self.waiting = 0

    def on_partitions_waiting(self, n: int) -> None:
        self.waiting = n


def test_a_partition_whose_entry_is_gone_waits_until_an_operator_accepts_nothing_resolved_past_its_commit(
    kafka, tq_store, unique, capsys
):
    """A commit naming an entry no one can read (a commit that reached the coordinator after its entry was
    tombstoned, or the topic recreated) holds its partition for good; `rlstream trainer accept-unresolved`
    is the way out, at the price it states."""
    names = setup_topics(kafka, f"pa-{unique}", partitions=1)
    group = f"pa-{unique}"
    groups = [finalized(f"a{i}-{unique}") for i in range(4)]
    publish(kafka, tq_store, names, groups)
    c = Consumer(kafka.consumer(group))
    try:  # g0 passed, the rest named resolved by an entry that is not on the topic
        c.commit(
            offsets=[TopicPartition(names.finalized, 0, 1, metadata=carried_metadata("gone.1", 2))], asynchronous=False
        )
    finally:
        c.close()
    args = ["trainer", "accept-unresolved", "--partition", "0", "--consumer-group", group,
            "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix]  # fmt: skip
    assert main(args) == 1  # without --yes: what it would do, and nothing written
    assert "trained a second time" in capsys.readouterr().err
    assert not list(read_topic(kafka, names.trainer_progress))

    now = [0.0]
    sensor = _Waiting()
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=group)
    trainer = ExperienceConsumer(kafka, tq_store, cfg, ready_first(), sensor=sensor, runtime=_Jumps(now))
    try:
        deadline = time.monotonic() + 30
        while sensor.waiting != 1 or trainer.counts.waiting:  # assigned, and not read
            assert time.monotonic() < deadline, (sensor.waiting, trainer.counts)
            trainer.poll(0.2)
        for _ in range(5):
            now[0] += 60
            trainer.poll(0.2)
        assert sensor.waiting == 1 and trainer.counts.reread == 0 and trainer.counts.waiting == 0
        assert main([*args, "--yes"]) == 0
        assert "naming nothing resolved past offset 1" in capsys.readouterr().out
        trained: list[str] = []
        while len(trained) < 3:
            assert time.monotonic() < deadline + 60, (trained, trainer.counts)
            now[0] += 60
            meta = trainer.select(0, min_groups=1, max_groups=3, timeout_s=0.5)
            if meta is not None:
                trained += [g.group_id for g in meta.groups]
                trainer.ack(meta)
    finally:
        trainer.close()
    assert sorted(trained) == sorted(g.group_id for g in groups[1:]) and sensor.waiting == 0
    assert main(args) == 1  # nothing to accept any more: the trainer's commit names nothing
    assert "names no progress entry" in capsys.readouterr().err


class _Jumps(RealRuntime):
    """The real clock, moved on by `jump[0]` seconds: the commit reads' backoffs pass when the test says."""

    def __init__(self, jump: list[float]):
        self._jump = jump

    def monotonic(self) -> float:
        return time.monotonic() + self._jump[0]


def _commit_naming_an_entry(kafka, names, group: str, offset: int, ranges: list[tuple[int, int]], token: str) -> None:
    """What a trainer whose ranges did not fit its metadata leaves: the entry on the progress topic, then its commit."""
    chunks = progress_chunks(group, names.finalized, 0, offset, token, ranges, int(time.time() * 1000))
    producer = AckedProducer(kafka)
    try:
        key = lambda c: entry_key(group, names.finalized, 0, token, c.chunk)  # noqa: E731
        producer.send([Outgoing(names.trainer_progress, key(c), c.to_bytes()) for c in chunks])
    finally:
        producer.close()
    c = Consumer(kafka.consumer(group))
    try:
        tp = TopicPartition(names.finalized, 0, offset, metadata=carried_metadata(token, len(chunks)))
        c.commit(offsets=[tp], asynchronous=False)
    finally:
        c.close()


def test_resume_without_a_checkpoint_reads_the_trainer_s_place_from_the_entry_its_commit_names(
    kafka, tq_store, unique, capsys
):
    """`resume` with no checkpoint takes the trainer's commits as its place: a commit naming an entry counts the
    records it names as resolved, and one whose entry cannot be read is refused, never read as nothing resolved."""
    names = setup_topics(kafka, f"pr-{unique}", partitions=1)
    group = f"pr-{unique}"
    groups = [finalized(f"r{i}-{unique}") for i in range(6)]
    publish(kafka, tq_store, names, groups)
    _commit_naming_an_entry(kafka, names, group, 1, [(2, 2), (4, 4)], "t1.1")
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True)
    report = resume(kafka, tq_store, config, None, reassembler_consumer_group=f"re-{unique}")
    # r2 and r4 named by its entry: resolved past the cut (r0, before the commit, is not read since resume
    # reads from the cut, issue 30 item 9); r1, r3, r5 to be handed back (no spill).
    assert (report.trained, report.hand_back_finalized, report.unaccounted) == (2, 3, [])
    producer = AckedProducer(kafka)
    try:  # the entry is gone
        producer.send([Outgoing(names.trainer_progress, entry_key(group, names.finalized, 0, "t1.1", 0), None)])
    finally:
        producer.close()
    with pytest.raises(CommitUnreadable, match=r"\[0\].*chunk 0 of 1 of token 't1.1' is missing"):
        resume(kafka, tq_store, config, None, reassembler_consumer_group=f"re-{unique}")
    args = ["trainer", "accept-unresolved", "--partition", "0", "--consumer-group", group, "--yes",
            "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    report = resume(kafka, tq_store, config, None, reassembler_consumer_group=f"re-{unique}")
    assert (report.trained, report.hand_back_finalized) == (0, 5)  # nothing past the commit (r0 is before it)
