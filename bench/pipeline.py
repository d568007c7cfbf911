"""End-to-end reassembler benchmark: groups/s and latency from a group's last receipt to its committed record.

Runs on the real local broker and Ray/TQ with 1 and then 2 worker processes, groups of 8 rollouts x
2048 tokens (4 model calls each). Throughput is the drain rate of a backlog whose tensors were staged
beforehand (so the publisher's own cost is not measured); latency is measured separately at a paced
rate, by default half of the drain rate just measured (half of peak load), from the broker's ack of a
group's last receipt to the moment its finalized record is visible to a read_committed consumer.
Target: p99 under 100 ms at half of peak.

    .venv/bin/python -m bench.pipeline [--groups 60] [--rate GROUPS_PER_S]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import SHAPE, Arrivals, percentile
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import TRAIN, TQConfig, TQStore, init_tq, ray_address
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import spawn_worker
from workers.rollout.publisher import RolloutPublisher, stage_rollouts
from workers.rollout.synthetic import make_group
from workers.topics import TopicNames, pipeline_topics


def _paced(pub: RolloutPublisher, arrivals: Arrivals, n: int, rate: float) -> dict[str, float]:
    """Publish n groups at `rate` groups/s and wait for all; returns group id -> time its receipts were acked."""
    paced = [make_group(f"l{i:04d}", i, 1, shape=SHAPE) for i in range(n)]
    acked: dict[str, float] = {}
    for i, rollouts in enumerate(paced):
        t_next = time.time() + 1.0 / rate
        pub.publish(rollouts)
        acked[f"l{i:04d}"] = time.time()
        time.sleep(max(0.0, t_next - time.time()))
    while any(g not in arrivals.seen for g in acked):
        time.sleep(0.05)
    return acked


def run_case(kafka: KafkaConfig, store: TQStore, workers: int, groups: int, rate: float | None) -> dict:
    names = TopicNames(f"bench-{workers}w-{uuid.uuid4().hex[:6]}")
    create_topics(kafka, pipeline_topics(names, 4))
    arrivals = Arrivals(kafka, names.finalized)
    arrivals.start()
    procs = [
        spawn_worker(
            kafka,
            ReassemblerConfig(prefix=names.prefix, worker_id=f"b{i}", consumer_group=f"bench.{names.prefix}"),
            TQConfig(address=ray_address()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    pub = RolloutPublisher(kafka, store, names.receipts)
    try:
        # Warm-up group: excludes process start, Ray attach and the first rebalance from the figures.
        pub.publish(make_group("warmup", 0, 0, shape=SHAPE))
        while "warmup" not in arrivals.seen:
            time.sleep(0.1)
        time.sleep(2.0 if workers > 1 else 0.5)
        backlog = [r for i in range(groups) for r in make_group(f"t{i:04d}", i, 1, shape=SHAPE)]
        stage_rollouts(store, backlog)
        t0 = time.time()
        AckedProducer(kafka).send(
            [Outgoing(names.receipts, r.receipt.group_id.encode(), r.receipt.to_bytes()) for r in backlog]
        )
        drained = [f"t{i:04d}" for i in range(groups)]
        while any(g not in arrivals.seen for g in drained):
            time.sleep(0.05)
        drain_s = max(arrivals.seen[g] for g in drained) - t0

        rate = rate or groups / drain_s / 2
        acked = _paced(pub, arrivals, max(10, groups), rate)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        arrivals.stop.set()
        pub.close()
    latencies = [(arrivals.seen[g] - acked[g]) * 1000 for g in acked]
    tokens = groups * SHAPE.group_size * 2048
    store.clear(TRAIN, [f"{g}_g{i}" for g in list(acked) + drained + ["warmup"] for i in range(8)])
    return {
        "workers": workers,
        "groups": groups,
        "rate": rate,
        "seconds": drain_s,
        "groups_per_s": groups / drain_s,
        "tokens_per_s": tokens / drain_s,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        # Medians over the paced groups of the reassembler's staging fetch (ownership lookup and get)
        # and build + train put, as each finalized record reports them.
        "fetch_ms": percentile([arrivals.metrics[g]["fetch_ms"] for g in acked], 0.5),
        "build_put_ms": percentile([arrivals.metrics[g]["build_put_ms"] for g in acked], 0.5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=60, help="backlog size for the throughput figure")
    parser.add_argument("--rate", type=float, help="paced groups/s for the latency figure (default: half the drain)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalBroker(BrokerConfig(data_dir=Path(tmp))) as broker:
        kafka = KafkaConfig(broker.bootstrap_servers)
        session = init_tq(TQConfig())
        try:
            store = TQStore()
            rows = [run_case(kafka, store, w, args.groups, args.rate) for w in (1, 2)]
        finally:
            session.close()
    print(
        f"\nreassembler end to end: groups of 8 rollouts x 2048 tokens (4 calls), 4 partitions; "
        f"throughput = drain of {args.groups} staged groups, latency at the paced rate (last receipt acked -> "
        f"finalized record visible)"
    )
    print(
        f"{'workers':>8} {'groups/s':>10} {'tokens/s':>12} {'paced g/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'drain s':>8}"
    )
    for r in rows:
        print(
            f"{r['workers']:>8} {r['groups_per_s']:>10.1f} {r['tokens_per_s']:>12,.0f} {r['rate']:>10.1f} "
            f"{r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} {r['seconds']:>8.1f}"
        )
    print("of the latency, medians the reassembler reports per group (the rest: poll, Kafka transaction, visibility):")
    for r in rows:
        print(
            f"  {r['workers']} worker(s): staging fetch {r['fetch_ms']:.1f} ms, "
            f"build + train put {r['build_put_ms']:.1f} ms"
        )
    print(f"2 workers / 1 worker throughput ratio: {rows[1]['groups_per_s'] / rows[0]['groups_per_s']:.2f}")


if __name__ == "__main__":
    main()
