"""Where a step's outputs and input offsets commit: one Kafka transaction for all of a worker's partitions.

Each partition task prepares a `PartitionCommit`; `commit_transaction` produces them all and the
receipts offsets they are safe to advance to, and commits, so a step's finalized records, dead
letters, state entries and offsets become visible together or not at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from confluent_kafka import TopicPartition

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from schemas.state import PROGRESS_KEY, GroupState, PartitionProgress
from streams.producer import Outgoing, TransactionalProducer
from workers.topics import TopicNames


@dataclass(frozen=True)
class PartitionCommit:
    """What one receipts partition contributes to a step's transaction."""

    partition: int
    finalized: tuple[FinalizedGroup, ...] = ()
    dead_letters: tuple[DeadLetter, ...] = ()
    # Produced in this order to the same state partition; compaction keeps each group's last entry.
    state: tuple[GroupState, ...] = ()
    progress: PartitionProgress | None = None
    # The receipts offset a successor resumes from; None leaves the committed offset where it is.
    commit_offset: int | None = None
    # This step's closed entries that name staging keys: cleared after the commit, recorded next step.
    closed: tuple[GroupState, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.finalized or self.dead_letters or self.state or self.progress or self.commit_offset is not None
        )


def commit_transaction(
    producer: TransactionalProducer,
    commits: Sequence[PartitionCommit],
    *,
    topics: TopicNames,
    receipts_topic: str,
    consumer_group_metadata,
    before_commit: Callable[[], None] = lambda: None,
) -> None:
    """Produce every partition's outputs and offsets in one transaction and commit it (KafkaException if not)."""
    producer.begin()
    offsets = []
    for c in commits:
        for f in c.finalized:
            producer.produce(Outgoing(topics.finalized, f.group_id.encode(), f.to_bytes()))
        for d in c.dead_letters:
            producer.produce(Outgoing(topics.deadletter, d.source_key, d.to_bytes()))
        for s in c.state:
            producer.produce(Outgoing(topics.state, s.group_id.encode(), s.to_bytes(), partition=c.partition))
        if c.progress is not None:
            producer.produce(Outgoing(topics.state, PROGRESS_KEY, c.progress.to_bytes(), partition=c.partition))
        if c.commit_offset is not None:
            offsets.append(TopicPartition(receipts_topic, c.partition, c.commit_offset))
    if offsets:
        producer.send_offsets(offsets, consumer_group_metadata)
    before_commit()
    producer.commit()


def dead_letter_counts(commits: Sequence[PartitionCommit]) -> dict[str, int]:
    """Dead letters of a step by error kind."""
    return dict(Counter(d.error_kind for c in commits for d in c.dead_letters))
