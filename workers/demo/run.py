"""`rlstream demo`: the whole pipeline on one machine, with an accounting of every group at the end.

Synthetic rollout producers stage tensors and publish receipts while a Ray pool of reassembler
actors finalizes groups and a trainer loop consumes them by weight version, advancing its version
as it trains. The demo passes only if every produced group is consumed, evicted as stale, or
dead-lettered, exactly once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from schemas.deadletter import ALL_ROLLOUTS_FAILED, INCONSISTENT_GROUP, DeadLetter
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import TQConfig, TQStore, init_tq
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.telemetry.progress import Progress
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.consumer import ConsumerConfig, ExperienceConsumer
from workers.trainer.policies import policy_by_name

GROUP_DEAD_LETTER_KINDS = (ALL_ROLLOUTS_FAILED, INCONSISTENT_GROUP)


@dataclass(frozen=True)
class DemoConfig:
    bootstrap_servers: str | None = None
    prefix: str | None = None
    ray_address: str | None = None
    groups: int = 160
    producers: int = 2
    reassemblers: int = 2
    external_reassemblers: bool = False
    partitions: int = 4
    batch_groups: int = 8
    policy: str = "windowed"
    max_staleness: int = 2
    versions_every: int = 3
    train_step_s: float = 0.02
    # Generation pace of all producers together, so the trainer advances while rollouts arrive.
    produce_rate_groups_s: float = 8.0
    group_timeout_s: float = 10.0
    timeout_s: float = 300.0
    shape: SyntheticShape = SyntheticShape(
        group_size=8,
        calls=(1, 4),
        prompt_len=(16, 96),
        answer_len=(16, 192),
        observation_len=(4, 48),
        failure_rate=0.03,
        violation_rate=0.1,
    )


@dataclass
class DemoReport:
    bootstrap_servers: str = ""
    prefix: str = ""
    groups_produced: int = 0
    groups_finalized: int = 0
    groups_consumed: int = 0
    groups_evicted_stale: int = 0
    groups_dead_lettered: int = 0
    poison_receipts_dead_lettered: int = 0
    duplicates_dropped: int = 0
    final_weight_version: int = 0
    elapsed_s: float = 0.0
    groups_per_s: float = 0.0
    tokens_per_s: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    accounted: bool = False
    problems: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class _Shared:
    """What producers and the trainer share: the trainer's weight version and per-group ack times."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 0
        self.acked_at: dict[str, float] = {}
        self.produced: list[str] = []
        self.errors: list[str] = []


def _producer(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, index: int, shared: _Shared, stop: threading.Event
) -> None:
    rng = random.Random(index)
    pub = RolloutPublisher(kafka, TQStore(), names.receipts)
    try:
        mine = range(index, cfg.groups, cfg.producers)
        for n, g in enumerate(mine):
            if stop.is_set():
                return
            gid = f"{names.prefix}-g{g:05d}"
            with shared.lock:
                # Rollout workers lag the trainer by a few versions, as in asynchronous RL.
                wv = max(0, shared.version - rng.choice((0, 0, 0, 1, 1, 1, 2, 2, 3, 4)))
            shape = cfg.shape if not (index == 0 and n == 3) else replace(cfg.shape, failure_rate=1.0)
            rollouts = make_group(gid, g, wv, shape=shape, seed=index)
            with shared.lock:
                shared.produced.append(gid)
            pub.publish(rollouts)
            with shared.lock:
                shared.acked_at[gid] = time.time()
            stop.wait(cfg.producers / cfg.produce_rate_groups_s)
            if index == 0 and n == 5:
                # One poison receipt: not MessagePack at all. It must be dead-lettered, not block the partition.
                AckedProducer(kafka).send([Outgoing(names.receipts, b"poison", os.urandom(48))])
    except Exception as exc:  # noqa: BLE001 - surfaced in the report, the demo then fails
        shared.errors.append(f"producer {index}: {type(exc).__name__}: {exc}")
    finally:
        pub.close()


def _start_reassemblers(kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, tq: TQConfig):
    import ray

    from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors
    from workers.reassembler.config import ReassemblerConfig, default_actor_config

    actors = create_rollout_reassembler_actors(
        DataPlaneConfig(tq=tq), default_actor_config(), num_workers=cfg.reassemblers
    )
    runs = [
        a.run_worker.remote(
            kafka,
            ReassemblerConfig(
                prefix=names.prefix,
                worker_id=f"actor-{i}",
                consumer_group=f"reassemblers.{names.prefix}",
                group_timeout_s=cfg.group_timeout_s,
            ),
        )
        for i, a in enumerate(actors)
    ]

    def stop() -> None:
        for a in actors:
            a.stop_worker.remote()
        try:
            ray.get(runs, timeout=60)
        finally:
            for a in actors:
                ray.kill(a)

    return stop


class _DeadLetterWatch:
    """Follows the dead-letter topic (read_committed) and sorts letters into failed groups and poison receipts."""

    def __init__(self, kafka: KafkaConfig, topic: str):
        from confluent_kafka import Consumer, TopicPartition

        self._consumer = Consumer(kafka.consumer(f"demo-deadletters-{uuid.uuid4().hex[:8]}"))
        parts = self._consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        self.groups: set[str] = set()
        self.poison = 0

    def poll(self) -> None:
        for m in self._consumer.consume(500, timeout=0):
            if m.error() is not None:
                continue
            d = DeadLetter.from_bytes(m.value())
            if d.error_kind in GROUP_DEAD_LETTER_KINDS and d.source_key is not None:
                self.groups.add(d.source_key.decode())
            else:
                self.poison += 1

    def close(self) -> None:
        self._consumer.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_sigterm() -> None:
    # After Ray's init, which installs its own SIGTERM handler: a terminated demo must still stop
    # the broker, Ray and the actors it started, exactly as on Ctrl-C.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def run_demo(cfg: DemoConfig, *, log: Callable[[str], None] = print) -> DemoReport:
    """Run the pipeline end to end and account for every group; stops everything it started."""
    report = DemoReport(prefix=cfg.prefix or f"demo-{uuid.uuid4().hex[:8]}")
    names = TopicNames(report.prefix)
    cleanups: list[Callable[[], None]] = []
    stop = threading.Event()
    t_start = time.monotonic()
    try:
        bootstrap = cfg.bootstrap_servers
        if bootstrap is None:
            tmp = tempfile.TemporaryDirectory(prefix="rlstream-demo-")
            cleanups.append(tmp.cleanup)
            log("starting a local Kafka broker (KRaft, single node) ...")
            broker = LocalBroker(BrokerConfig(data_dir=Path(tmp.name)), log=log).start()
            cleanups.append(broker.stop)
            bootstrap = broker.bootstrap_servers
        report.bootstrap_servers = bootstrap
        kafka = KafkaConfig(bootstrap)
        log(f"broker: bootstrap.servers={bootstrap}")
        tq = TQConfig(address=cfg.ray_address)
        log("starting Ray and TransferQueue (partitions 'staging' and 'train') ...")
        session = init_tq(tq)
        cleanups.append(session.close)
        _stop_on_sigterm()
        create_topics(kafka, pipeline_topics(names, cfg.partitions))
        log(
            f"topics: {names.receipts}, {names.finalized}, {names.deadletter}, {names.state} "
            f"({cfg.partitions} partitions)"
        )
        if not cfg.external_reassemblers:
            actor_tq = replace(tq, address=tq.address or "auto")
            cleanups.append(_start_reassemblers(kafka, names, cfg, actor_tq))
            log(f"reassemblers: {cfg.reassemblers} Ray actors in consumer group reassemblers.{names.prefix}")
        shared = _Shared()
        producers = [
            threading.Thread(target=_producer, args=(kafka, names, cfg, i, shared, stop), daemon=True)
            for i in range(cfg.producers)
        ]
        for t in producers:
            t.start()
        log(
            f"producers: {cfg.producers} x {cfg.groups // cfg.producers} groups of {cfg.shape.group_size} "
            f"rollouts; trainer: {cfg.policy} policy, staleness bound {cfg.max_staleness}"
        )
        _train(kafka, names, cfg, shared, producers, report, time.monotonic(), log)
        stop.set()
        for t in producers:
            t.join(timeout=30)
        report.problems.extend(shared.errors)
    except KeyboardInterrupt:
        report.problems.append("interrupted")
        raise
    finally:
        stop.set()
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                log(f"cleanup: {type(exc).__name__}: {exc}")
        report.elapsed_s = round(time.monotonic() - t_start, 2)
    return report


def _train(
    kafka: KafkaConfig,
    names: TopicNames,
    cfg: DemoConfig,
    shared: _Shared,
    producers,
    report: DemoReport,
    t_stream: float,
    log: Callable[[str], None],
) -> None:
    """The trainer loop; throughput is measured over the streaming window, from the first receipt on."""
    params = (
        {"max_staleness_versions": cfg.max_staleness}
        if cfg.policy == "windowed"
        else ({"max_lookahead_versions": cfg.max_staleness} if cfg.policy == "in_order" else {})
    )
    consumed: list[str] = []
    evicted: list[str] = []
    latencies: list[float] = []
    tokens = 0

    def on_yield(group, version):
        latencies.append((time.time() - shared.acked_at.get(group.group_id, time.time())) * 1000.0)
        consumed.append(group.group_id)

    consumer = ExperienceConsumer(
        kafka,
        TQStore(),
        ConsumerConfig(names, group_id=f"trainer.{names.prefix}"),
        policy_by_name(cfg.policy, **params),
        on_yield=on_yield,
        on_evict=lambda g, v: evicted.append(g.group_id),
    )
    progress = Progress(cfg.groups, log)
    dead = _DeadLetterWatch(kafka, names.deadletter)
    steps = 0
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while time.monotonic() < deadline:
            batch = consumer.next_batch(cfg.batch_groups, timeout_s=0.5)
            if batch is not None:
                tokens += sum(g.canonical_output_tokens for g in batch.groups)
                time.sleep(cfg.train_step_s)  # the "training step"
                consumer.release(batch)
                steps += 1
                if steps % cfg.versions_every == 0:
                    with shared.lock:
                        shared.version += 1
                        consumer.set_version(shared.version)
            producing = any(t.is_alive() for t in producers)
            dead.poll()
            with shared.lock:
                produced = len(shared.produced)
            done = len(set(consumed)) + len(set(evicted)) + len(dead.groups)
            progress.update(
                produced=produced,
                finalized=consumer.counts.yielded + consumer.counts.evicted_stale + consumer.counts.waiting,
                consumed=len(consumed),
                evicted=len(evicted),
                dead=len(dead.groups),
                version=shared.version,
            )
            if not producing and done >= produced and produced == cfg.groups:
                break
            if not producing and shared.errors:
                break
    finally:
        progress.close()
        consumer.close()
        dead.close()
    dead_groups, poison = dead.groups, dead.poison
    elapsed = time.monotonic() - t_stream
    with shared.lock:
        produced_ids = list(shared.produced)
    report.groups_produced = len(produced_ids)
    report.groups_consumed = len(consumed)
    report.groups_evicted_stale = len(evicted)
    report.groups_dead_lettered = len(dead_groups)
    report.groups_finalized = len(consumed) + len(evicted)
    report.poison_receipts_dead_lettered = poison
    report.duplicates_dropped = consumer.counts.duplicates
    report.final_weight_version = shared.version
    report.groups_per_s = round(len(consumed) / elapsed, 2) if elapsed else 0.0
    report.tokens_per_s = round(tokens / elapsed, 1) if elapsed else 0.0
    report.latency_p50_ms = round(_percentile(latencies, 0.50), 1)
    report.latency_p99_ms = round(_percentile(latencies, 0.99), 1)
    report.problems.extend(_accounting_problems(produced_ids, consumed, evicted, dead_groups))
    if time.monotonic() >= deadline:
        report.problems.append(f"timed out after {cfg.timeout_s:.0f}s")
    report.accounted = not report.problems


def _accounting_problems(produced: list[str], consumed: list[str], evicted: list[str], dead: set[str]) -> list[str]:
    problems = []
    outcomes = consumed + evicted + sorted(dead)
    twice = sorted({g for g in outcomes if outcomes.count(g) > 1})
    if twice:
        problems.append(f"{len(twice)} group(s) accounted more than once, e.g. {twice[:3]}")
    missing = sorted(set(produced) - set(outcomes))
    if missing:
        problems.append(f"{len(missing)} produced group(s) never reached an outcome, e.g. {missing[:3]}")
    unknown = sorted(set(outcomes) - set(produced))
    if unknown:
        problems.append(f"{len(unknown)} group(s) not produced by this run, e.g. {unknown[:3]}")
    return problems


def summary_table(report: DemoReport) -> str:
    rows = [
        ("groups produced", report.groups_produced),
        ("groups finalized", report.groups_finalized),
        ("groups consumed by the trainer", report.groups_consumed),
        ("groups evicted as stale", report.groups_evicted_stale),
        ("groups dead-lettered", report.groups_dead_lettered),
        ("poison receipts dead-lettered", report.poison_receipts_dead_lettered),
        ("final trainer weight version", report.final_weight_version),
        ("throughput", f"{report.groups_per_s} groups/s, {report.tokens_per_s:,.0f} tokens/s"),
        ("latency last receipt -> trainer", f"p50 {report.latency_p50_ms} ms, p99 {report.latency_p99_ms} ms"),
        ("wall time", f"{report.elapsed_s} s"),
        ("every group accounted for once", "yes" if report.accounted else "NO"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  problem: {p}" for p in report.problems]
    return "\n".join(["rlstream demo summary", *lines])


def write_json(report: DemoReport, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(report), indent=2) + "\n")
