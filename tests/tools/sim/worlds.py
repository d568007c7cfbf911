"""Where a scenario runs: on the real broker and TQ, or on the models, behind one small interface.

A scenario (tests/tools/sim/scenarios/) is written once against a `KafkaWorld` or `TQWorld` and run
on both; the differential tests compare what it observed. The worlds differ only in what they must:
real time against the environment's clock, real topics against the model's.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

import confluent_kafka
import confluent_kafka.admin

from streams.admin import TopicSpec, create_topics
from streams.config import KafkaConfig
from tests.tools.sim.env import ManualEnv
from tests.tools.sim.kafka import ClusterConfig, KafkaCluster, SimKafka
from tests.tools.sim.tq import SimTQ, TQModule


class KafkaWorld:
    """What a Kafka scenario needs: the client classes, topics, configs, and time."""

    ck: Any
    real: bool

    def topic(self, partitions: int = 1, **config: str) -> str:
        raise NotImplementedError

    def producer(self, **overrides: Any) -> Any:
        conf = {"enable.idempotence": True, "acks": "all", "linger.ms": 5, "partitioner": "murmur2_random"}
        conf.update(overrides)
        return self.ck.Producer(self._conf(conf))

    def txn_producer(self, transactional_id: str, **overrides: Any) -> Any:
        return self.producer(**{"transactional.id": transactional_id, **overrides})

    def consumer(self, group: str | None = None, *, read_committed: bool = True, **overrides: Any) -> Any:
        conf = {
            "group.id": group or self.name("g"),
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
        }
        conf.update(overrides)
        return self.ck.Consumer(self._conf(conf))

    def admin(self) -> Any:
        return self.ck.AdminClient(self._conf({}))

    def name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:8]}"

    def _conf(self, conf: dict[str, Any]) -> dict[str, Any]:
        return conf

    def now(self) -> float:
        raise NotImplementedError

    def wall(self) -> float:
        """Seconds since the epoch, as record timestamps count them."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until `predicate()` holds; AssertionError naming `what` after `timeout_s`."""
        raise NotImplementedError

    def clean(self, topic: str) -> None:
        """The broker's log cleaner and retention have their turn at `topic` (the real one's run by themselves)."""

    def down(self) -> None:
        raise NotImplementedError("this world cannot stop its broker")

    def up(self) -> None:
        raise NotImplementedError("this world cannot start its broker")


class RealKafka(KafkaWorld):
    """The real broker; `down`/`up` stop and start it when the world was given a way to."""

    real = True

    def __init__(self, kafka: KafkaConfig, *, stop: Callable[[], None] | None = None, start=None):
        self.kafka = kafka
        self.ck = confluent_kafka
        self._stop, self._start = stop, start

    def admin(self) -> Any:
        return confluent_kafka.admin.AdminClient(self._conf({}))

    def down(self) -> None:
        if self._stop is None:
            super().down()
        self._stop()

    def up(self) -> None:
        if self._start is None:
            super().up()
        self._start()

    def _conf(self, conf: dict[str, Any]) -> dict[str, Any]:
        return {"bootstrap.servers": self.kafka.bootstrap_servers, **self.kafka.client_settings, **conf}

    def topic(self, partitions: int = 1, **config: str) -> str:
        name = self.name("sim")
        create_topics(self.kafka, [TopicSpec(name, partitions, dict(config))])
        return name

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
            time.sleep(0.05)


class ModelKafka(KafkaWorld):
    real = False

    def __init__(self, *, seed: int = 0, config: ClusterConfig | None = None, process: str = "main"):
        self.env = ManualEnv(seed=seed)
        self.cluster = KafkaCluster(self.env, config or ClusterConfig())
        self.ck = SimKafka(self.cluster, process)
        self._names = itertools.count()

    def name(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names):04d}"  # the same in every replay

    def topic(self, partitions: int = 1, **config: str) -> str:
        name = self.name("sim")
        self.cluster.create_topic(name, partitions, dict(config))
        return name

    def now(self) -> float:
        return self.env.now()

    def wall(self) -> float:
        return self.env.now()

    def sleep(self, seconds: float) -> None:
        self.env.advance(seconds)

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = self.env.now() + timeout_s
        while not predicate():
            if self.env.now() >= deadline:
                raise AssertionError(f"timed out after {timeout_s:g}s (model time) waiting for {what}")
            self.env.advance(0.05)

    def clean(self, topic: str) -> None:
        if self.cluster.topics[topic].compacted:
            self.cluster.compact(topic)
        else:
            self.cluster.expire(topic)

    def down(self) -> None:
        self.cluster.down()

    def up(self) -> None:
        self.cluster.up()


class TQWorld:
    """What a TQ scenario needs: a `transfer_queue` module (real or model) and where indexes start."""

    tq: Any
    real: bool
    # The first index the scenario's allocations get (the counter after draining the pool, for the real TQ).
    base: int = 0

    def run(self, coro) -> Any:
        return self.tq.get_client()._run_coroutine(coro)


class RealTQ(TQWorld):
    """The session's TQ. `drain` empties its pool of released indexes, so allocations come from its
    counter, as a fresh model's do from `base`."""

    real = True
    DRAIN_BATCH = 1024

    def __init__(self):
        import transfer_queue

        self.tq = transfer_queue
        self._scratch: list[tuple[str, list[str]]] = []

    def drain(self) -> int:
        """Take every released index (tags-only puts to a scratch partition) until a batch comes from
        the counter alone: consecutive, above all taken. Sets and returns `base`, the counter then."""
        partition = f"sim.drain.{uuid.uuid4().hex[:8]}"
        highest = -1
        for n in itertools.count():
            keys = [f"d{n}.{i}" for i in range(self.DRAIN_BATCH)]
            self.run(self.tq.async_kv_batch_put(keys=keys, partition_id=partition, tags=[{} for _ in keys]))
            self._scratch.append((partition, keys))
            got = self.run(
                self.tq.get_client().async_kv_retrieve_meta(keys=keys, partition_id=partition)
            ).global_indexes
            if got == list(range(got[0], got[0] + len(got))) and got[0] > highest:
                self.base = got[-1] + 1
                return self.base
            highest = max(highest, *got)
        raise AssertionError("unreachable")

    def cleanup(self) -> None:
        """Give the scratch keys' indexes back."""
        for partition, keys in self._scratch:
            self.run(self.tq.async_kv_clear(keys=keys, partition_id=partition))
        self._scratch = []


class ModelTQ(TQWorld):
    real = False

    def __init__(self, *, seed: int = 0, first_index: int = 0, units: int = 1):
        self.env = ManualEnv(seed=seed)
        self.sim = SimTQ(self.env, units=units, first_index=first_index)
        self.tq: TQModule = self.sim.module("scenario")
        self.base = first_index
