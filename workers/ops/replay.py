"""Copy a slice of any rlstream topic into a replay topic, for debugging a run after the fact.

The slice is chosen by any combination of per-partition offset ranges, a time range, a set of group
ids and a weight-version range. Each record keeps its key, headers and timestamp and goes to the
same partition number as in the source, so a replayed receipts slice stays co-partitioned the way
a reassembler expects (all receipts of a group in one partition, state co-partitioned).

The copy is one Kafka transaction: a read_committed reader (a reassembler, `tail`) sees the whole
slice or nothing, never half a slice from an interrupted run; and the transactional id, derived from
the destination, fences a concurrent replay into the same topic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from schemas.errors import InvalidArgument, SchemaError
from streams.admin import TopicSpec, create_topics, list_topics, partition_count
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import Outgoing, TransactionalProducer
from workers.topics import (
    DEADLETTER_ROLE,
    TopicNames,
    decode_value,
    message_group_id,
    message_weight_versions,
    topic_role,
)


@dataclass
class ReplayReport:
    """What a replay copied: per source partition, records scanned and copied (and their offset span)."""

    source_topic: str
    dest_topic: str
    created: bool
    scanned: dict[int, int] = field(default_factory=dict)
    copied: dict[int, int] = field(default_factory=dict)
    first_offset: dict[int, int] = field(default_factory=dict)
    last_offset: dict[int, int] = field(default_factory=dict)
    undecodable: int = 0

    @property
    def total(self) -> int:
        return sum(self.copied.values())

    def lines(self) -> list[str]:
        out = [
            f"{self.total} record(s) copied from {self.source_topic} to {self.dest_topic}"
            f"{' (created)' if self.created else ''}"
        ]
        for p in sorted(self.scanned):
            span = f" offsets {self.first_offset[p]}..{self.last_offset[p]}" if self.copied.get(p) else ""
            out.append(f"  partition {p}: {self.copied.get(p, 0)} of {self.scanned[p]} scanned{span}")
        if self.undecodable:
            out.append(
                f"  {self.undecodable} record(s) could not be decoded to check a group id or weight "
                f"version filter and were not copied"
            )
        return out


def parse_partition_offsets(text: str) -> dict[int, tuple[int, int]]:
    """`0:10-20,1:0-5` -> {0: (10, 20), 1: (0, 5)} (inclusive ranges)."""
    out: dict[int, tuple[int, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            p, _, span = part.partition(":")
            lo, _, hi = span.partition("-")
            out[int(p)] = (int(lo), int(hi))
        except ValueError:
            raise InvalidArgument(f"partition offsets {part!r} are not of the form PARTITION:FIRST-LAST") from None
        if out[int(p)][0] > out[int(p)][1] or out[int(p)][0] < 0:
            raise InvalidArgument(f"partition offsets {part!r}: need 0 <= FIRST <= LAST")
    return out


def replay(
    kafka: KafkaConfig,
    source_topic: str,
    dest_name: str,
    *,
    prefix: str = "",
    offsets: dict[int, tuple[int, int]] | None = None,
    time_range_ms: tuple[int, int] | None = None,
    group_ids: set[str] | None = None,
    weight_versions: tuple[int, int] | None = None,
    transaction_timeout_ms: int = 600_000,
) -> ReplayReport:
    """Copy the matching committed records of `source_topic` to `TopicNames(prefix).replay(dest_name)`.

    offsets: partition -> (first, last) inclusive; only those partitions are read. time_range_ms:
    [since, until) on record timestamps. group_ids: records whose key (or decoded value) names one of
    them. weight_versions: (lo, hi) inclusive, matching records whose weight-version range overlaps it
    (finalized: group_min_wv..group_max_wv; receipts and dead letters: the manifest's versions);
    records carrying no weight version (state entries) never match a weight-version filter.
    """
    dest = TopicNames(prefix).replay(dest_name)
    n_parts = partition_count(kafka, source_topic)
    _check_slice(source_topic, dest, n_parts, offsets, time_range_ms, weight_versions)
    existed = dest in list_topics(kafka)
    create_topics(kafka, [TopicSpec(dest, n_parts)])
    report = ReplayReport(source_topic, dest, created=not existed)

    partitions = sorted(offsets) if offsets else list(range(n_parts))
    start = {p: lo for p, (lo, _) in (offsets or {}).items()}
    stop = {p: hi + 1 for p, (_, hi) in (offsets or {}).items()}
    if time_range_ms is not None:
        for p, off in _offsets_for_time(kafka, source_topic, partitions, time_range_ms[0]).items():
            start[p] = max(start.get(p, 0), off)
    keep = _Filter(topic_role(source_topic), time_range_ms, group_ids, weight_versions, report)

    producer = TransactionalProducer(kafka, f"rlstream.replay.{dest}", transaction_timeout_ms=transaction_timeout_ms)
    with producer.transaction():
        for rec in read_topic(kafka, source_topic, start=start, stop=stop, partitions=partitions):
            report.scanned[rec.partition] = report.scanned.get(rec.partition, 0) + 1
            if not keep(rec):
                continue
            producer.produce(
                Outgoing(dest, rec.key, rec.value, rec.headers, partition=rec.partition, timestamp_ms=rec.timestamp_ms)
            )
            report.copied[rec.partition] = report.copied.get(rec.partition, 0) + 1
            report.first_offset.setdefault(rec.partition, rec.offset)
            report.last_offset[rec.partition] = rec.offset
        for p in partitions:
            report.scanned.setdefault(p, 0)
    return report


def _check_slice(source_topic, dest, n_parts, offsets, time_range_ms, weight_versions) -> None:
    if dest == source_topic:
        raise InvalidArgument(f"cannot replay {source_topic} into itself")
    if time_range_ms is not None and time_range_ms[0] >= time_range_ms[1]:
        raise InvalidArgument(f"empty time range {time_range_ms[0]}..{time_range_ms[1]}")
    if weight_versions is not None and weight_versions[0] > weight_versions[1]:
        raise InvalidArgument(f"empty weight-version range {weight_versions[0]}..{weight_versions[1]}")
    if offsets and max(offsets) >= n_parts:
        raise InvalidArgument(f"{source_topic} has {n_parts} partition(s); no partition {max(offsets)}")


@dataclass(frozen=True)
class _Filter:
    """Whether a scanned record belongs to the slice; counts the ones whose value cannot be decoded."""

    role: str | None
    time_range_ms: tuple[int, int] | None
    group_ids: set[str] | None
    weight_versions: tuple[int, int] | None
    report: ReplayReport

    def __call__(self, rec) -> bool:
        if self.time_range_ms is not None and not self.time_range_ms[0] <= rec.timestamp_ms < self.time_range_ms[1]:
            return False
        needs_value = self.weight_versions is not None
        if self.group_ids is None and not needs_value:
            return True
        keep = _matches(rec, self.role, self.group_ids, self.weight_versions, needs_value)
        if keep is None:
            self.report.undecodable += 1
        return bool(keep)


def _matches(rec, role, group_ids, weight_versions, needs_value) -> bool | None:
    """Whether a record passes the group-id and weight-version filters; None if its value is undecodable."""
    if group_ids is not None and not needs_value and rec.key is not None and role not in (None, DEADLETTER_ROLE):
        # The key is the group id on receipts, finalized and state topics: no decode needed.
        return rec.key.decode(errors="replace") in group_ids
    try:
        msg = decode_value(rec.value, role)
    except SchemaError:
        return None
    if group_ids is not None and message_group_id(msg) not in group_ids:
        return False
    if weight_versions is not None:
        span = message_weight_versions(msg)
        if span is None or span[1] < weight_versions[0] or span[0] > weight_versions[1]:
            return False
    return True


def _offsets_for_time(kafka: KafkaConfig, topic: str, partitions: list[int], since_ms: int) -> dict[int, int]:
    """Per partition, the first offset whose timestamp is >= since_ms (the end when there is none)."""
    c = Consumer(kafka.consumer("rlstream-replay-lookup"))
    try:
        found = c.offsets_for_times([TopicPartition(topic, p, since_ms) for p in partitions], timeout=10)
        out = {}
        for tp in found:
            if tp.offset >= 0:
                out[tp.partition] = tp.offset
            else:  # no record at or after since_ms: start at the end
                out[tp.partition] = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)[1]
        return out
    finally:
        c.close()
