"""A restart with more resolved records past the commit than its metadata holds hands nothing back, on the
real broker (issue 30, item 3b).

Commit metadata was cut at 3,500 characters (about 870 alternating ranges): the records left out,
trained already, were read again as new after a restart and trained twice (or, their rows gone, handed
back). Past that size the ranges now go to `<prefix>.trainer.progress`, acknowledged before the commit
that names them.
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, TopicPartition

from schemas.trainer_progress import TrainerProgress
from streams.consumer import read_topic
from streams.tq import TRAIN
from tests.integration.helpers import setup_topics
from tests.integration.trainer.direct import finalized, publish
from tests.integration.trainer.staging import committed_at_end
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first
from workers.trainer.position import MAX_METADATA_CHARS, carried

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
