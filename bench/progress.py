"""The trainer's progress topic: what one entry write costs, and a read of the topic at realistic sizes.

A trainer writes a progress entry only when a commit's resolved ranges do not fit its metadata (about 870
alternating ranges), acknowledged by every in-sync replica before the commit; it reads the topic whole
on assignment when a commit it reads names an entry, and once before its first entry for a partition
(`workers/trainer/progress.py`). Entries here carry 10,000 alternating ranges each (what
`max_waiting_groups` at 10,000 can reach). The read is timed at the steady state of compaction (each
partition's committed entry and four attempts live) and with an uncompacted head as the topic's
settings leave it (`segment.ms` one minute, tombstones kept ten minutes): the entries and tombstones of
`--head-minutes` of commits, one carried commit per `--commit-s` per partition. The broker is one
local KRaft broker: compare the figures with each other, not with a cluster's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from confluent_kafka import TopicPartition

from schemas.trainer_progress import progress_chunks
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.position import carried_metadata
from workers.trainer.progress import ProgressCarrier, entry_key

GROUP, RANGES = "trainer", 10_000


def _entry(names: TopicNames, partition: int, token: str, offset: int = 0) -> list[Outgoing]:
    ranges = [(offset + 2 * i + 1, offset + 2 * i + 1) for i in range(RANGES)]
    chunks = progress_chunks(GROUP, names.finalized, partition, offset, token, ranges, int(time.time() * 1000))
    return [
        Outgoing(names.trainer_progress, entry_key(GROUP, names.finalized, partition, token, c.chunk), c.to_bytes())
        for c in chunks
    ]


def _grave(names: TopicNames, partition: int, token: str) -> Outgoing:
    return Outgoing(names.trainer_progress, entry_key(GROUP, names.finalized, partition, token, 0), None)


def _time_read(kafka: KafkaConfig, names: TopicNames, standing: dict[int, str]) -> float:
    carrier = ProgressCarrier(KafkaTrainerClients(kafka), names.trainer_progress, GROUP, names.finalized, "bench")
    commits = [TopicPartition(names.finalized, p, 0, metadata=carried_metadata(standing[p], 1)) for p in standing]
    t0 = time.perf_counter()
    got = carrier.read(commits)
    seconds = time.perf_counter() - t0
    assert not got.unreadable and all(len(r) == RANGES for r in got.ranges.values()), got.unreadable
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--head-minutes", type=float, default=2.0, help="uncompacted commits ahead of the cleaner")
    parser.add_argument("--commit-s", type=float, default=10.0, help="seconds between a partition's carried commits")
    parser.add_argument("--writes", type=int, default=50, help="entry writes timed one by one")
    args = parser.parse_args()
    names = TopicNames("bench-progress")
    with tempfile.TemporaryDirectory() as tmp, LocalBroker(BrokerConfig(data_dir=Path(tmp))) as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
        create_topics(kafka, pipeline_topics(names, args.partitions))
        producer = AckedProducer(kafka)
        size = sum(len(r.value) for r in _entry(names, 0, "size"))
        producer.send(_entry(names, 0, "first"))  # the producer's id is acquired on its first send
        seconds = _time_read(kafka, names, {0: "first"})
        print(f"read of one entry (what any read of the topic costs, whatever its size): {seconds:.2f} s")
        times = []
        for i in range(args.writes):
            t0 = time.perf_counter()
            producer.send(_entry(names, i % args.partitions, f"w{i}"))
            times.append(time.perf_counter() - t0)
        graves = [_grave(names, i % args.partitions, f"w{i}") for i in range(args.writes)]
        t0 = time.perf_counter()
        for g in graves:
            producer.send([g])
        grave_s = (time.perf_counter() - t0) / len(graves)
        times.sort()
        print(
            f"one entry of {RANGES:,} ranges: {size / 1024:.0f} KiB; acknowledged write p50 "
            f"{times[len(times) // 2] * 1000:.1f} ms, p99 {times[-1] * 1000:.1f} ms;"
            f" a tombstone {grave_s * 1000:.1f} ms"
        )
        # Steady state: per partition its committed entry and MAX_ATTEMPTS more.
        standing = {}
        for p in range(args.partitions):
            for a in range(5):
                producer.send(_entry(names, p, f"s{p}.{a}"))
            standing[p] = f"s{p}.0"
        seconds = _time_read(kafka, names, standing)
        live = args.partitions * 5
        print(f"read, steady state ({live} entries, {live * size / 2**20:.1f} MiB): {seconds:.2f} s")
        # The head: superseded entries and their tombstones not yet compacted away.
        head = int(args.head_minutes * 60 / args.commit_s) * args.partitions
        for i in range(head):
            p = i % args.partitions
            producer.send([*_entry(names, p, f"h{i}"), _grave(names, p, f"h{i}")])
        seconds = _time_read(kafka, names, standing)
        mib = (live + head) * size / 2**20
        print(
            f"read with a head of {head} superseded entries and tombstones ({args.head_minutes:g} min of commits"
            f" every {args.commit_s:g} s on {args.partitions} partitions, {mib:.1f} MiB): {seconds:.2f} s"
        )
        producer.close()


if __name__ == "__main__":
    main()
