"""The demo's synthetic rollout workers: threads that stage tensors and publish receipts at a steady pace.

Producer 0 also plays the two failures the pipeline must survive: a group whose rollouts all fail
(dead-lettered as a group) and one poison receipt that is not MessagePack at all (dead-lettered
alone, without blocking its partition).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import replace

from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import TQStore
from workers.demo.config import DemoConfig
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
    """What producers and the trainer loop share: the trainer's weight version and each group's ack time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = 0
        self.acked_at: dict[str, float] = {}
        self.produced: list[str] = []
        self.errors: list[str] = []


def group_id(names: TopicNames, g: int) -> str:
    return f"{names.prefix}-g{g:05d}"


def _produce(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, index: int, shared: SharedState, stop: threading.Event
) -> None:
    rng = random.Random(index)
    pub = RolloutPublisher(kafka, TQStore(), names.receipts)
    poison = AckedProducer(kafka) if index == 0 else None
    try:
        for n, g in enumerate(range(index, cfg.groups, cfg.producers)):
            if stop.is_set():
                return
            gid = group_id(names, g)
            with shared.lock:
                wv = max(0, shared.version - rng.choice(_LAG_CHOICES))
            all_failed = index == 0 and n == ALL_FAILED_AT
            shape = replace(cfg.shape, failure_rate=1.0) if all_failed else cfg.shape
            rollouts = make_group(gid, g, wv, shape=shape, seed=index)
            with shared.lock:
                shared.produced.append(gid)
            pub.publish(rollouts)
            with shared.lock:
                shared.acked_at[gid] = time.time()
            stop.wait(cfg.producers / cfg.produce_rate_groups_s)
            if poison is not None and n == POISON_AFTER:
                poison.send([Outgoing(names.receipts, b"poison", os.urandom(48))])
    except Exception as exc:  # noqa: BLE001 - surfaced in the report, the demo then fails
        log.exception("producer %d failed", index)
        with shared.lock:
            shared.errors.append(f"producer {index}: {type(exc).__name__}: {exc}")
    finally:
        pub.close()
        if poison is not None:
            poison.close()


def start_producers(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, shared: SharedState, stop: threading.Event
) -> list[threading.Thread]:
    """`cfg.producers` daemon threads, producer i making groups i, i + producers, ... until `cfg.groups`."""
    threads = [
        threading.Thread(
            target=_produce, args=(kafka, names, cfg, i, shared, stop), name=f"demo-producer-{i}", daemon=True
        )
        for i in range(cfg.producers)
    ]
    for t in threads:
        t.start()
    return threads
