"""rlstream end to end for `bench_dataplane.py`: publisher staging through trainer fetch and ack.

The real pieces: `RolloutPublisher` (in a thread of this process) stages and publishes
`groups_per_call` groups per call; `workers` reassembler processes (`dataplane_child.py`, the real
`ReassemblerWorker`) finalize them; the trainer's `ExperienceConsumer` (this process's main thread,
policy `ready_first`) selects `groups_per_call` groups at a time, materializes them padded and acks
them. A round's time runs from its first publish to its last ack; the groups are generated before.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench_pipeline import SHAPE
from dataplane_child import request_timings, spawn
from dataplane_timing import TimedStore, merge

from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, ray_address
from workers.reassembler.config import ReassemblerConfig
from workers.rollout.publisher import RolloutPublisher, StagedRollout
from workers.rollout.synthetic import make_group
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

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


class _Publisher(threading.Thread):
    def __init__(self, pub: RolloutPublisher, batches: list[list[StagedRollout]]):
        super().__init__(daemon=True)
        self.pub, self.batches = pub, batches
        self.seconds, self.done_at, self.error = 0.0, 0.0, None

    def run(self) -> None:
        try:
            for batch in self.batches:
                t0 = time.perf_counter()
                self.pub.publish(batch)
                self.seconds += time.perf_counter() - t0
            self.done_at = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            self.error = exc


class EndToEnd:
    """A pipeline on its own topics (broker and TQ already running); `run_round` measures one round."""

    def __init__(self, kafka: KafkaConfig, groups_per_call: int, workers: int = 1):
        self.k = groups_per_call
        self.names = TopicNames(f"dp-{uuid.uuid4().hex[:6]}")
        create_topics(kafka, pipeline_topics(self.names, 4))
        self._tmp = tempfile.TemporaryDirectory()
        self._outs = [Path(self._tmp.name) / f"w{i}.json" for i in range(workers)]
        group = f"dp.{self.names.prefix}"
        self.procs = [
            spawn(
                kafka,
                ReassemblerConfig(prefix=self.names.prefix, worker_id=f"dp{i}", consumer_group=group),
                TQConfig(address=ray_address()),
                out,
            )
            for i, out in enumerate(self._outs)
        ]
        self.pub_store, self.trainer_store = TimedStore(TQStore()), TimedStore(TQStore())
        self.pub = RolloutPublisher(kafka, self.pub_store, self.names.receipts)
        config = ConsumerConfig(prefix=self.names.prefix, consumer_group=f"dp-trainer-{self.names.prefix}")
        self.consumer = ExperienceConsumer(kafka, self.trainer_store, config, ready_first(), version=1)
        self._rounds = 0

    def warm_up(self) -> None:
        """One group through every piece: process start, Ray attach and rebalances stay out of the figures."""
        self.pub.publish(make_group("warmup", 0, 1, shape=SHAPE))
        self._train(1, {}, timeout_s=600.0)
        self._reset()

    def _reset(self) -> dict:
        worker = [request_timings(p, out) for p, out in zip(self.procs, self._outs)]
        return {
            "publisher": self.pub_store.snapshot(),
            "trainer": self.trainer_store.snapshot(),
            "reassembler": merge(*(w["store"] for w in worker)),
            "commits": [sum(w["commits"][i] for w in worker) for i in range(3)],
        }

    def _train(self, groups: int, times: dict[str, float], timeout_s: float = 120.0) -> None:
        done = 0
        while done < groups:
            t0 = time.perf_counter()
            want = min(self.k, groups - done)
            meta = self.consumer.select(1, min_groups=want, max_groups=want, timeout_s=timeout_s)
            if meta is None:
                raise RuntimeError(f"no finalized group within {timeout_s}s ({done} of {groups} trained)")
            t1 = time.perf_counter()
            self.consumer.materialize(meta)
            t2 = time.perf_counter()
            self.consumer.ack(meta)
            t3 = time.perf_counter()
            for name, dt in (("select", t1 - t0), ("materialize", t2 - t1), ("ack", t3 - t2)):
                times[name] = times.get(name, 0.0) + dt
            done += len(meta)

    def run_round(self, groups: int) -> E2EResult:
        """`groups` groups from first publish to last ack, `groups_per_call` per publish and per select."""
        self._rounds += 1
        rollouts = [make_group(f"e{self._rounds}-{i:04d}", i, 1, shape=SHAPE) for i in range(groups)]
        batches = [[r for g in rollouts[i : i + self.k] for r in g] for i in range(0, groups, self.k)]
        publisher, trainer = _Publisher(self.pub, batches), {}
        t0 = time.perf_counter()
        publisher.start()
        self._train(groups, trainer)
        seconds = time.perf_counter() - t0
        publisher.join()
        if publisher.error is not None:
            raise publisher.error
        stats = self._reset()
        put_s = sum(v[2] for k, v in stats["publisher"].items() if k.startswith("put "))
        return E2EResult(
            groups=groups,
            groups_per_call=self.k,
            seconds=seconds,
            publish_done_s=publisher.done_at - t0,
            publisher={"publish": publisher.seconds, "tq put": put_s},
            trainer=trainer,
            stores={r: stats[r] for r in ("publisher", "reassembler", "trainer")},
            commits=stats["commits"],
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
        self.pub.close()
        self._tmp.cleanup()
