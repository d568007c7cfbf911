"""After a whole-job restart: put back what TQ lost that the checkpoint kept, and account for every group.

Kafka kept the receipts, the reassemblers' state and the finalized records; TQ (inside Ray) came back
empty. `resume` runs once, after TQ is up and before the reassemblers, the trainer and the rollout
workers start, with the trainer checkpoint the job restarts from (`checkpoint_dir.py`). First no
transaction of the dead job may stay open on the topics it reads (`open_transactions.py`: aborted
under the dead workers' ids when they are known, else waited out). Then it reads each topic from
where it is still needed (`resume_reads.py`) and sorts every prompt group into one of:

- **resolved**: its finalized record is before the checkpoint's cut (not read) or named resolved past it
  (trained, evicted as stale, or handed back already); a duplicate past the cut of a group the
  checkpoint remembers resolved (`resolved.py`) is resolved with it by the restored trainer;
- **restored**: finalized, not trained, every train row in the spill: put back into TQ, trained after the restart;
- **to hand back (train rows lost)**: finalized, not trained, rows not all in the spill: the trainer hands
  it back when it reads the record (`lost_rows.py`);
- **open, restored / partly restored / to hand back**: receipts past the reassemblers' committed
  offsets and no closing state: the staged rows the spill has are put back; a reassembler completes
  the group from them, with masked placeholders for rows lost, or hands it back if none survived;
- **closed without a record**: dead-lettered or handed back already (their records say so);
- **expired**: records a topic's retention deleted before they were read (counted apart: lost).

A group the state topic says was finalized after the cut whose record is missing is **unaccounted
for**: the report names it and `rlstream resume` exits non-zero. Hand-backs the rollout workers
generated already are settled on their feed (`workers/rollout/regenerate_settle.py`). Restoring
only what a record past the cut still needs means nothing trained before the checkpoint comes
back. The cost follows what is still needed: the finalized topic from the cut, the state topic from
its restore points, the receipts from the reassemblers' offsets, the spill's index and the rows put
back (`bench/resume.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import TopicPartition

from schemas.state import CLOSED, FINALIZED
from streams.config import KafkaConfig
from streams.consumer import partitions_of
from streams.partitioner import partition_of
from streams.tq import STAGING, KVStore
from workers.reassembler.config import DEFAULT_CONSUMER_GROUP
from workers.rollout.regenerate_settle import FeedSettled, pending_hand_backs, settle_feed
from workers.trainer.checkpoint import PartitionMark, decode_state, resolved_at_cut
from workers.trainer.checkpoint_dir import load_from_checkpoint, spill_binding
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.errors import CommitUnreadable
from workers.trainer.open_transactions import DEFAULT_WAIT_S, abort_transactions, stable_committed, wait_for_stable
from workers.trainer.progress import ProgressCarrier
from workers.trainer.resolved import has_resolved, read_resolved, write_resolved
from workers.trainer.resume_reads import Expired, latest_states, open_receipts, read_finalized, retention_warnings
from workers.trainer.spill_read import Spill

log = logging.getLogger("rlstream.trainer")


@dataclass
class ResumeReport:
    """What `resume` found and did, group by group (ids kept for the unaccounted only)."""

    trained: int = 0
    restored: int = 0
    restored_rows: int = 0
    hand_back_finalized: int = 0
    duplicates: int = 0
    open_restored: int = 0
    open_partial: int = 0
    open_hand_back: int = 0
    staging_rows: int = 0
    closed_without_record: int = 0
    unaccounted: list[str] = field(default_factory=list)
    checkpoint: str = "none"
    read_whole: bool = False  # the finalized topic read from its start (a checkpoint without resolved groups)
    finalized_read: int = 0
    state_read: int = 0
    expired: Expired = field(default_factory=Expired)
    waited_s: float = 0.0
    feed: FeedSettled | None = None
    # (group id, partition, offset) of originals resolved before the cut that have a duplicate past it,
    # found by reading from the start; written into the checkpoint for the restored trainer.
    resolved_originals: list[tuple[str, int, int]] = field(default_factory=list)
    # Every group id resume saw: finalized past the cut, remembered by the reassemblers, open, handed back.
    known_groups: set[str] = field(default_factory=set)
    took: dict[str, float] = field(default_factory=dict)  # seconds per part, after the wait for transactions

    def lines(self) -> list[str]:
        whence = "its start (the checkpoint has no resolved groups)" if self.read_whole else "the checkpoint's cut"
        out = [
            f"checkpoint: {self.checkpoint}",
            f"finalized records read from {whence}: {self.finalized_read}; state records from the restore points:"
            f" {self.state_read}",
            (
                f"finalized groups resolved before the checkpoint (trained, evicted or handed back): {self.trained}"
                if self.read_whole
                else f"finalized groups past the cut resolved already (trained, evicted or handed back): {self.trained}"
                " (those before the cut are not read)"
            ),
            f"finalized groups restored ({self.restored_rows} train rows back in TQ): {self.restored}",
            f"finalized groups whose train rows are lost, to be handed back (or dead-lettered) by the trainer:"
            f" {self.hand_back_finalized}",
            f"duplicates past the checkpoint of groups resolved before it (resolved by the trainer): {self.duplicates}",
            f"open groups restored whole: {self.open_restored}, partly (completed with placeholders):"
            f" {self.open_partial}, lost (to be handed back by a reassembler): {self.open_hand_back}"
            f" ({self.staging_rows} staged rows back in TQ)",
            f"groups closed without a finalized record (dead-lettered or handed back): {self.closed_without_record}",
        ]
        if self.expired.ranges:
            out.append(f"records expired before they were read (lost to the topics' retention): {self.expired.where()}")
        if self.feed is not None:
            out.append(
                f"hand-backs owed to the rollout workers: {self.feed.owed} ({self.feed.generated} generated already,"
                f" settled; {self.feed.requeued} put again)"
            )
        if self.took:
            out.append("took: " + ", ".join(f"{what} {s:.1f} s" for what, s in self.took.items()))
        out.append(
            f"unaccounted for: {len(self.unaccounted)}"
            + (f" (e.g. {', '.join(self.unaccounted[:5])})" if self.unaccounted else "")
        )
        return out


def _trained_marks(kafka, config: ConsumerConfig, state: dict | None, wait_s: float, say) -> dict[int, PartitionMark]:
    """Per finalized partition, the first record not trained and the trained ranges past it."""
    topic = config.finalized_topic
    if state is not None:
        return dict(decode_state(state, topic=topic, consumer_group=config.consumer_group).partitions)
    # No checkpoint: the trainer's commits (and the resolved ranges they name) are its place, once stable.
    stable = stable_committed(kafka, config.consumer_group, topic, wait_s=wait_s, log=say)
    committed = [TopicPartition(topic, p, o, metadata=meta) for p, (o, meta) in sorted(stable.items())]
    carrier = ProgressCarrier(
        KafkaTrainerClients(kafka), config.topics.trainer_progress, config.consumer_group, topic, "resume"
    )
    named = carrier.read(committed)
    if named.unreadable:
        part, reason = next(iter(sorted(named.unreadable.items())))
        raise CommitUnreadable(f"{topic}[{part}]: the trainer's commit cannot be read whole: {reason}")
    return {tp.partition: PartitionMark(tp.offset, named.ranges[tp.partition]) for tp in committed}


def _is_trained(marks: dict[int, PartitionMark], partition: int, offset: int) -> bool:
    mark = marks.get(partition)
    return mark is not None and mark.resolves(offset)


def _remembered(groups, marks: dict[int, PartitionMark], wanted) -> set[str]:
    """The ids in `wanted` of the checkpoint's resolved groups the cut counts resolved (a file written before
    that filter named groups whose hand-back was still unacknowledged; their records are still to resolve)."""
    return {g for g, _, _ in resolved_at_cut(groups, marks) if g in wanted}


def resume(
    kafka: KafkaConfig,
    store: KVStore,
    config: ConsumerConfig,
    checkpoint: str | Path | None,
    *,
    reassembler_consumer_group: str = DEFAULT_CONSUMER_GROUP,
    rollout_consumer_group: str | None = None,
    reassembler_worker_ids: Sequence[str] = (),
    transaction_wait_s: float = DEFAULT_WAIT_S,
    say: Callable[[str], None] | None = None,
) -> ResumeReport:
    """Put back the rows the checkpoint's spill kept that groups past it still need; account for every group.

    Run before the reassemblers, the trainer and the rollout workers start; `checkpoint` None means no
    checkpoint (every row still needed is lost). `reassembler_worker_ids`: the dead job's reassemblers,
    whose open transactions are aborted at once (others are waited out, `transaction_wait_s` at most).
    `rollout_consumer_group`: the rollout workers' `RegenerateFeed` group, settled past hand-backs
    generated already. Raises SpillError for a checkpoint whose state or spill is unusable,
    OpenTransaction for a transaction that outlived the wait. `say` gets progress lines.
    """
    say = say or log.info
    state, spill = load_from_checkpoint(checkpoint, resolved=False) if checkpoint is not None else (None, None)
    try:
        return _resume(
            kafka, store, config, checkpoint, state, spill, reassembler_consumer_group, rollout_consumer_group,
            reassembler_worker_ids, transaction_wait_s, say,
        )  # fmt: skip
    finally:
        if spill is not None:
            spill.close()


def _resume(
    kafka, store, config, checkpoint, state, spill: Spill | None, reassemblers, rollouts, worker_ids, wait_s, say
) -> ResumeReport:
    report = ResumeReport(checkpoint=str(checkpoint) if checkpoint is not None else "none")
    names = config.topics
    abort_transactions(kafka, [f"{reassemblers}.{w}" for w in worker_ids], say)
    report.waited_s = wait_for_stable(
        kafka, [names.finalized, names.state, names.receipts, names.regenerate], wait_s=wait_s, log=say
    )
    retention_warnings(kafka, [names.receipts, names.finalized, names.regenerate], say)
    marks = _trained_marks(kafka, config, state, wait_s, say)
    # A checkpoint written before its resolved groups were kept: read from the start to find them.
    report.read_whole = state is not None and not has_resolved(checkpoint)
    start = {} if report.read_whole else {p: m.offset for p, m in marks.items()}
    took = _Took(report)
    finalized = read_finalized(
        kafka, config.finalized_topic, start, report.expired, lambda p, o: _is_trained(marks, p, o)
    )
    took("finalized")
    report.finalized_read = finalized.records
    states, report.state_read = latest_states(kafka, names.state, _partitions(kafka, names.state))
    took("state")
    receipts_from = {
        p: o for p, (o, _) in stable_committed(kafka, reassemblers, names.receipts, wait_s=wait_s, log=say).items()
    }
    receipts = open_receipts(kafka, names.receipts, receipts_from, report.expired)
    took("receipts")
    feed_from, pending = {}, {}
    if rollouts is not None:
        feed_from = {
            p: o for p, (o, _) in stable_committed(kafka, rollouts, names.regenerate, wait_s=wait_s, log=say).items()
        }
        pending = pending_hand_backs(kafka, names, feed_from)
        took("hand-backs")

    # Which of the groups seen the checkpoint remembers resolved: one pass over its resolved groups.
    seen = finalized.first
    owed = {b.new_group_id for backs in pending.values() for _, _, b in backs}
    remembered: set[str] = set()
    if state is not None and not report.read_whole:
        remembered = _remembered(read_resolved(checkpoint, spill_binding(state)), marks, seen.keys() | owed)
        took("resolved groups")

    first = finalized.first
    _sort_finalized(report, finalized, remembered, store, spill, config.train_partition)
    _account_states(report, states, first, remembered, finalized, _partitions(kafka, config.finalized_topic))
    _restore_open(report, store, receipts, states, spill)
    took("restore")
    report.known_groups = (
        set(first) | set(states) | set(receipts) | {b.group_id for v in pending.values() for _, _, b in v} | owed
    )
    if rollouts is not None:
        ends = {p: v[-1][0] + 1 for p, v in pending.items()}
        generated = set(states) | set(receipts) | set(first) | remembered
        report.feed = settle_feed(
            kafka, names, rollouts, feed_from, pending, generated.__contains__, ends, wait_s=wait_s, log=say
        )
        took("feed")
    if report.read_whole:
        # For the restored trainer's load path (`checkpoint_dir.load_state`): every group the cut resolved,
        # as a checkpoint of today keeps them, not only those whose duplicate resume saw (one published
        # after resume ran would be handed back), the newest `max_seen_groups` as the trainer remembers.
        kept = _resolved_before(finalized, report.resolved_originals, config.max_seen_groups)
        write_resolved(checkpoint, spill_binding(state), kept)
        say(f"resume: {len(kept)} resolved group(s) written into {checkpoint} for the restored trainer")
    return report


def _resolved_before(read, originals: list[tuple[str, int, int]], most: int) -> list[tuple[str, int, int]]:
    """The groups the cut resolved, as read from the start, oldest first; the originals of duplicates always."""
    named = {g for g, _, _ in originals}
    resolved = [(g, p, o) for g, (p, o, done) in read.first.items() if done and g not in named]
    return resolved[max(0, len(resolved) - max(0, most - len(originals))) :] + list(originals)


def _partitions(kafka: KafkaConfig, topic: str) -> list[int]:
    from confluent_kafka import Consumer

    c = Consumer(kafka.consumer("rlstream-resume-metadata"))
    try:
        return partitions_of(c, topic)
    finally:
        c.close()


def _sort_finalized(report, read, remembered: set[str], store, spill: Spill | None, train: str) -> None:
    """Sort the finalized records read that the cut did not resolve; put back the train rows of those restored."""
    report.trained = read.resolved
    report.resolved_originals = list(read.originals)
    report.duplicates = len(read.originals)
    kept = spill.keys(train) if spill is not None else set()
    restore: list[str] = []
    for gid, _, _, sample_ids in read.untrained:
        if gid in remembered:
            report.duplicates += 1  # of a group resolved before the cut: the checkpoint remembers it
        elif spill is not None and kept.issuperset(sample_ids):
            restore.extend(sample_ids)
            report.restored += 1
        else:
            report.hand_back_finalized += 1
    if restore:
        report.restored_rows += spill.restore(store, train, restore)


class _Took:
    """Seconds each part of a resume took, for its report."""

    def __init__(self, report: ResumeReport):
        self._report, self._t = report, time.monotonic()

    def __call__(self, what: str) -> None:
        now = time.monotonic()
        self._report.took[what] = now - self._t
        self._t = now


def _account_states(report, states, first, remembered, finalized, parts: list[int]) -> None:
    """Closed groups: dead-lettered or handed back, or finalized with their record read, or before the cut.

    A group's closing state entry and its finalized record are committed in one transaction, and the
    finalized topic was read from where each partition was read from (the cut, or its log start) to
    an end no transaction held back: a record not read lies before that, resolved by the cut or
    expired (`Expired`, counted apart). Only in a partition read from offset 0 is a finalized group
    whose record was not read unaccounted for (a topic deleted and made again, records removed by
    hand). No wall clock is compared: one worker's `finalized_at_ms` against another's record
    timestamps made a skewed clock or a delayed batch a group unaccounted for, and resume refuse.
    """
    for gid, entry in states.items():
        if entry.status != CLOSED:
            continue
        if entry.outcome != FINALIZED:
            report.closed_without_record += 1
            continue
        if gid in first or gid in remembered:
            continue
        part = partition_of(gid.encode(), len(parts))
        if finalized.begin.get(part, 0) == 0:
            report.unaccounted.append(gid)


def _restore_open(report, store, receipts, states, spill: Spill | None) -> None:
    held = spill.keys(STAGING) if spill is not None else set()
    restore: list[str] = []
    for gid, rs in receipts.items():
        entry = states.get(gid)
        if entry is not None and entry.status == CLOSED:
            continue
        keys = [c.staging_key for r in rs for c in r.manifest]
        have = [k for k in keys if k in held]
        restore.extend(have)
        if keys and len(have) == len(keys):
            report.open_restored += 1
        elif have:
            report.open_partial += 1
        elif keys:
            report.open_hand_back += 1
    if restore:
        report.staging_rows += spill.restore(store, STAGING, restore)


__all__ = ["ResumeReport", "resume"]
