"""The demo's trainer: an `ExperienceConsumer` loop that advances its weight version while it trains.

It records every group's outcome (consumed, evicted as stale, dead-lettered), follows the
dead-letter topic, and fills the report's figures once the producers are done and every produced
group has reached an outcome, or the time is up.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, TopicPartition

from schemas.deadletter import ALL_ROLLOUTS_FAILED, GROUP_TIMEOUT, INCONSISTENT_GROUP, DeadLetter
from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.tq import TQStore
from workers.demo.config import DemoConfig
from workers.demo.producers import SharedState, trainer_id
from workers.demo.report import DemoReport, accounting_problems, percentile
from workers.telemetry.progress import Progress
from workers.telemetry.sensors import TrainerSensor
from workers.topics import TopicNames
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import policy_by_name
from workers.trainer.version_topic import VersionPublisher

# Dead letters that stand for a whole prompt group; any other kind is a single bad receipt.
GROUP_DEAD_LETTER_KINDS = (ALL_ROLLOUTS_FAILED, GROUP_TIMEOUT, INCONSISTENT_GROUP)


class DeadLetterWatch:
    """Follows the dead-letter topic (read_committed) and sorts letters into failed groups and poison receipts."""

    def __init__(self, kafka: KafkaConfig, topic: str):
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


class TrainerLoop:
    """The trainer side of the demo; `run` until every produced group has an outcome, then `fill` the report."""

    def __init__(
        self,
        kafka: KafkaConfig,
        names: TopicNames,
        cfg: DemoConfig,
        shared: SharedState,
        log: Callable[[str], None],
        *,
        sensor: TrainerSensor | None = None,
    ):
        self.cfg, self.shared = cfg, shared
        self.consumed: list[str] = []
        self.evicted: list[str] = []
        self.latencies_ms: list[float] = []
        self.tokens = 0
        self.steps = 0
        self.trained_groups = 0
        self.timed_out = False
        self.consumer = ExperienceConsumer(
            kafka,
            TQStore(),
            ConsumerConfig(prefix=names.prefix, consumer_group=trainer_id(names)),
            policy_by_name(cfg.policy, **cfg.policy_params),
            on_yield=self._on_yield,
            on_evict=lambda g, v: self.evicted.append(g.group_id),
            sensor=sensor,
        )
        self.dead = DeadLetterWatch(kafka, names.deadletter)
        # The producers' admission gate reads this; one version step consumes versions_every batches.
        self.versions = VersionPublisher(
            kafka,
            names.trainer_version,
            trainer_id=trainer_id(names),
            consumer_group=trainer_id(names),
            batch_groups=cfg.batch_groups * cfg.versions_every,
        )
        self.versions.publish(shared.version)
        self.progress = Progress(cfg.groups, log)

    def _on_yield(self, group: FinalizedGroup, version: int) -> None:
        now = time.time()
        self.latencies_ms.append((now - self.shared.acked_at.get(group.group_id, now)) * 1000.0)
        self.consumed.append(group.group_id)

    def _train_step(self) -> None:
        batch = self.consumer.next_batch(self.cfg.batch_groups, timeout_s=0.5)
        if batch is None:
            return
        self.tokens += sum(g.canonical_output_tokens for g in batch.groups)
        time.sleep(self.cfg.train_step_s)  # the "training step"
        self.consumer.release(batch)
        self.steps += 1
        self.trained_groups += len(batch.groups)
        if self._version_step_done():
            with self.shared.lock:
                self.shared.version += 1
                self.consumer.set_version(self.shared.version)

    def _version_step_done(self) -> bool:
        """Off: a version per `versions_every` batches, however full. On: per B groups trained, since the
        admission gate counts on B = batch_groups * versions_every groups per version, as AReaL's trainer
        (which waits for full batches) does."""
        if not self.cfg.admission:
            return self.steps % self.cfg.versions_every == 0
        per_version = self.cfg.batch_groups * self.cfg.versions_every
        return self.trained_groups >= (self.shared.version + 1) * per_version

    def _show(self, produced: int) -> None:
        counts = self.consumer.counts
        self.progress.update(
            produced=produced,
            finalized=counts.yielded + counts.evicted_stale + counts.waiting,
            consumed=len(self.consumed),
            evicted=len(self.evicted),
            dead=len(self.dead.groups),
            version=self.shared.version,
        )

    def run(self, producers: list[threading.Thread], healthy: Callable[[], str | None] = lambda: None) -> None:
        """Train until the producers are done and every group has an outcome, something failed, or time is up.

        `healthy` returns why the pipeline cannot finish (a reassembler died, say), or None.
        """
        deadline = time.monotonic() + self.cfg.timeout_s
        try:
            while True:
                if time.monotonic() >= deadline:
                    self.timed_out = True
                    return
                self._train_step()
                # Each round, not only on a version step: groups lost (evicted, missing rows) give the
                # producers' gate their capacity back, or a trainer short of a batch would wait forever.
                with self.shared.lock:
                    version = self.shared.version
                self.versions.publish(version, lost_groups=self.consumer.counts.lost)
                producing = any(t.is_alive() for t in producers)
                self.dead.poll()
                with self.shared.lock:
                    produced = len(self.shared.produced)
                    failed = bool(self.shared.errors)
                self._show(produced)
                done = len(set(self.consumed)) + len(set(self.evicted)) + len(self.dead.groups)
                if not producing and (failed or (produced == self.cfg.groups and done >= produced)):
                    return
                problem = healthy()
                if problem is not None:
                    with self.shared.lock:
                        self.shared.errors.append(problem)
                    return
        finally:
            self.progress.close()
            self.consumer.close()
            self.dead.close()
            self.versions.close()

    def fill(self, report: DemoReport, elapsed_s: float) -> None:
        """The trainer's figures and the accounting of every produced group, over `elapsed_s` of streaming."""
        with self.shared.lock:
            produced = list(self.shared.produced)
        report.groups_produced = len(produced)
        report.groups_consumed = len(self.consumed)
        report.groups_evicted_stale = len(self.evicted)
        report.groups_dead_lettered = len(self.dead.groups)
        report.groups_finalized = len(self.consumed) + len(self.evicted)
        report.poison_receipts_dead_lettered = self.dead.poison
        report.duplicates_dropped = self.consumer.counts.duplicates
        report.final_weight_version = self.shared.version
        report.admission = self.cfg.admission
        report.admission_wait_s = round(self.shared.gate_wait_s, 2)
        report.groups_per_s = round(len(self.consumed) / elapsed_s, 2) if elapsed_s else 0.0
        report.tokens_per_s = round(self.tokens / elapsed_s, 1) if elapsed_s else 0.0
        report.latency_p50_ms = round(percentile(self.latencies_ms, 0.50), 1)
        report.latency_p99_ms = round(percentile(self.latencies_ms, 0.99), 1)
        report.problems.extend(accounting_problems(produced, self.consumed, self.evicted, self.dead.groups))
        if self.timed_out:
            report.problems.append(f"timed out after {self.cfg.timeout_s:.0f}s")
