"""Restore benchmark: how long a worker takes to rebuild a partition that has seen --groups prompt groups.

Writes a state partition the way a reassembler does: one `PartitionTask` (the production code) takes
--groups one-rollout groups through intake, close and prepare, and each step's state entries,
tombstones and progress are committed in one transaction by `commit_transaction`, with the delivery
offsets handed back to the task. Then it times what a successor does on assignment: read the
changelog from the restore point (`read_changelog`) and rebuild the partition (`restore_partition`).
With --full it also times reading the whole partition, as restores did before the horizon.
Target (issue 11): under 10 s for a partition that has seen 1M groups.

    .venv/bin/python -m bench.restore [--groups 1000000] [--full]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from schemas.receipt import CallRecord, Receipt
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.consumer import Record, end_offsets, read_topic
from streams.producer import TransactionalProducer
from workers.reassembler.changelog import read_changelog
from workers.reassembler.commit import commit_transaction
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.finalize import GroupOutcome
from workers.reassembler.restore import LogEntry, restore_partition
from workers.reassembler.task import PartitionTask
from workers.topics import STATE_ROLE, TopicNames, decode_value, pipeline_topics

STEP_GROUPS = 2000


class _NoStore:
    """Staging is not cleared in this bench (clear_staging off): the task never calls the store."""

    def clear(self, partition: str, keys: list[str]) -> None:  # pragma: no cover - never called
        raise AssertionError("unexpected staging clear")


def _receipt_value(i: int) -> tuple[bytes, bytes]:
    gid = f"group-{i:08d}"
    call = CallRecord(f"{gid}-r0/c0", "c0", None, 0, 8, 8, 1, "d")
    r = Receipt(gid + "-r0", gid, i, 0, 1, 0.5, True, 1.0, "bench", None, (call,))
    return gid.encode(), r.to_bytes()


def write_history(kafka: KafkaConfig, names: TopicNames, config: ReassemblerConfig, groups: int) -> None:
    """Drive one task through `groups` groups, committing its state entries as the worker does."""
    task = PartitionTask.resume(restore_partition(0, []), _NoStore(), config)
    producer = TransactionalProducer(kafka, f"bench-restore-{names.prefix}")
    t0, offset = time.perf_counter(), 0
    while offset < groups:
        now_ms = 1_700_000_000_000 + offset  # one group per millisecond of event time
        for i in range(offset, min(groups, offset + STEP_GROUPS)):
            key, value = _receipt_value(i)
            task.intake(Record(names.receipts, 0, i, key, value, (), now_ms), now_ms)
        ready = task.ready(task.clock(now_ms, caught_up=True, paused=False), 10**9)
        outcomes = [GroupOutcome(g, None, None, None, ()) for g in ready]
        # Only the state topic matters here: no input offsets (there is no consumer group).
        commit = dataclasses.replace(task.prepare(outcomes, now_ms), commit_offset=None)
        writes = commit_transaction(
            producer, [commit], topics=names, receipts_topic=names.receipts, consumer_group_metadata=None
        )
        task.post_commit(commit, writes.get(0))
        offset += STEP_GROUPS
        if offset % 100_000 == 0 or offset >= groups:
            rate = offset / (time.perf_counter() - t0)
            print(f"  wrote state for {min(offset, groups):,} groups ({rate:,.0f} groups/s)", flush=True)
    producer.flush(30)


def time_restore(kafka: KafkaConfig, names: TopicNames, config: ReassemblerConfig) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    changelog = read_changelog(kafka, names.state, 0)
    restored = restore_partition(0, changelog.entries, closed_capacity=config.max_closed_groups)
    seconds = time.perf_counter() - t0
    return seconds, len(changelog.entries), len(restored.groups.closed)


def time_full_read(kafka: KafkaConfig, names: TopicNames, config: ReassemblerConfig) -> tuple[float, int]:
    t0 = time.perf_counter()
    entries = [
        LogEntry(r.offset, r.key, decode_value(r.value, STATE_ROLE) if r.value is not None else None)
        for r in read_topic(kafka, names.state, partitions=[0])
    ]
    restore_partition(0, entries, closed_capacity=config.max_closed_groups)
    return time.perf_counter() - t0, len(entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1_000_000)
    parser.add_argument("--full", action="store_true", help="also time reading the whole state partition")
    args = parser.parse_args()
    names = TopicNames("bench-restore")
    config = ReassemblerConfig(prefix=names.prefix, worker_id="bench", clear_staging=False)
    with tempfile.TemporaryDirectory() as tmp, LocalBroker(BrokerConfig(data_dir=Path(tmp))) as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
        # No compaction during the run: the restore must be bounded without the log cleaner's help.
        create_topics(kafka, pipeline_topics(names, 1, config={"segment.ms": str(7 * 86_400_000)}))
        print(f"writing the state of {args.groups:,} groups to {names.state} at {broker.bootstrap_servers}")
        write_history(kafka, names, config, args.groups)
        (_, end), *_ = end_offsets(kafka, names.state).values()
        seconds, read, remembered = time_restore(kafka, names, config)
        print(
            f"restore: {seconds:.2f} s, {read:,} of {end:,} state records read, {remembered:,} closed groups "
            f"remembered (target < 10 s: {'met' if seconds < 10 else 'MISSED'})"
        )
        if args.full:
            full_s, full_n = time_full_read(kafka, names, config)
            print(f"whole-partition read: {full_s:.2f} s for {full_n:,} records ({full_s / seconds:.1f}x the restore)")


if __name__ == "__main__":
    main()
