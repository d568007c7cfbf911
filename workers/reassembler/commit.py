"""Where a step's outputs and input offsets commit: one Kafka transaction for all of a worker's partitions.

Each partition task prepares a `PartitionCommit`; `commit_transaction` produces them all and the
receipts offsets they are safe to advance to, and commits, so a step's finalized records, dead
letters, state entries and offsets become visible together or not at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from confluent_kafka import TopicPartition

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from schemas.regenerate import Regenerate
from schemas.state import PROGRESS_KEY, GroupState, PartitionProgress
from streams.producer import Outgoing, TransactionalProducer
from workers.reassembler.errors import LeaseRefused
from workers.telemetry.sensors import ReassemblerSensor
from workers.topics import TopicNames


@dataclass(frozen=True)
class PartitionCommit:
    """What one receipts partition contributes to a step's transaction."""

    partition: int
    finalized: tuple[FinalizedGroup, ...] = ()
    dead_letters: tuple[DeadLetter, ...] = ()
    # Groups handed back for regeneration: committed with the offsets that close them.
    regenerate: tuple[Regenerate, ...] = ()
    # Produced in this order to the same state partition; compaction keeps each group's last entry.
    state: tuple[GroupState, ...] = ()
    progress: PartitionProgress | None = None
    # The receipts offset a successor resumes from; None leaves the committed offset where it is.
    commit_offset: int | None = None
    # This step's closed entries that name staging keys: cleared after the commit, recorded next step.
    staging_to_clear: tuple[GroupState, ...] = ()
    # Closed groups the partition forgot this step (past its horizon): tombstoned in the state topic.
    forgotten: tuple[str, ...] = ()
    # (staging key, group id, rollout id) of receipts refused this step: cleared after the commit.
    refused_staging: tuple[tuple[str, str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.finalized
            or self.dead_letters
            or self.regenerate
            or self.state
            or self.forgotten
            or self.progress
            or self.commit_offset is not None
        )


@dataclass
class StateWrites:
    """Where a committed step's state records of one partition landed in the state topic."""

    # group id -> offset of its first entry in the step.
    first_offsets: dict[str, int] = field(default_factory=dict)
    # One past the highest offset written: the step's entries all lie below it.
    end_offset: int = -1

    def on_delivery(self, group_id: str | None):
        def record(err, msg) -> None:
            if err is None:
                if group_id is not None:
                    self.first_offsets.setdefault(group_id, msg.offset())
                self.end_offset = max(self.end_offset, msg.offset() + 1)

        return record


def commit_transaction(
    producer: TransactionalProducer,
    commits: Sequence[PartitionCommit],
    *,
    topics: TopicNames,
    receipts_topic: str,
    consumer_group_metadata,
    before_commit: Callable[[], None] = lambda: None,
) -> dict[int, StateWrites]:
    """Produce every partition's outputs and offsets in one transaction and commit it (KafkaException if not).

    Returns, per partition, where its state records landed, for the restore point of later steps.
    """
    producer.begin()
    offsets = []
    writes: dict[int, StateWrites] = {}
    for c in commits:
        for f in c.finalized:
            producer.produce(Outgoing(topics.finalized, f.group_id.encode(), f.to_bytes()))
        for d in c.dead_letters:
            producer.produce(Outgoing(topics.deadletter, d.source_key, d.to_bytes()))
        for r in c.regenerate:
            producer.produce(Outgoing(topics.regenerate, r.group_id.encode(), r.to_bytes()))
        written = writes[c.partition] = StateWrites()
        for s in c.state:
            out = Outgoing(topics.state, s.group_id.encode(), s.to_bytes(), partition=c.partition)
            producer.produce(out, written.on_delivery(s.group_id))
        # After the entries they follow: a tombstone must be the last word on its group.
        for gid in c.forgotten:
            producer.produce(
                Outgoing(topics.state, gid.encode(), None, partition=c.partition), written.on_delivery(None)
            )
        if c.progress is not None:
            out = Outgoing(topics.state, PROGRESS_KEY, c.progress.to_bytes(), partition=c.partition)
            producer.produce(out, written.on_delivery(None))
        if c.commit_offset is not None:
            offsets.append(TopicPartition(receipts_topic, c.partition, c.commit_offset))
    if offsets:
        producer.send_offsets(offsets, consumer_group_metadata)
    # The commit would flush them anyway; flushed first, the records are in the log when a fault
    # stops the step here, as they are when a crash interrupts the commit itself.
    producer.flush()
    before_commit()
    producer.commit()
    # The commit flushed every record; their delivery reports are served here.
    producer.poll(0)
    return writes


def member_metadata(consumer, tasks_member: str | None, *, worker_id: str, consumer_group: str):
    """The consumer-group metadata to send offsets with, only while the consumer is the member its tasks
    belong to: `tasks_member`, its id when its last rebalance callback was served (else LeaseRefused).

    A member the coordinator removed (its session ran out in a freeze, its heartbeats were lost, an
    ILLEGAL_GENERATION before) has its member id reset by librdkafka as soon as it learns so; the loss
    of its partitions waits for the application's next poll. Its generation is kept, so the
    coordinator refuses its offsets, except after an ILLEGAL_GENERATION, which resets that too:
    metadata of generation -1 and no member id is taken in a transaction with no membership check
    at all (`offsets_in_transactions`, on the real broker). And a member that joined again under a
    new id (a static member's rejoin) has a current generation before it has served what the rejoin
    did to its partitions. Either way the worker's tasks are stale: nothing is put or committed for
    them until the next poll has served the callbacks. Taken before the check, so a reset that lands
    between the two is caught too.
    """
    metadata = consumer.consumer_group_metadata()
    member = consumer.memberid()
    if not member or member != tasks_member:
        raise LeaseRefused(
            f"{worker_id} is not the member of consumer group {consumer_group} its tasks were assigned to"
            f" ({'no member id' if not member else 'joined again as ' + member}; the next poll serves"
            " what that did to its partitions): it may not own them"
        )
    return metadata


def confirm_membership(
    producer: TransactionalProducer,
    committed: dict[int, int | None],
    *,
    receipts_topic: str,
    consumer_group_metadata,
) -> None:
    """A transaction of nothing but the partitions' committed offsets, sent again (KafkaException if refused).

    The group coordinator checks the consumer-group metadata that comes with them (KIP-447): from a
    member of an older generation, one whose partitions moved on, the commit fails. A partition
    never committed sends offset 0, which resumes where no commit would (auto.offset.reset=earliest).
    """
    producer.begin()
    offsets = [TopicPartition(receipts_topic, p, 0 if o is None else o) for p, o in sorted(committed.items())]
    if offsets:
        producer.send_offsets(offsets, consumer_group_metadata)
    producer.commit()


def dead_letter_counts(commits: Sequence[PartitionCommit]) -> dict[str, int]:
    """Dead letters of a step by error kind."""
    return dict(Counter(d.error_kind for c in commits for d in c.dead_letters))


def report_commit(sensor: ReassemblerSensor, commits: Sequence[PartitionCommit], seconds: float) -> None:
    """What a committed step of `seconds` emitted, told to the worker's sensor."""
    sensor.on_commit(
        seconds=seconds, finalized=sum(len(c.finalized) for c in commits), dead_letters=dead_letter_counts(commits)
    )
    sensor.on_handed_back(sum(len(c.regenerate) for c in commits))
