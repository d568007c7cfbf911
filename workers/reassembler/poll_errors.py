"""Which errors a consumer poll delivers end a reassembler worker, and as what.

librdkafka hands its errors to the application as messages. Most pass on their own (a broker
restarting, all brokers down for a moment) and the client retries them. A fatal one arrives with
code `_FATAL` whatever its cause, and the consumer is dead after it: the worker must stop, and how
depends on the cause named in its text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException

from workers.reassembler.errors import ConsumerGroupProtocolMismatch, MemberFenced

log = logging.getLogger("rlstream.reassembler")


def check_poll_error(error: KafkaError, worker_id: str, consumer_group: str) -> None:
    """Return if `error` passes by itself (the caller may log it); raise if the worker must stop."""
    if error.code() == KafkaError.FENCED_INSTANCE_ID or (
        error.code() == KafkaError._FATAL and "group.instance.id" in error.str()
    ):
        # A newer process joined under this worker's static member id (a pool's spare promoted
        # while this one was frozen): the same verdict as a fenced producer.
        raise MemberFenced(f"{worker_id}: another process joined consumer group {consumer_group!r} as this member")
    if error.code() == KafkaError.INCONSISTENT_GROUP_PROTOCOL:
        # Not fatal to librdkafka, which would retry forever while the partitions stay with the others.
        raise ConsumerGroupProtocolMismatch(
            f"{worker_id}: consumer group {consumer_group!r} has members with another partition assignment "
            "strategy (an older rlstream uses range,roundrobin); stop them first, or set "
            "partition_assignment to one they share"
        )
    if error.code() == KafkaError._FATAL or error.fatal():
        raise KafkaException(error)


class PollWarnings:
    """The errors that pass by themselves, logged: one line per error kind a minute (a missing topic or
    a broker down repeats on every poll); the end of a partition is no error at all."""

    def __init__(self, worker_id: str, clock: Callable[[], float]):
        self._worker_id, self._clock = worker_id, clock
        self._warned: dict[int, float] = {}

    def warn(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        now = self._clock()
        if now - self._warned.get(error.code(), -1e9) >= 60:
            self._warned[error.code()] = now
            log.warning("%s: consumer error, retried by the client: %s", self._worker_id, error.str())
