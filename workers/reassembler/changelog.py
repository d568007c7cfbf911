"""Reading a receipts partition's state changelog for a restore: from its restore point, not its beginning.

Every step that writes state for a partition also writes its `PartitionProgress`, which names the
state offset (`restore_from`) before which nothing a successor needs lies: closed groups older than
the horizon are forgotten (and tombstoned), and open groups and remembered closed ones have their
entries after it. So a restore reads the partition's tail to find the latest progress entry, then
from its `restore_from` on: its cost follows the horizon, not the partition's whole history.
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import TopicPartition

from schemas.state import PartitionProgress, decode_state_entry
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from workers.reassembler.restore import LogEntry

# Records read back from the end to find the latest progress entry. One step writes one per
# partition with any state, so it lies within the last step's entries unless steps were huge.
TAIL_RECORDS = 10_000


@dataclass(frozen=True)
class Changelog:
    """The part of a state partition a restore needs, in log order."""

    entries: list[LogEntry]
    read_from: int
    # The next offset of the state partition when it was read: where this worker's entries follow.
    end_offset: int


def read_changelog(
    kafka: KafkaConfig,
    topic: str,
    partition: int,
    *,
    tail_records: int = TAIL_RECORDS,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> Changelog:
    """Read a state partition from the restore point its latest progress entry names (all of it if none does).

    Its consumers come from `api` and its reads wait on `runtime` (`streams.consumer.read_topic`).
    """
    low, high = _bounds(kafka, topic, partition, api)

    def read(start: int, stop: int) -> list[LogEntry]:
        return _read(kafka, topic, partition, start, stop, api, runtime)

    tail_start = max(low, high - tail_records)
    tail = read(tail_start, high)
    restore_from = low
    for record in reversed(tail):
        if isinstance(record.entry, PartitionProgress):
            restore_from = max(low, record.entry.restore_from)
            break
    if restore_from >= tail_start:
        return Changelog([r for r in tail if r.offset >= restore_from], restore_from, high)
    return Changelog(read(restore_from, tail_start) + tail, restore_from, high)


def _bounds(kafka: KafkaConfig, topic: str, partition: int, api: KafkaApi) -> tuple[int, int]:
    # read_committed: the high mark is the last stable offset, below any still-open transaction.
    c = api.Consumer(kafka.consumer(f"rlstream-changelog-{partition}", read_committed=True))
    try:
        return c.get_watermark_offsets(TopicPartition(topic, partition), timeout=30, cached=False)
    finally:
        c.close()


def _read(
    kafka: KafkaConfig, topic: str, partition: int, start: int, stop: int, api: KafkaApi, runtime: Runtime
) -> list[LogEntry]:
    if stop <= start:
        return []
    records = read_topic(
        kafka, topic, partitions=[partition], start={partition: start}, stop={partition: stop}, api=api, runtime=runtime
    )
    return [
        LogEntry(rec.offset, rec.key, decode_state_entry(rec.value) if rec.value is not None else None)
        for rec in records
    ]
