"""What the trainer's consumer does with an error its poll returns: wait it out, or raise a fatal one.

librdkafka recovers from consumer errors by itself; they are reported so an operator sees them. Two
are expected: a subscribed topic not created yet (it is assigned once it exists) and a trainer step
longer than max.poll.interval.ms (the consumer left its group; the next poll rejoins it, and the
consumer's bookkeeping keeps groups from being lost or yielded twice).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, KafkaException

from schemas.errors import RlstreamError

log = logging.getLogger("rlstream.trainer")

_NO_TOPIC = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION)
# An error repeated within this long is not logged again.
LOG_EVERY_S = 30.0


class PollErrors:
    """Logs the consumer errors of one trainer consumer, each kind at most once per LOG_EVERY_S."""

    def __init__(self, topic: str, consumer_group: str, max_poll_interval_ms: int):
        self.topic = topic
        self.consumer_group = consumer_group
        self.max_poll_interval_ms = max_poll_interval_ms
        self._logged: dict[int, float] = {}

    def handle(self, err: KafkaError) -> None:
        """Log `err` (or nothing for a partition end); raise KafkaException only for a fatal error."""
        code = err.code()
        if code == KafkaError._PARTITION_EOF:
            return
        if err.fatal():
            raise KafkaException(err)
        if code == KafkaError._MAX_POLL_EXCEEDED:
            log.warning(
                "trainer step longer than max.poll.interval.ms (%d ms): consumer group %r left and rejoined on %s; "
                "held groups are read again, yielded ones are not yielded twice (%s)",
                self.max_poll_interval_ms,
                self.consumer_group,
                self.topic,
                err.str(),
            )
        elif code in _NO_TOPIC:
            self._once(code, logging.WARNING, f"finalized topic {self.topic} does not exist yet; waiting ({err.str()})")
        else:
            self._once(code, logging.ERROR, f"consumer error on {self.topic}, retrying: {err.str()}")

    def _once(self, code: int, level: int, message: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(code, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[code] = now
            log.log(level, message)


class IllegalTransition(RuntimeError):
    """A pending record asked to move where it may not (`pending.py`'s `_MOVES`): a bug in the consumer,
    never an expected failure, so no `RlstreamError`."""


class CommitUnreadable(RlstreamError):
    """A trainer's commit names resolved records that cannot be read back (its progress entry is missing)."""


class SpillError(RlstreamError):
    """A checkpoint's spill of TQ rows that cannot be used: missing, cut short, undecodable, or another checkpoint's."""


class OpenTransaction(RlstreamError):
    """A transaction stayed open on a topic `resume` must read, past its wait (`open_transactions.py`)."""


class OldJobAlive(RlstreamError):
    """A consumer group of the job `resume` restarts still has members past the wait: it is not dead."""
