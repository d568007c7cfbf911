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

Every Kafka client resume makes (its reads, the admin calls, the producers that abort or commit) comes
from the `KafkaApi` it is given, and every wait and clock it reads is the `Runtime`'s (the real ones by
default): the explorer (tests/tools/explore) runs it on its models of Kafka and TQ under a virtual clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from confluent_kafka import TopicPartition

from schemas.state import CLOSED, FINALIZED
from streams.config import KafkaConfig
from streams.consumer import end_offsets, partitions_of
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.partitioner import partition_of
from streams.runtime import REAL_RUNTIME, Runtime
from streams.tq import STAGING, KVStore
from workers.deadline import Deadline
from workers.reassembler.config import DEFAULT_CONSUMER_GROUP
from workers.rollout.regenerate_settle import check_feed_group, pending_hand_backs, settle_feed
from workers.trainer.checkpoint import PartitionMark, decode_state, resolved_at_cut
from workers.trainer.checkpoint_dir import load_from_checkpoint, spill_binding
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.errors import CommitUnreadable
from workers.trainer.old_job import make_quiet
from workers.trainer.open_transactions import DEFAULT_WAIT_S, stable_committed
from workers.trainer.progress import ProgressCarrier
from workers.trainer.resolved import has_resolved, read_resolved, write_resolved
from workers.trainer.resume_reads import StateRead, latest_states, open_receipts, read_finalized, retention_warnings
from workers.trainer.resume_report import ResumeReport
from workers.trainer.spill_read import Spill

log = logging.getLogger("rlstream.trainer")


def _trained_marks(
    clients: KafkaTrainerClients, config: ConsumerConfig, state, deadline, report, say
) -> dict[int, PartitionMark]:
    """Per finalized partition, the first record not trained and the trained ranges past it."""
    topic = config.finalized_topic
    if state is not None:
        return dict(decode_state(state, topic=topic, consumer_group=config.consumer_group).partitions)
    # No checkpoint: the trainer's commits (and the resolved ranges they name) are its place once stable, read
    # by the trainer's own clients (`clients.py`): a consumer of its group that never joins it, and the
    # progress topic.
    kafka, rt = clients.kafka, clients.runtime
    stable = stable_committed(
        kafka, config.consumer_group, topic, deadline=deadline, log=say,
        consumer=lambda: clients.consumer(config.consumer_group, {}), runtime=rt,
    )  # fmt: skip
    ends = end_offsets(kafka, topic, api=clients.api)
    held = sorted(p for p, (low, high) in ends.items() if high > low and p not in stable)
    if held:
        # Not refused: a trainer that never committed (a checkpointing one commits only once a checkpoint
        # is durable) looks the same; the broker's offsets.retention.minutes must outlast an outage.
        report.missing_commits.append(
            f"the trainer's group {config.consumer_group!r} has no committed offset on {topic} partition(s)"
            f" {held}: read from their start (if its offsets expired, offsets.retention.minutes, every group"
            " there is taken for untrained)"
        )
    committed = [TopicPartition(topic, p, o, metadata=meta) for p, (o, meta) in sorted(stable.items())]
    carrier = ProgressCarrier(
        clients, config.topics.trainer_progress, config.consumer_group, topic, "resume", rt.monotonic, rt.wall_ms
    )
    named = carrier.read(committed)
    if named.unreadable:
        part, reason = next(iter(sorted(named.unreadable.items())))
        raise CommitUnreadable(f"{topic}[{part}]: the trainer's commit cannot be read whole: {reason}")
    return {tp.partition: PartitionMark(tp.offset, named.ranges[tp.partition]) for tp in committed}


def _receipts_from(clients, group: str, topic: str, states: StateRead, deadline, report, say) -> dict[int, int]:
    """Where the receipts still needed begin: the reassemblers' commits, or where their state says they were.

    A partition without a commit whose state has a progress entry had its commit expire (the broker's
    `offsets.retention.minutes` ran out during an outage): it is read from the first receipt of a group
    the state has open there, or past what it emitted, never from the start into memory.
    """
    stable = stable_committed(
        clients.kafka, group, topic, deadline=deadline, log=say, api=clients.api, runtime=clients.runtime
    )
    committed = {p: o for p, (o, _) in stable.items()}
    for part in states.progress:
        if part not in committed and (start := states.receipts_start(part)) is not None:
            committed[part] = start
            report.missing_commits.append(
                f"the reassemblers' group {group!r} has no committed offset on {topic}[{part}] (expired:"
                f" offsets.retention.minutes?): read from {start}, where their state's progress says it stood"
            )
    return committed


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
    force: bool = False,
    feed_from_start: bool = False,
    say: Callable[[str], None] | None = None,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> ResumeReport:
    """Put back the rows the checkpoint's spill kept that groups past it still need; account for every group.

    Run before the reassemblers, the trainer and the rollout workers start; `checkpoint` None means no
    checkpoint (every row still needed is lost). First the dead job must be gone (`old_job.py`): its
    consumer groups empty, the open transactions of its reassemblers aborted (those named in
    `reassembler_worker_ids` or still listed in their group) or waited out; every wait of resume shares
    one deadline, `transaction_wait_s`. `rollout_consumer_group`: the rollout workers' `RegenerateFeed`
    group, settled past hand-backs generated already; one with no commit on a topic holding hand-backs
    is refused (a wrong or fresh name would hand every hand-back out again) unless `feed_from_start`
    (the caller knows it is the job's own, which never committed). `force`: do not wait for members,
    and `feed_from_start`. Raises SpillError for a checkpoint whose state or spill is unusable,
    OldJobAlive for a group whose members stay, OpenTransaction for a transaction that outlived the
    wait, FeedBusy for a feed that cannot be settled. `say` gets progress lines. `api` makes its Kafka
    clients and `runtime` is its clock and sleeps (a simulator's; the real ones by default).
    """
    say = say or log.info
    deadline = Deadline(transaction_wait_s, clock=runtime.monotonic)
    clients = KafkaTrainerClients(kafka, api=api, runtime=runtime)
    state, spill = load_from_checkpoint(checkpoint, resolved=False) if checkpoint is not None else (None, None)
    try:
        return _resume(
            clients, store, config, checkpoint, state, spill, reassembler_consumer_group, rollout_consumer_group,
            reassembler_worker_ids, deadline, force, force or feed_from_start, say,
        )  # fmt: skip
    finally:
        if spill is not None:
            spill.close()


def _resume(
    clients: KafkaTrainerClients, store, config, checkpoint, state, spill: Spill | None, reassemblers, rollouts,
    worker_ids, deadline, force, from_start, say,
) -> ResumeReport:  # fmt: skip
    kafka, seams = clients.kafka, {"api": clients.api, "runtime": clients.runtime}
    report = ResumeReport(checkpoint=str(checkpoint) if checkpoint is not None else "none")
    names = config.topics
    groups = [reassemblers, config.consumer_group, *([rollouts] if rollouts is not None else [])]
    topics = [names.finalized, names.state, names.receipts, names.regenerate]
    quiet = make_quiet(kafka, topics, groups, reassemblers, worker_ids, deadline, say, force=force, **seams)
    report.open_at_start, report.aborted, report.waited_s = quiet.open_at_start, quiet.aborted, quiet.waited_s
    retention_warnings(kafka, [names.receipts, names.finalized, names.regenerate], say, api=clients.api)
    marks = _trained_marks(clients, config, state, deadline, report, say)
    # A checkpoint written before its resolved groups were kept: read from the start to find them.
    report.read_whole = state is not None and not has_resolved(checkpoint)
    start = {} if report.read_whole else {p: m.offset for p, m in marks.items()}
    took = _Took(report, clients.runtime)
    finalized = read_finalized(
        kafka, config.finalized_topic, start, report.expired, lambda p, o: _is_trained(marks, p, o), **seams
    )
    took("finalized")
    report.finalized_read = finalized.records
    states_read = latest_states(kafka, names.state, _partitions(clients, names.state), **seams)
    states, report.state_read = states_read.groups, states_read.records
    took("state")
    receipts_from = _receipts_from(clients, reassemblers, names.receipts, states_read, deadline, report, say)
    receipts = open_receipts(kafka, names.receipts, receipts_from, report.expired, **seams)
    report.receipts_read = sum(len(rs) for rs in receipts.values())
    took("receipts")
    feed_from, pending = {}, {}
    if rollouts is not None:
        stable = stable_committed(kafka, rollouts, names.regenerate, deadline=deadline, log=say, **seams)
        feed_from = {p: o for p, (o, _) in stable.items()}
        if not from_start:
            check_feed_group(kafka, names, rollouts, feed_from, **seams)
        pending = pending_hand_backs(kafka, names, feed_from, **seams)
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
    _account_states(report, states, first, remembered, finalized, _partitions(clients, config.finalized_topic))
    _restore_open(report, store, receipts, states, spill)
    took("restore")
    report.known_groups = (
        set(first) | set(states) | set(receipts) | {b.group_id for v in pending.values() for _, _, b in v} | owed
    )
    if rollouts is not None:
        ends = {p: v[-1][0] + 1 for p, v in pending.items()}
        generated = set(states) | set(receipts) | set(first) | remembered
        report.feed = settle_feed(
            kafka, names, rollouts, feed_from, pending, generated.__contains__, ends, deadline=deadline, log=say,
            force=force, **seams,
        )  # fmt: skip
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


def _partitions(clients: KafkaTrainerClients, topic: str) -> list[int]:
    c = clients.consumer("rlstream-resume-metadata", {})
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

    def __init__(self, report: ResumeReport, runtime: Runtime):
        self._report, self._runtime = report, runtime
        self._t = runtime.monotonic()

    def __call__(self, what: str) -> None:
        now = self._runtime.monotonic()
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
