"""After a whole-job restart: put back what TQ lost that the checkpoint kept, and account for every group.

Kafka kept the receipts, the reassemblers' state and the finalized records; TQ (inside Ray) came back
empty. `resume` runs once, after TQ is up and before the reassemblers and the trainer start, with the
trainer checkpoint the job restarts from (`checkpoint_dir.py`). It reads the topics and sorts every
prompt group into one of:

- **resolved**: its finalized record is before the checkpoint's cut or named resolved past it (trained,
  evicted as stale, or handed back already);
- **restored**: finalized, not trained, every train row in the spill: put back into TQ, trained after the restart;
- **to hand back (train rows lost)**: finalized, not trained, rows not all in the spill: the trainer hands
  it back when it reads the record (`lost_rows.py`);
- **open, restored / partly restored / to hand back**: receipts past the reassemblers' committed
  offsets and no closing state: the staged rows the spill has are put back; a reassembler completes
  the group from them, with masked placeholders for rows lost, or hands it back if none survived;
- **closed without a record**: dead-lettered or handed back already (their records say so).

A group the state topic says was finalized but whose record is missing from the finalized topic is
**unaccounted for**: the report names it and `rlstream resume` exits non-zero. Restoring only what a
record past the cut still needs means nothing trained before the checkpoint comes back: no group is
trained twice. The cost is one read of the receipts, state and finalized topics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import TopicPartition

from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from schemas.receipt import Receipt
from schemas.state import CLOSED, FINALIZED, GroupState, decode_state_entry
from streams.config import KafkaConfig
from streams.consumer import partitions_of, read_topic
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from streams.tq import STAGING, KVStore
from workers.reassembler.config import DEFAULT_CONSUMER_GROUP
from workers.trainer.checkpoint import PartitionMark, decode_state
from workers.trainer.checkpoint_dir import load_from_checkpoint
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.errors import CommitUnreadable
from workers.trainer.progress import ProgressCarrier
from workers.trainer.spill import Spill


@dataclass
class ResumeReport:
    """What `resume` found and did, group by group (ids kept for the unaccounted only)."""

    trained: int = 0
    restored: int = 0
    restored_rows: int = 0
    hand_back_finalized: int = 0
    open_restored: int = 0
    open_partial: int = 0
    open_hand_back: int = 0
    staging_rows: int = 0
    closed_without_record: int = 0
    unaccounted: list[str] = field(default_factory=list)
    checkpoint: str = "none"
    # (group id, partition, offset) of originals resolved before the cut that have a duplicate past it:
    # for `ExperienceConsumer.remember_resolved` of the restored trainer.
    resolved_originals: list[tuple[str, int, int]] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"checkpoint: {self.checkpoint}",
            f"finalized groups resolved before the checkpoint (trained, evicted or handed back): {self.trained}",
            f"finalized groups restored ({self.restored_rows} train rows back in TQ): {self.restored}",
            f"finalized groups whose train rows are lost, to be handed back (or dead-lettered) by the trainer:"
            f" {self.hand_back_finalized}",
            f"duplicates past the checkpoint of groups resolved before it: {len(self.resolved_originals)}"
            + (" (give them to the trainer: ExperienceConsumer.remember_resolved)" if self.resolved_originals else ""),
            f"open groups restored whole: {self.open_restored}, partly (completed with placeholders):"
            f" {self.open_partial}, lost (to be handed back by a reassembler): {self.open_hand_back}"
            f" ({self.staging_rows} staged rows back in TQ)",
            f"groups closed without a finalized record (dead-lettered or handed back): {self.closed_without_record}",
            f"unaccounted for: {len(self.unaccounted)}"
            + (f" (e.g. {', '.join(self.unaccounted[:5])})" if self.unaccounted else ""),
        ]


@dataclass(frozen=True)
class _Kafka:
    """Where resume's Kafka clients come from and what its reads wait on (the real ones by default)."""

    kafka: KafkaConfig
    api: KafkaApi
    runtime: Runtime

    def read(self, topic: str, **kw):
        return read_topic(self.kafka, topic, api=self.api, runtime=self.runtime, **kw)

    def consumer(self, group: str):
        return self.api.Consumer(self.kafka.consumer(group))


def _trained_marks(k: _Kafka, config: ConsumerConfig, state: dict | None) -> dict[int, PartitionMark]:
    """Per finalized partition, the first record not trained and the trained ranges past it."""
    topic = config.finalized_topic
    if state is not None:
        return dict(decode_state(state, topic=topic, consumer_group=config.consumer_group).partitions)
    # No checkpoint: the trainer's commits (and the resolved ranges they name) are its place, read by the
    # trainer's own clients (`clients.py`): a consumer of its group that never joins it, and the progress topic.
    clients = KafkaTrainerClients(k.kafka, api=k.api, runtime=k.runtime)
    c = clients.consumer(config.consumer_group, {})
    try:
        parts = [TopicPartition(topic, p) for p in partitions_of(c, topic)]
        committed = [tp for tp in c.committed(parts, timeout=30) if tp.offset >= 0]
    finally:
        c.close()
    carrier = ProgressCarrier(
        clients,
        config.topics.trainer_progress,
        config.consumer_group,
        topic,
        "resume",
        k.runtime.monotonic,
        k.runtime.wall_ms,
    )
    named = carrier.read(committed)
    if named.unreadable:
        part, reason = next(iter(sorted(named.unreadable.items())))
        raise CommitUnreadable(f"{topic}[{part}]: the trainer's commit cannot be read whole: {reason}")
    return {tp.partition: PartitionMark(tp.offset, named.ranges[tp.partition]) for tp in committed}


def _is_trained(marks: dict[int, PartitionMark], partition: int, offset: int) -> bool:
    mark = marks.get(partition)
    if mark is None:
        return False
    return offset < mark.offset or any(first <= offset <= last for first, last in mark.trained)


def _latest_states(k: _Kafka, topic: str) -> dict[str, GroupState]:
    latest: dict[str, GroupState] = {}
    for r in k.read(topic):
        if r.value is None:
            latest.pop(r.key.decode(errors="replace"), None)  # a tombstone: forgotten behind the horizon
            continue
        try:
            entry = decode_state_entry(r.value)
        except SchemaError:
            continue
        if isinstance(entry, GroupState):
            latest[entry.group_id] = entry
    return latest


def _open_receipts(k: _Kafka, topic: str, consumer_group: str) -> dict[str, list[Receipt]]:
    """Receipts from the reassemblers' committed offsets on, by group (offsets never pass an open group)."""
    c = k.consumer(consumer_group)
    try:
        parts = [TopicPartition(topic, p) for p in partitions_of(c, topic)]
        start = {tp.partition: tp.offset for tp in c.committed(parts, timeout=30) if tp.offset >= 0}
    finally:
        c.close()
    groups: dict[str, list[Receipt]] = {}
    for r in k.read(topic, start=start):
        try:
            receipt = Receipt.from_bytes(r.value)
        except SchemaError:
            continue  # a reassembler dead-letters it again
        groups.setdefault(receipt.group_id, []).append(receipt)
    return groups


def _finalized(k: _Kafka, topic: str) -> Iterable[tuple[int, int, FinalizedGroup]]:
    for r in k.read(topic):
        try:
            yield r.partition, r.offset, FinalizedGroup.from_bytes(r.value)
        except SchemaError:
            continue  # the trainer dead-letters it as undecodable


def resume(
    kafka: KafkaConfig,
    store: KVStore,
    config: ConsumerConfig,
    checkpoint: str | Path | None,
    *,
    reassembler_consumer_group: str = DEFAULT_CONSUMER_GROUP,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> ResumeReport:
    """Put back the rows the checkpoint's spill kept that groups past it still need; account for every group.

    Run before the reassemblers and the trainer start; `checkpoint` None means no checkpoint (every
    row still needed is lost). Raises SpillError for a checkpoint whose state or spill is unusable.
    Its Kafka clients come from `api` and its reads wait on `runtime` (the real ones by default; the
    explorer's models and clock).
    """
    k = _Kafka(kafka, api, runtime)
    state, spill = load_from_checkpoint(checkpoint) if checkpoint is not None else (None, None)
    report = ResumeReport(checkpoint=str(checkpoint) if checkpoint is not None else "none")
    names = config.topics
    marks = _trained_marks(k, config, state)
    kept = spill.keys(config.train_partition) if spill is not None else set()
    first: dict[str, tuple[int, int, bool]] = {}  # group id -> its first record, resolved before the cut
    for part, offset, group in _finalized(k, config.finalized_topic):
        gid = group.group_id
        resolved = _is_trained(marks, part, offset)
        if gid in first:
            # A duplicate. Past the cut, of an original before it, the restored trainer never reads that
            # original again: told of it (`remember_resolved`), it resolves the duplicate with it instead
            # of taking it for a group whose rows are lost, and handing it back to be trained again.
            o_part, o_offset, o_resolved = first[gid]
            if o_resolved and not resolved:
                report.resolved_originals.append((gid, o_part, o_offset))
            continue
        first[gid] = (part, offset, resolved)
        if resolved:
            report.trained += 1
        elif spill is not None and kept.issuperset(group.sample_ids):
            report.restored_rows += spill.restore(store, config.train_partition, group.sample_ids)
            report.restored += 1
        else:
            report.hand_back_finalized += 1
    states = _latest_states(k, names.state)
    for gid, entry in states.items():
        if entry.status != CLOSED:
            continue
        if entry.outcome == FINALIZED:
            if gid not in first:
                report.unaccounted.append(gid)
        else:
            report.closed_without_record += 1
    _restore_open(k, store, names.receipts, reassembler_consumer_group, states, spill, report)
    return report


def _restore_open(k: _Kafka, store, receipts_topic, consumer_group, states, spill: Spill | None, report) -> None:
    held = spill.keys(STAGING) if spill is not None else set()
    for gid, receipts in _open_receipts(k, receipts_topic, consumer_group).items():
        entry = states.get(gid)
        if entry is not None and entry.status == CLOSED:
            continue
        keys = [c.staging_key for r in receipts for c in r.manifest]
        have = [k for k in keys if k in held]
        if have:
            report.staging_rows += spill.restore(store, STAGING, have)
        if keys and len(have) == len(keys):
            report.open_restored += 1
        elif have:
            report.open_partial += 1
        elif keys:
            report.open_hand_back += 1
