"""rlstream end to end for `bench.dataplane` and `bench.scaling`: publisher staging through trainer ack.

The real pieces: `producers` `RolloutPublisher`s (each in a thread of this process, with its own
Kafka producer) stage and publish `groups_per_publish` groups per call (default `groups_per_call`);
`workers` reassembler processes (`bench/dataplane/child.py`, the real `ReassemblerWorker`) finalize them;
the trainer's `ExperienceConsumer` (this process's main thread, policy `ready_first`) selects
`groups_per_call` groups at a time, materializes them padded and acks them. A round's time runs from
its first publish to its last ack; the groups are generated before. A group's latency runs from the
return of the publish call carrying it to the return of the select handing it out (both clocks in
this process).
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import ConsumerGroupState, KafkaException
from confluent_kafka.admin import AdminClient

from bench.common import SHAPE
from bench.dataplane.child import request_timings, spawn
from bench.dataplane.timing import TimedStore, merge
from schemas.request import RolloutReassemblerActorConfig
from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, ray_address
from workers.reassembler.config import ReassemblerConfig, default_actor_config
from workers.rollout.publisher import RolloutPublisher, StagedRollout
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first


@dataclass
class E2EResult:
    """One round: wall seconds, when the publisher finished, and where each role spent its time."""

    groups: int
    groups_per_call: int
    seconds: float
    publish_done_s: float
    publisher: dict[str, float]  # publish calls in total, of which TQ puts
    trainer: dict[str, float]  # select (mostly waiting for the reassembler), materialize, ack
    stores: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # role -> TimedStore stats
    commits: list[float] = field(default_factory=list)  # reassembler commit steps, groups, seconds
    latencies: list[float] = field(default_factory=list)  # per group: publish returned -> select handed out
    tokens: int = 0  # tokens of every rollout of the round
    staged_bytes: int = 0  # bytes of the staged call deltas (token ids, mask, logprobs)

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


class _Publisher(threading.Thread):
    def __init__(self, pub: RolloutPublisher, batches: list[list[StagedRollout]]):
        super().__init__(daemon=True)
        self.pub, self.batches = pub, batches
        self.seconds, self.done_at, self.error = 0.0, 0.0, None
        self.published: dict[str, float] = {}  # group id -> when the publish call carrying it returned

    def run(self) -> None:
        try:
            for batch in self.batches:
                t0 = time.perf_counter()
                self.pub.publish(batch)
                t1 = time.perf_counter()
                self.seconds += t1 - t0
                self.published.update((r.receipt.group_id, t1) for r in batch)
            self.done_at = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            self.error = exc


def wait_for_members(kafka: KafkaConfig, group: str, procs: list[subprocess.Popen], timeout_s: float = 600.0) -> None:
    """Until consumer group `group` is stable with a member per worker process, each owning partitions.

    Workers attaching to Ray one after the other join the group at different times; waiting here
    keeps the rebalances they cause out of the measured rounds.
    """
    admin = AdminClient(kafka.admin())
    deadline, members = time.monotonic() + timeout_s, len(procs)
    while True:
        if dead := [p.pid for p in procs if p.poll() is not None]:
            raise RuntimeError(f"reassembler process(es) {dead} exited before joining {group}")
        try:
            desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
        except KafkaException:  # no coordinator for a group nobody has joined yet: ask again
            desc = None
        if desc is not None:
            owners = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
            if desc.state == ConsumerGroupState.STABLE and len(owners) == members == len(desc.members):
                return
        if time.monotonic() > deadline:
            seen = len(desc.members) if desc is not None else 0
            raise RuntimeError(f"{group}: {seen} of {members} workers joined and stable after {timeout_s:.0f}s")
        time.sleep(0.2)


class EndToEnd:
    """A pipeline on its own topics (broker and TQ already running); `run_round` measures one round.

    `shape` sizes the groups (`actor`: the reassembler's finalization settings, router replay on for
    a shape with routed experts); `producers` publisher threads share a round's publish calls
    round-robin, `groups_per_publish` groups each (default `groups_per_call`); the receipts topic
    (like the others) has `partitions` partitions.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        groups_per_call: int,
        workers: int = 1,
        *,
        shape: SyntheticShape = SHAPE,
        producers: int = 1,
        partitions: int = 4,
        groups_per_publish: int | None = None,
        actor: RolloutReassemblerActorConfig | None = None,
    ):
        self.k, self.shape, self._kafka = groups_per_call, shape, kafka
        self.per_publish = groups_per_publish or groups_per_call
        self.names = TopicNames(f"dp-{uuid.uuid4().hex[:6]}")
        create_topics(kafka, pipeline_topics(self.names, partitions))
        self._tmp = tempfile.TemporaryDirectory()
        self._outs = [Path(self._tmp.name) / f"w{i}.json" for i in range(workers)]
        self.worker_group = f"dp.{self.names.prefix}"
        self.procs = [
            spawn(
                kafka,
                ReassemblerConfig(
                    prefix=self.names.prefix,
                    worker_id=f"dp{i}",
                    consumer_group=self.worker_group,
                    actor=actor or default_actor_config(),
                ),
                TQConfig(address=ray_address()),
                out,
            )
            for i, out in enumerate(self._outs)
        ]
        self.pub_store, self.trainer_store = TimedStore(TQStore()), TimedStore(TQStore())
        self.pubs = [RolloutPublisher(kafka, self.pub_store, self.names.receipts) for _ in range(producers)]
        self.pub = self.pubs[0]
        config = ConsumerConfig(prefix=self.names.prefix, consumer_group=f"dp-trainer-{self.names.prefix}")
        self.consumer = ExperienceConsumer(kafka, self.trainer_store, config, ready_first(), version=1)
        self._rounds = 0

    def warm_up(self) -> None:
        """A group through every publisher and every piece once all workers own partitions: process
        start, Ray attach, rebalances and producer set-up stay out of the figures."""
        wait_for_members(self._kafka, self.worker_group, self.procs)
        for i, pub in enumerate(self.pubs):
            pub.publish(make_group(f"warmup{i}", i, 1, shape=self.shape))
        self._train(len(self.pubs), {}, timeout_s=600.0)
        self._reset()

    def _reset(self) -> dict:
        worker = [request_timings(p, out) for p, out in zip(self.procs, self._outs)]
        return {
            "publisher": self.pub_store.snapshot(),
            "trainer": self.trainer_store.snapshot(),
            "reassembler": merge(*(w["store"] for w in worker)),
            "commits": [sum(w["commits"][i] for w in worker) for i in range(3)],
        }

    def _train(
        self, groups: int, times: dict[str, float], handed: dict[str, float] | None = None, timeout_s: float = 120.0
    ) -> None:
        done = 0
        while done < groups:
            t0 = time.perf_counter()
            want = min(self.k, groups - done)
            meta = self.consumer.select(1, min_groups=want, max_groups=want, timeout_s=timeout_s)
            if meta is None:
                raise RuntimeError(f"no finalized group within {timeout_s}s ({done} of {groups} trained)")
            t1 = time.perf_counter()
            if handed is not None:
                handed.update((g.group_id, t1) for g in meta.groups)
            self.consumer.materialize(meta)
            t2 = time.perf_counter()
            self.consumer.ack(meta)
            t3 = time.perf_counter()
            for name, dt in (("select", t1 - t0), ("materialize", t2 - t1), ("ack", t3 - t2)):
                times[name] = times.get(name, 0.0) + dt
            done += len(meta)

    def run_round(self, groups: int) -> E2EResult:
        """`groups` groups from first publish to last ack, `groups_per_publish` per publish call and
        `groups_per_call` per select."""
        self._rounds += 1
        rollouts = [make_group(f"e{self._rounds}-{i:04d}", i, 1, shape=self.shape) for i in range(groups)]
        step = self.per_publish
        batches = [[r for g in rollouts[i : i + step] for r in g] for i in range(0, groups, step)]
        n = len(self.pubs)
        publishers, trainer, handed = [_Publisher(p, batches[i::n]) for i, p in enumerate(self.pubs)], {}, {}
        t0 = time.perf_counter()
        for p in publishers:
            p.start()
        self._train(groups, trainer, handed)
        seconds = time.perf_counter() - t0
        for p in publishers:
            p.join()
        if error := next((p.error for p in publishers if p.error is not None), None):
            raise error
        published = {g: t for p in publishers for g, t in p.published.items()}
        stats = self._reset()
        put_s = sum(v[2] for k, v in stats["publisher"].items() if k.startswith("put "))
        segments = [seg for g in rollouts for r in g for seg in r.segments]
        return E2EResult(
            groups=groups,
            groups_per_call=self.k,
            seconds=seconds,
            publish_done_s=max(p.done_at for p in publishers) - t0,
            publisher={"publish": sum(p.seconds for p in publishers), "tq put": put_s},
            trainer=trainer,
            stores={r: stats[r] for r in ("publisher", "reassembler", "trainer")},
            commits=stats["commits"],
            latencies=[handed[g] - published[g] for g in handed],
            tokens=sum(len(seg["token_ids"]) for seg in segments),
            staged_bytes=sum(t.nbytes for seg in segments for t in seg.values()),
        )

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a worker that will not stop is killed, by its own pid
                p.kill()
        self.consumer.close()
        for pub in self.pubs:
            pub.close()
        self._tmp.cleanup()
