"""The trainer's side of admission control: publish its weight version on the compacted version topic.

`VersionPublisher.publish(version)` sends a `TrainerVersion` keyed by the trainer id, acked, only
when the version differs from the last one it sent; rollout workers' admission gates
(`workers/rollout/gate.py`) read it. The topic is compacted, so a gate starting late reads the latest
record per trainer and nothing older that matters.
"""

from __future__ import annotations

import threading
import time

from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing


class VersionPublisher:
    """Publishes one trainer's weight version on each change (thread-safe; the first call always sends)."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, trainer_id: str, consumer_group: str, batch_groups: int):
        self._producer = AckedProducer(kafka)
        self._topic = topic
        self._trainer_id = trainer_id
        self._consumer_group = consumer_group
        self._batch_groups = batch_groups
        self._lock = threading.Lock()
        self._last: int | None = None

    @property
    def last_published(self) -> int | None:
        """The version last acknowledged by the broker, None before the first."""
        return self._last

    def publish(self, version: int, *, timeout_s: float = 30.0) -> bool:
        """Send `version` unless it is the one last sent; True when a record was sent (and acked)."""
        with self._lock:
            if version == self._last:
                return False
            msg = TrainerVersion(
                trainer_id=self._trainer_id,
                consumer_group=self._consumer_group,
                version=version,
                batch_groups=self._batch_groups,
                time_ms=int(time.time() * 1000),
            )
            self._producer.send(
                [Outgoing(self._topic, self._trainer_id.encode(), msg.to_bytes())],
                timeout_s=timeout_s,
            )
            self._last = version
            return True

    def close(self) -> None:
        self._producer.close()
