"""Finalized groups for the trainer's integration tests: published as receipts and finalized by a real worker."""

from __future__ import annotations

import random
from collections.abc import Mapping

from schemas.finalized import FinalizedGroup
from streams.consumer import committed_offsets, read_topic
from tests.integration.helpers import SMALL, drive, finalized_records, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames


def finalize_groups(
    kafka,
    tq_store,
    prefix: str,
    *,
    versions=range(2),
    per_version: int = 2,
    partitions: int = 3,
    seed: int = 5,
    shapes: Mapping[str, SyntheticShape] | None = None,
) -> tuple[TopicNames, dict[str, FinalizedGroup]]:
    """Groups `v{v}-g{i}` produced by policies of `versions`, finalized by a real worker; group_id -> record.

    Every group has the SMALL shape unless `shapes` names another for its id.
    """
    names = setup_topics(kafka, prefix, partitions=partitions)
    shapes = shapes or {}
    rollouts = [
        r
        for v in versions
        for i in range(per_version)
        for r in make_group(f"v{v}-g{i}", 10 * v + i, v, shape=shapes.get(f"v{v}-g{i}", SMALL))
    ]
    random.Random(seed).shuffle(rollouts)
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(rollouts)
    pub.close()
    worker = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=prefix, worker_id="w", consumer_group=f"re-{prefix}")
    )
    total = per_version * len(versions)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= total, timeout_s=120)
    finally:
        worker.close()
    return names, {r.group_id: r for r in finalized_records(kafka, names)}


def committed_at_end(kafka, consumer_group: str, topic: str) -> bool:
    """Whether the consumer group's committed offset is past the last record of every partition of `topic`.

    (Past the last record, not at the end offset: a transaction's commit marker may follow it.)
    """
    last: dict[int, int] = {}
    for r in read_topic(kafka, topic):
        last[r.partition] = max(r.offset, last.get(r.partition, -1))
    committed = committed_offsets(kafka, consumer_group, topic)
    return all(committed.get(p, -1) > offset for p, offset in last.items())
