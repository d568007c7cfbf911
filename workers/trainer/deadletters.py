"""The trainer's dead letters: finalized records it cannot use, kept on `trainer.deadletter` with the reason.

Two kinds, apart from the reassembler's (`schemas.deadletter.ERROR_KINDS`, which redrive re-publishes
to the receipts): `undecodable_finalized` (garbage bytes, another major schema version, a tombstone)
and `missing_rows` (a group never consumed whose rows are gone from TQ). Letters are `DeadLetter`s
bounded the same way: the original whole up to `MAX_ORIGINAL_BYTES`, else a prefix with its size and
SHA-256; keys and messages cut to their limits.

A record is resolved, and so its offset committed past, only once its letter is acknowledged. Letters
are sent without blocking the trainer: each poll queues new ones and serves delivery reports; one the
broker does not take within `DELIVERY_TIMEOUT_MS` (the topic is missing, say) is logged and sent
again, while the records behind it keep flowing. A trainer that dies between the acknowledgement and
the commit sends the letter again: letters are at least once (a reader dedupes by source position).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Producer

from schemas.deadletter import DeadLetter, bounded_key, bounded_message, bounded_original
from streams.config import KafkaConfig

UNDECODABLE_FINALIZED = "undecodable_finalized"
MISSING_ROWS = "missing_rows"
TRAINER_ERROR_KINDS = frozenset({UNDECODABLE_FINALIZED, MISSING_ROWS})

# How long the broker has to acknowledge a letter before it is logged and sent again.
DELIVERY_TIMEOUT_MS = 30_000

log = logging.getLogger("rlstream.trainer")


def make_letter(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    kind: str,
    message: str,
    *,
    worker_id: str,
) -> DeadLetter:
    """The dead letter of the record at topic[partition]@offset, bounded to fit one Kafka message."""
    return DeadLetter(
        source_topic=topic,
        source_partition=partition,
        source_offset=offset,
        source_key=bounded_key(key),
        error_kind=kind,
        message=bounded_message(message),
        worker_id=worker_id,
        time_ms=int(time.time() * 1000),
        **bounded_original(value or b""),  # type: ignore[arg-type]
    )


class Outbox:
    """Letters waiting for acknowledgement, by source partition and offset; `flush` sends and collects them."""

    def __init__(self, kafka: KafkaConfig, topic: str, worker_id: str):
        self.topic = topic
        self.worker_id = worker_id
        self._kafka = kafka
        self._producer: Producer | None = None
        self._waiting: dict[int, dict[int, DeadLetter]] = {}
        self._in_flight: set[tuple[int, int]] = set()
        self._acked: list[tuple[int, int]] = []

    def add(self, partition: int, offset: int, letter: DeadLetter) -> None:
        self._waiting.setdefault(partition, {})[offset] = letter

    def offsets(self, partition: int) -> list[int]:
        return list(self._waiting.get(partition, ()))

    def drop(self, partition: int) -> list[DeadLetter]:
        """The partition was revoked: its records are read again by its next owner, letters and all.
        Returns the letters dropped."""
        return list(self._waiting.pop(partition, {}).values())

    def flush(self, timeout_s: float = 0.0) -> list[tuple[int, int]]:
        """Send the letters not in flight, serve delivery reports (waiting up to timeout_s for all);
        returns the (partition, offset) of the records whose letters were acknowledged."""
        if not self._waiting and not self._in_flight:
            return []
        if self._producer is None:
            self._producer = Producer(self._kafka.producer(**{"message.timeout.ms": DELIVERY_TIMEOUT_MS}))
        for part, by_offset in self._waiting.items():
            for offset, letter in by_offset.items():
                if (part, offset) not in self._in_flight:
                    self._send(part, offset, letter)
        if timeout_s > 0:
            self._producer.flush(timeout_s)
        else:
            self._producer.poll(0)
        acked, self._acked = self._acked, []
        return acked

    def _send(self, part: int, offset: int, letter: DeadLetter) -> None:
        def report(err, _msg) -> None:
            self._in_flight.discard((part, offset))
            if self._waiting.get(part, {}).get(offset) is not letter:
                return  # its partition was revoked meanwhile
            if err is not None:
                log.error(
                    "trainer dead letter of %s[%d]@%d not acknowledged by %s, sending again: %s",
                    letter.source_topic,
                    part,
                    offset,
                    self.topic,
                    err.str(),
                )
                return
            del self._waiting[part][offset]
            self._acked.append((part, offset))

        try:
            self._producer.produce(self.topic, key=letter.source_key, value=letter.to_bytes(), on_delivery=report)
        except BufferError:
            return  # the local queue is full: sent by a later flush
        self._in_flight.add((part, offset))

    def close(self, timeout_s: float = 5.0) -> None:
        if self._producer is not None:
            self._producer.flush(timeout_s)
