"""The trainer's side of admission control: publish its weight version and its losses on the compacted version topic.

`VersionPublisher.publish(version, lost_groups=...)` sends a `TrainerVersion` keyed by the trainer id,
acked, only when the version or the loss count differs from what it sent last; rollout workers'
admission gates (`workers/rollout/gate.py`) read it. The topic is compacted, so a gate starting late
reads the latest record per trainer and nothing older that matters.

`lost_groups` is the trainer's running count of groups it will never train (`ConsumerCounts.lost`:
evicted as too stale, dropped for missing rows): a gate gives their capacity back. What is sent
never goes down (see `publish`), so a loop that publishes every round cannot fail on a rebalance,
nor on a broker that does not acknowledge in time: that record is a WARNING and is sent again by
the next call (the gates see the version late, the trainer goes on).
A trainer that cannot fill a batch still calls `publish` with its count, or its losses would never
reach the gates and its version would never move. Each publisher is one `run`: a gate takes the count of a new run
as starting from 0, so a restarted trainer's losses are never lost. Those its predecessor decided
in its last moments, before a commit named their records, are decided and counted again: a few groups
over-admitted for good, never fewer admitted (docs/DESIGN.md, "Admission control").
"""

from __future__ import annotations

import logging
import threading
import uuid

from schemas.errors import InvalidArgument
from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from streams.errors import DeliveryError
from streams.producer import Outgoing
from streams.runtime import REAL_RUNTIME, Runtime
from workers.trainer.clients import KafkaTrainerClients, TrainerClients

log = logging.getLogger("rlstream.trainer")


class VersionPublisher:
    """Publishes one trainer's version and loss count on each change (thread-safe; the first call always sends)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topic: str,
        *,
        trainer_id: str,
        consumer_group: str,
        batch_groups: int,
        clients: TrainerClients | None = None,
        runtime: Runtime = REAL_RUNTIME,
    ):
        # `clients`: where its acked producer comes from (a test's or the explorer's; else the real ones of
        # `kafka`); `runtime`: the wall clock its records carry.
        self._producer = (clients if clients is not None else KafkaTrainerClients(kafka)).acked_producer()
        self._runtime = runtime
        self._topic = topic
        self._trainer_id = trainer_id
        self._consumer_group = consumer_group
        self._batch_groups = batch_groups
        self._run = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._last: tuple[int, int] | None = None

    @property
    def last_published(self) -> int | None:
        """The version last acknowledged by the broker, None before the first."""
        return None if self._last is None else self._last[0]

    def publish(self, version: int, *, lost_groups: int = 0, timeout_s: float = 30.0) -> bool:
        """Send `version` and `lost_groups` unless both are what was sent last; True when a record was sent (acked).

        A record not acknowledged within `timeout_s` (the broker down or slow) is not an error of the
        trainer's: False, a WARNING, and the next call sends it again. (Its producer may still deliver
        it later, in order, which a gate reads as the same version.)

        The count sent never goes down: a lower `lost_groups` than one already sent is sent as that
        one. The consumer's count does go down when a revoked partition takes an unacknowledged
        missing-rows letter with it (`ConsumerCounts.lost`), because that record is read and
        counted again: here, it brings the count back to what was sent, not past it; elsewhere
        (another trainer of the group), this count stays one ahead until this trainer's next
        loss, which it absorbs.
        """
        if lost_groups < 0:
            raise InvalidArgument(f"lost_groups must be >= 0, got {lost_groups}")
        with self._lock:
            if self._last is not None:
                lost_groups = max(lost_groups, self._last[1])
            if (version, lost_groups) == self._last:
                return False
            msg = TrainerVersion(
                trainer_id=self._trainer_id,
                consumer_group=self._consumer_group,
                version=version,
                batch_groups=self._batch_groups,
                time_ms=self._runtime.wall_ms(),
                lost_groups=lost_groups,
                run=self._run,
            )
            try:
                self._producer.send(
                    [Outgoing(self._topic, self._trainer_id.encode(), msg.to_bytes())],
                    timeout_s=timeout_s,
                )
            except DeliveryError as exc:
                log.warning(
                    "trainer %s: version %d (%d group(s) lost) not published on %s (%s); sent again with the next"
                    " publish",
                    self._trainer_id,
                    version,
                    lost_groups,
                    self._topic,
                    exc,
                )
                return False
            self._last = (version, lost_groups)
            return True

    def close(self) -> None:
        self._producer.close()
