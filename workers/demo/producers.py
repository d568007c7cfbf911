"""The demo's synthetic rollout workers: threads that stage tensors and publish receipts at a steady pace.

Producer 0 also plays the two failures the pipeline must survive: a group whose rollouts all fail
(dead-lettered as a group) and one poison receipt that is not MessagePack at all (dead-lettered
alone, without blocking its partition).

With admission on (`DemoConfig.admission`), the producers share an `AdmissionGate` that follows the
trainer's version topic: a group starts only when the gate has room, at the version the gate saw,
and each producer keeps up to `inflight_groups` started groups ahead of publishing, as a rollout
fleet generating concurrently would. With it off, each group is generated at the trainer's version
less a drawn lag (0 to 4 versions) and published at once.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import TQStore
from workers.demo.config import DemoConfig
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import make_group
from workers.topics import TopicNames

log = logging.getLogger("rlstream.demo")

# Producer 0's n-th group has only failed rollouts; a poison receipt follows its POISON_AFTER-th.
ALL_FAILED_AT = 3
POISON_AFTER = 5
# How many versions a group's generating policy lags the trainer, drawn per group: asynchronous RL.
_LAG_CHOICES = (0, 0, 0, 1, 1, 1, 2, 2, 3, 4)


class SharedState:
    """What producers and the trainer loop share: the trainer's weight version, each group's ack time, and
    the admission gate (None with admission off)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 0
        self.acked_at: dict[str, float] = {}
        self.produced: list[str] = []
        self.errors: list[str] = []
        self.gate: AdmissionGate | None = None
        self.gate_wait_s = 0.0
        self.producers_left = 0


def group_id(names: TopicNames, g: int) -> str:
    return f"{names.prefix}-g{g:05d}"


def trainer_id(names: TopicNames) -> str:
    """The demo trainer's id on the version topic (its consumer group's name)."""
    return f"trainer.{names.prefix}"


@dataclass
class _Started:
    n: int
    gid: str
    rollouts: list


class _Producer:
    """Producer `index`: groups index, index + producers, ...; started ahead up to a depth, published in order.

    With a gate, a group starts once the gate admits it, at the version the gate saw, and the producer
    keeps up to `inflight_groups` started; without one, each group starts at the trainer's version less
    a drawn lag and is published at once.
    """

    def __init__(self, kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, index: int, shared: SharedState):
        self.names, self.cfg, self.index, self.shared = names, cfg, index, shared
        self.rng = random.Random(index)
        self.todo = deque(enumerate(range(index, cfg.groups, cfg.producers)))
        self.inflight: deque[_Started] = deque()
        self.depth = cfg.inflight_groups if shared.gate is not None else 1
        store = TQStore()
        self.pub = RolloutPublisher(kafka, store, names.receipts)
        self.poison = AckedProducer(kafka) if index == 0 else None
        # NeMo Gym's capture stages each call as the group is generated; its receipts are published later.
        self.gym = None
        if cfg.nemo_gym:
            from workers.adapters.nemo_gym_capture import SyntheticGymGroups

            self.gym = SyntheticGymGroups(store)

    def _version(self) -> int | None:
        """The version to generate the next group at, None while the gate has no room (waited a little)."""
        gate = self.shared.gate
        if gate is None:
            with self.shared.lock:
                return max(0, self.shared.version - self.rng.choice(_LAG_CHOICES))
        t0 = time.monotonic()
        # Never block while there is something to publish; else wait a bit, then look at `stop` again.
        admitted = gate.acquire(1, timeout=0 if self.inflight else 0.5)
        with self.shared.lock:
            self.shared.gate_wait_s += time.monotonic() - t0
        return gate.version if admitted else None

    def _start(self, stop: threading.Event) -> None:
        while self.todo and len(self.inflight) < self.depth and not stop.is_set():
            wv = self._version()
            if wv is None:
                return
            n, g = self.todo.popleft()
            all_failed = self.index == 0 and n == ALL_FAILED_AT
            shape = replace(self.cfg.shape, failure_rate=1.0) if all_failed else self.cfg.shape
            gid = group_id(self.names, g)
            if self.gym is not None:
                rollouts = self.gym.make_group(gid, g, wv, shape=shape, seed=self.index)
            else:
                rollouts = make_group(gid, g, wv, shape=shape, seed=self.index)
            self.inflight.append(_Started(n, gid, rollouts))

    def _publish_next(self, stop: threading.Event) -> None:
        group = self.inflight.popleft()
        with self.shared.lock:
            self.shared.produced.append(group.gid)
        if self.gym is not None:
            self.pub.publish_receipts(group.rollouts)
        else:
            self.pub.publish(group.rollouts)
        with self.shared.lock:
            self.shared.acked_at[group.gid] = time.time()
        if self.shared.gate is not None:
            # Published, so accepted, even the group whose rollouts all failed: the reassembler
            # dead-letters it, and the gate, following the reassemblers, gives its capacity back.
            self.shared.gate.on_finished(accepted=True)
        stop.wait(self.cfg.producers / self.cfg.produce_rate_groups_s)
        if self.poison is not None and group.n == POISON_AFTER:
            self.poison.send([Outgoing(self.names.receipts, b"poison", os.urandom(48))])

    def run(self, stop: threading.Event) -> None:
        while (self.todo or self.inflight) and not stop.is_set():
            self._start(stop)
            if self.inflight:
                self._publish_next(stop)

    def close(self) -> None:
        self.pub.close()
        if self.poison is not None:
            self.poison.close()


def _produce(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, index: int, shared: SharedState, stop: threading.Event
) -> None:
    producer = None
    try:
        producer = _Producer(kafka, names, cfg, index, shared)
        producer.run(stop)
    except Exception as exc:  # noqa: BLE001 - surfaced in the report, the demo then fails
        log.exception("producer %d failed", index)
        with shared.lock:
            shared.errors.append(f"producer {index}: {type(exc).__name__}: {exc}")
    finally:
        if producer is not None:
            producer.close()
        with shared.lock:
            shared.producers_left -= 1
            last = shared.producers_left == 0
        if last and shared.gate is not None:
            shared.gate.close()


def start_producers(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, shared: SharedState, stop: threading.Event
) -> list[threading.Thread]:
    """`cfg.producers` daemon threads, producer i making groups i, i + producers, ... until `cfg.groups`.

    With `cfg.admission`, they share one admission gate following the trainer's version topic.
    """
    if cfg.admission:
        shared.gate = AdmissionGate(
            kafka,
            names,
            max_staleness=cfg.max_staleness,
            trainer_id=trainer_id(names),
            max_concurrent=cfg.producers * cfg.inflight_groups,
        )
    shared.producers_left = cfg.producers
    threads = [
        threading.Thread(
            target=_produce, args=(kafka, names, cfg, i, shared, stop), name=f"demo-producer-{i}", daemon=True
        )
        for i in range(cfg.producers)
    ]
    for t in threads:
        t.start()
    return threads
