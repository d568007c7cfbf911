"""Re-driving dead letters: re-publish their original bytes to where they came from, once.

Which letters were already handled is kept as committed offsets of one consumer group per error
kind on the dead-letter topic (`<consumer_group>.<kind>`): every letter of kind K below that offset
was redriven or skipped. Re-publishing and advancing those offsets happen in one Kafka transaction,
so running redrive twice (or after a crash) never re-publishes a letter twice, and redriving one
kind leaves the other kinds' letters for later.

A redriven record carries the `rlstream.redrive_count` header; if it fails again, the reassembler's
new dead letter carries that count, and letters at `max_redrives` are skipped: no endless loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from schemas.deadletter import ERROR_KINDS, DeadLetter
from schemas.errors import InvalidArgument, SchemaError
from streams.config import KafkaConfig
from streams.consumer import committed_offsets, end_offsets, read_topic
from streams.producer import Outgoing, TransactionalProducer
from workers.reassembler.decode import REDRIVE_HEADER, SOURCE_TIMESTAMP_HEADER
from workers.topics import TopicNames


@dataclass
class RedriveReport:
    """What one redrive did (or, as a dry run, would do)."""

    deadletter_topic: str
    dry_run: bool
    redriven: list[tuple[str, str, int, int]] = field(default_factory=list)  # (kind, source topic, partition, offset)
    destinations: dict[str, int] = field(default_factory=dict)
    skipped_max: int = 0
    skipped_truncated: int = 0
    skipped_other_kind: int = 0
    already_done: int = 0
    undecodable: int = 0

    def lines(self) -> list[str]:
        verb = "would redrive" if self.dry_run else "redrove"
        out = [
            f"{verb} {len(self.redriven)} dead letter(s) from {self.deadletter_topic}"
            + "".join(f"; {n} to {t}" for t, n in sorted(self.destinations.items()))
        ]
        for kind, topic, p, off in self.redriven[:50]:
            out.append(f"  {kind}: {topic} partition {p} offset {off}")
        out.append(
            f"skipped: {self.skipped_max} at the redrive limit, {self.skipped_truncated} kept only in part, "
            f"{self.already_done} already handled, "
            f"{self.skipped_other_kind} of other kinds, {self.undecodable} undecodable"
        )
        return out


def redrive(
    kafka: KafkaConfig,
    names: TopicNames,
    *,
    reason: str | None = None,
    to_source: bool = False,
    to_topic: str | None = None,
    max_redrives: int = 1,
    consumer_group: str = "rlstream.redrive",
) -> RedriveReport:
    """Re-publish dead letters (of kind `reason`, or all) whose redrive_count < max_redrives.

    to_source: to the topic each came from; to_topic: all to that topic instead (e.g. a replay
    topic); neither: a dry run that publishes and records nothing.
    """
    if to_source and to_topic:
        raise InvalidArgument("pass --to-source or --to TOPIC, not both")
    if max_redrives < 1:
        raise InvalidArgument(f"max redrives must be >= 1, got {max_redrives}")
    topic = names.deadletter
    dry_run = not (to_source or to_topic)
    report = RedriveReport(topic, dry_run)
    # Created (and so fencing any concurrent redrive) before reading what was already done, so
    # two redrives at once cannot both re-publish the same letters.
    producer = None if dry_run else TransactionalProducer(kafka, f"{consumer_group}.{topic}")
    ends = {p: high for p, (_, high) in end_offsets(kafka, topic).items()}
    kinds = {reason} if reason else set(ERROR_KINDS)
    done: dict[str, dict[int, int]] = {k: _done(kafka, consumer_group, k, topic) for k in kinds}
    start = {p: min(done[k].get(p, 0) for k in kinds) for p in ends}
    out = [
        _republished(letter, to_topic, report)
        for letter in _due_letters(kafka, topic, start, ends, done, report, reason, max_redrives, consumer_group)
    ]
    if producer is not None:
        _commit(kafka, producer, out, topic, ends, sorted(done), consumer_group)
    return report


def _due_letters(kafka, topic, start, ends, done, report, reason, max_redrives, consumer_group):
    """The dead letters to redrive: of the kind asked, not handled yet, under the redrive limit."""
    for rec in read_topic(kafka, topic, start=start, stop=ends):
        try:
            letter = DeadLetter.from_bytes(rec.value)
        except SchemaError:
            report.undecodable += 1
            continue
        kind = letter.error_kind
        if reason and kind != reason:
            report.skipped_other_kind += 1
            continue
        if kind not in done:  # a kind newer than this reader: track it too
            done[kind] = _done(kafka, consumer_group, kind, topic)
        if rec.offset < done[kind].get(rec.partition, 0):
            report.already_done += 1
        elif letter.redrive_count >= max_redrives:
            report.skipped_max += 1
        elif letter.original_truncated:
            # Only a prefix of the record was kept (it was too large to copy whole): nothing to re-publish.
            report.skipped_truncated += 1
        else:
            yield letter


def _republished(letter: DeadLetter, to_topic: str | None, report: RedriveReport) -> Outgoing:
    dest = to_topic or letter.source_topic
    report.redriven.append((letter.error_kind, letter.source_topic, letter.source_partition, letter.source_offset))
    report.destinations[dest] = report.destinations.get(dest, 0) + 1
    headers = [(REDRIVE_HEADER, str(letter.redrive_count + 1).encode())]
    if letter.source_timestamp_ms:
        # A late receipt redriven after its group was forgotten must still be recognised as late.
        headers.append((SOURCE_TIMESTAMP_HEADER, str(letter.source_timestamp_ms).encode()))
    return Outgoing(dest, letter.source_key, letter.original, headers=headers)


def _commit(kafka, producer, out, topic, ends, kinds, consumer_group) -> None:
    """Re-publish and mark every letter up to the end as handled, per kind, in one transaction."""
    with producer.transaction():
        for o in out:
            producer.produce(o)
        for kind in kinds:
            meta = Consumer(kafka.consumer(f"{consumer_group}.{kind}"))
            try:
                producer.send_offsets(
                    [TopicPartition(topic, p, end) for p, end in ends.items()], meta.consumer_group_metadata()
                )
            finally:
                meta.close()


def _done(kafka: KafkaConfig, consumer_group: str, kind: str, topic: str) -> dict[int, int]:
    return {p: max(0, off) for p, off in committed_offsets(kafka, f"{consumer_group}.{kind}", topic).items()}
