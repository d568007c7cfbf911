"""`rlstream trainer accept-unresolved`: the way out for a trainer partition whose progress entry is gone.

A trainer's commit whose resolved ranges did not fit its metadata names an entry on
`<prefix>.trainer.progress` (`workers/trainer/progress.py`). When that entry is missing (the topic
recreated or its records deleted, or a commit that reached the coordinator only after the trainer had
tombstoned its entry) the trainer does not read the partition at all, rather than take the records
the commit named resolved for new ones: their rows are gone, so they would be handed back and trained
twice. It waits with a WARNING and `rlstream_trainer_partitions_waiting` above 0, for good.

This writes, for the token and chunk count the partition's commit names, an entry that names nothing
resolved past the committed offset. The trainer (or the next one) then reads the partition from that
offset, and every record past it comes in as new: those trained already whose rows were cleared are
handed back to be generated again, those whose rows are still in TQ are trained again. That is the
cost of going on; the other way is a partition that is never read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from schemas.errors import RlstreamError
from schemas.trainer_progress import TrainerProgress
from streams.config import KafkaConfig
from streams.consumer import end_offsets, partitions_of
from streams.producer import AckedProducer, Outgoing
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.position import carried
from workers.trainer.progress import ProgressCarrier, entry_key


class NothingToAccept(RlstreamError):
    """The partition is not held back by its progress entry: nothing is written."""


@dataclass(frozen=True)
class Blocked:
    """A partition whose commit names a progress entry that cannot be read whole, and what lies past it."""

    topic: str
    partition: int
    offset: int
    token: str
    chunks: int
    reason: str
    records_past: int

    def warning(self) -> str:
        return (
            f"{self.topic}[{self.partition}]: its commit at offset {self.offset} names progress entry"
            f" {self.token!r} ({self.chunks} chunk(s)), which cannot be read: {self.reason}. Accepting that"
            f" nothing is resolved past offset {self.offset} makes the trainer read the {self.records_past}"
            " record(s) past it as new: groups it trained already whose rows were cleared are handed back to be"
            " generated again, and those whose rows are still in TQ are trained a second time."
        )


def _commit(kafka: KafkaConfig, consumer_group: str, topic: str, partition: int) -> TopicPartition:
    c = Consumer(kafka.consumer(consumer_group))  # committed() only: it never joins the group
    try:
        if partition not in partitions_of(c, topic):
            raise NothingToAccept(f"{topic} has no partition {partition}")
        (tp,) = c.committed([TopicPartition(topic, partition)], timeout=30)
    finally:
        c.close()
    if tp.error is not None:
        raise RlstreamError(f"{topic}[{partition}]: the commit of {consumer_group!r} is unreadable: {tp.error.str()}")
    return tp


def _read(kafka: KafkaConfig, progress_topic: str, consumer_group: str, tp: TopicPartition):
    carrier = ProgressCarrier(KafkaTrainerClients(kafka), progress_topic, consumer_group, tp.topic, "ops")
    return carrier.read([tp])


def find_blocked(kafka: KafkaConfig, consumer_group: str, topic: str, progress_topic: str, partition: int) -> Blocked:
    """The partition's commit and why the entry it names cannot be read; `NothingToAccept` if it is not so."""
    tp = _commit(kafka, consumer_group, topic, partition)
    where = f"{topic}[{partition}] of consumer group {consumer_group!r}"
    named = carried(tp.metadata) if tp.offset >= 0 else None
    if named is None:
        raise NothingToAccept(
            f"{where}: its commit names no progress entry (offset {tp.offset}); if a trainer waits on it, its"
            " WARNING lines say why (committed offsets unreadable: the brokers)"
        )
    got = _read(kafka, progress_topic, consumer_group, tp)
    if partition not in got.unreadable:
        raise NothingToAccept(
            f"{where}: the entry its commit names is on {progress_topic} whole; if a trainer waits on it, its"
            " WARNING lines say why"
        )
    _, end = end_offsets(kafka, topic)[partition]
    return Blocked(topic, partition, tp.offset, *named, got.unreadable[partition], max(0, end - tp.offset))


def accept_unresolved(kafka: KafkaConfig, consumer_group: str, progress_topic: str, blocked: Blocked) -> None:
    """Write the entry `blocked`'s commit names, naming nothing resolved past its offset, and check it reads."""
    now_ms = int(time.time() * 1000)
    records = []
    for chunk in range(blocked.chunks):
        entry = TrainerProgress(
            consumer_group=consumer_group,
            topic=blocked.topic,
            partition=blocked.partition,
            offset=blocked.offset,
            token=blocked.token,
            chunk=chunk,
            chunks=blocked.chunks,
            base=blocked.offset,
            ranges=(),
            time_ms=now_ms,
        )
        key = entry_key(consumer_group, blocked.topic, blocked.partition, blocked.token, chunk)
        records.append(Outgoing(progress_topic, key, entry.to_bytes()))
    producer = AckedProducer(kafka)
    try:
        producer.send(records)
    finally:
        producer.close()
    tp = _commit(kafka, consumer_group, blocked.topic, blocked.partition)
    got = _read(kafka, progress_topic, consumer_group, tp)
    if blocked.partition in got.unreadable or tp.offset != blocked.offset:
        raise RlstreamError(
            f"{blocked.topic}[{blocked.partition}]: the entry was written but the commit now reads"
            f" {got.unreadable.get(blocked.partition) or f'at offset {tp.offset}, not {blocked.offset}'}"
        )
