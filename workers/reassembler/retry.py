"""The Kafka calls a reassembler cannot go on without, retried with backoff while they fail for a reason
that can pass (a broker down): restoring a partition, fetching committed offsets, creating a producer.

A long outage must not end the worker: its supervisor would only start it into the same outage, again
and again. Only a fatal or fenced error ends it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException

from streams.errors import ReadTimeout
from streams.producer import is_fenced
from workers.runtime import Runtime
from workers.telemetry.sensors import ReassemblerSensor

log = logging.getLogger("rlstream.reassembler")
T = TypeVar("T")
# Longest wait between retries of a Kafka call the worker cannot go on without.
MAX_RETRY_DELAY_S = 30.0
# Longest wait before a rebuild's records are taken in again when no commit landed since the last
# rebuild (a step refused again and again): a few heartbeat intervals (3 s by default), time for the
# consumer to learn of a lost membership, and short against max.poll.interval.
MAX_REBUILD_DELAY_S = 8.0


def retry_delay(attempt: int, cap: float = MAX_RETRY_DELAY_S) -> float:
    """Seconds before retry `attempt` (0-based): 1, 2, 4 ... capped at `cap`."""
    return min(cap, 2.0 ** min(attempt, 16))


def retrying(what: str, call: Callable[[], T], *, worker_id: str, sensor: ReassemblerSensor, runtime: Runtime) -> T:
    """`call()`, retried with backoff (`runtime.sleep`) while Kafka fails it for a reason that can pass."""
    for attempt in itertools.count():
        try:
            return call()
        except (KafkaException, ReadTimeout) as exc:
            error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
            if isinstance(error, KafkaError) and (error.fatal() or is_fenced(exc)):
                raise
            delay = retry_delay(attempt)
            sensor.on_retry(what)
            reason = error.str() if isinstance(error, KafkaError) else exc
            log.warning("%s: %s failed (%s); retrying in %.0fs", worker_id, what, reason, delay)
            runtime.sleep(delay)
    raise AssertionError("unreachable")
