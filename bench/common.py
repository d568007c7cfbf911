"""What several benchmarks share: the dense synthetic shape, a percentile, and a reader of when finalized
records become visible."""

from __future__ import annotations

import threading
import time
import uuid

from confluent_kafka import Consumer

from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from workers.rollout.synthetic import SyntheticShape

# 256 prompt tokens + 4 answers of 412 + 3 observations of 48 = 2048 tokens per rollout.
SHAPE = SyntheticShape(
    group_size=8, calls=(4, 4), prompt_len=(256, 256), answer_len=(412, 412), observation_len=(48, 48)
)


def wake_on_arrival(consumer: Consumer, most: int, timeout_s: float) -> list:
    """Up to `most` records, returning as soon as the first has arrived (or `timeout_s` passed).

    librdkafka's consume(n, t) returns only once it has n records or t has passed: asked for a
    batch, a reader timing arrivals would add up to its whole timeout to each (issue 33).
    """
    msgs = consumer.consume(1, timeout_s)
    if msgs and most > 1:
        msgs += consumer.consume(most - 1, 0)
    return msgs


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


class Arrivals(threading.Thread):
    """Records when each finalized record becomes visible to a read_committed consumer."""

    def __init__(self, kafka: KafkaConfig, topic: str):
        super().__init__(daemon=True)
        self.seen: dict[str, float] = {}
        self.metrics: dict[str, dict[str, float]] = {}  # the reassembler's own timings per group
        self.stop = threading.Event()
        self._consumer = Consumer(kafka.consumer(f"bench-{uuid.uuid4().hex[:8]}"))
        self._consumer.subscribe([topic])

    def run(self) -> None:
        while not self.stop.is_set():
            for m in wake_on_arrival(self._consumer, 500, 0.05):
                if m.error() is None:
                    group = FinalizedGroup.from_bytes(m.value())
                    self.seen.setdefault(group.group_id, time.time())
                    self.metrics.setdefault(group.group_id, group.metrics)
        self._consumer.close()
