"""Latency for `python -m bench.dataplane`: a group's last receipt acked -> its committed finalized record visible.

Measured as `bench/pipeline.py` does, on one reassembler process (`bench/dataplane/child.py`, the real
worker): first the peak, the drain rate of a backlog whose tensors were staged beforehand and whose
receipts are then produced at once; then `groups` groups published one at a time at half of that
rate, each timed from the return of its publish call (receipts acked by the broker) to the moment a
read_committed consumer sees its record. Where the time goes, per group, from the record's own
timings (`finalized_at_ms`, `metrics`) and the worker's commit ends (wall clocks of one machine):

  poll          acked -> the step starts fetching (the poll's wake-up, and receipts batched into a step)
  TQ fetch      what the step still waited for its staged rows (the ownership lookup and the get;
                less when the previous step read them ahead, `workers/reassembler/prefetch.py`)
  build + put   the pure build and this group's share of the train put
  transaction   record built -> the step's Kafka commit returned (produce, offsets, commit)
  visibility    commit returned -> the record seen by a read_committed consumer
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Arrivals, percentile, wake_on_arrival
from bench.dataplane.child import request_timings, spawn
from bench.dataplane.e2e import wait_for_members
from schemas.finalized import FinalizedGroup
from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import TQConfig, TQStore, ray_address
from workers.reassembler.config import ReassemblerConfig
from workers.rollout.publisher import RolloutPublisher, stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames, pipeline_topics

PARTS = ("poll", "TQ fetch", "build + put", "transaction", "visibility")


@dataclass
class LatencyResult:
    peak_groups_per_s: float
    rate: float
    groups: int
    p50_ms: float
    p99_ms: float
    parts: dict[str, list[float]] = field(default_factory=dict)  # part -> ms per group


class _Records(Arrivals):
    """`Arrivals` that also keeps each record's `finalized_at_ms`."""

    def __init__(self, kafka: KafkaConfig, topic: str):
        super().__init__(kafka, topic)
        self.finalized_at: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            for m in wake_on_arrival(self._consumer, 500, 0.01):
                if m.error() is None:
                    group = FinalizedGroup.from_bytes(m.value())
                    self.seen.setdefault(group.group_id, time.time())
                    self.metrics.setdefault(group.group_id, group.metrics)
                    self.finalized_at.setdefault(group.group_id, group.finalized_at_ms / 1000.0)
        self._consumer.close()


def _wait(records: _Records, groups: list[str], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(g not in records.seen for g in groups):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sum(g not in records.seen for g in groups)} group(s) not finalized in {timeout_s}s")
        time.sleep(0.005)


def measure_latency(kafka: KafkaConfig, shape: SyntheticShape, groups: int) -> LatencyResult:
    names = TopicNames(f"dplat-{uuid.uuid4().hex[:6]}")
    create_topics(kafka, pipeline_topics(names, 4))
    records = _Records(kafka, names.finalized)
    records.start()
    tmp = tempfile.TemporaryDirectory()
    out = Path(tmp.name) / "w.json"
    config = ReassemblerConfig(prefix=names.prefix, worker_id="lat0", consumer_group=f"dplat.{names.prefix}")
    proc = spawn(kafka, config, TQConfig(address=ray_address()), out)
    store = TQStore()
    pub = RolloutPublisher(kafka, store, names.receipts)
    try:
        wait_for_members(kafka, config.consumer_group, [proc])
        pub.publish(make_group("warmup", 0, 1, shape=shape))
        _wait(records, ["warmup"])
        backlog = [make_group(f"d{i:04d}", i, 1, shape=shape) for i in range(groups)]
        stage_rollouts(store, [r for g in backlog for r in g])
        t0 = time.time()
        AckedProducer(kafka).send(
            [Outgoing(names.receipts, r.receipt.group_id.encode(), r.receipt.to_bytes()) for g in backlog for r in g]
        )
        drained = [f"d{i:04d}" for i in range(groups)]
        _wait(records, drained)
        peak = groups / (max(records.seen[g] for g in drained) - t0)
        rate = peak / 2
        paced = [make_group(f"p{i:04d}", i, 1, shape=shape) for i in range(groups)]
        request_timings(proc, out)  # commit ends from here on
        acked: dict[str, float] = {}
        start = time.time()
        for i, rollouts in enumerate(paced):
            time.sleep(max(0.0, start + i / rate - time.time()))
            pub.publish(rollouts)
            acked[rollouts[0].receipt.group_id] = time.time()
        _wait(records, list(acked))
        ends = sorted(request_timings(proc, out)["commit_ends"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        records.stop.set()
        pub.close()
        tmp.cleanup()
    latencies = [(records.seen[g] - acked[g]) * 1000 for g in acked]
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    for g, t_ack in acked.items():
        m, built, seen = records.metrics[g], records.finalized_at[g], records.seen[g]
        i = bisect_left(ends, built)
        committed = ends[i] if i < len(ends) else seen
        parts["poll"].append((built - t_ack) * 1000 - m["fetch_ms"] - m["build_put_ms"])
        parts["TQ fetch"].append(m["fetch_ms"])
        parts["build + put"].append(m["build_put_ms"])
        parts["transaction"].append((committed - built) * 1000)
        parts["visibility"].append((seen - committed) * 1000)
    return LatencyResult(peak, rate, len(acked), percentile(latencies, 0.5), percentile(latencies, 0.99), parts)


def print_latency(r: LatencyResult) -> None:
    print(
        f"\nlatency (dense, 1 reassembler): last receipt acked -> committed record visible, {r.groups} groups "
        f"paced at {r.rate:.1f} groups/s (half of the peak drain, {r.peak_groups_per_s:.1f} groups/s)"
    )
    print(f"  p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms; where it goes, ms per group (median, p99):")
    for part, values in r.parts.items():
        print(f"    {part:<12} {statistics.median(values):>8.1f} {percentile(values, 0.99):>8.1f}")
