"""Thin producers over confluent-kafka: an idempotent one that waits for acks, and a transactional one.

Retry and error routing policy lives with the callers; these classes only make the delivery
outcome explicit (an exception, never a silently dropped message). Each builds its confluent-kafka
`Producer` through the `KafkaApi` it is given (`streams.kafka_api`: confluent-kafka itself by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from streams.config import KafkaConfig
from streams.errors import DeliveryError
from streams.kafka_api import REAL_KAFKA, KafkaApi

Headers = Sequence[tuple[str, bytes]]


@dataclass(frozen=True)
class Outgoing:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    partition: int | None = None
    timestamp_ms: int | None = None


def _produce(producer: Producer, rec: Outgoing, on_delivery=None) -> None:
    kwargs: dict[str, object] = {"key": rec.key, "value": rec.value}
    if rec.headers:
        kwargs["headers"] = list(rec.headers)
    if rec.partition is not None:
        kwargs["partition"] = rec.partition
    if rec.timestamp_ms is not None:
        kwargs["timestamp"] = rec.timestamp_ms
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(rec.topic, **kwargs)
            return
        except BufferError:
            # Local queue full: serve delivery reports to make room instead of failing.
            producer.poll(0.05)


class AckedProducer:
    """Idempotent producer whose `send` returns only once the broker has acknowledged every record."""

    def __init__(self, kafka: KafkaConfig, *, api: KafkaApi = REAL_KAFKA, **overrides: object):
        self._producer = api.Producer(kafka.producer(**overrides))

    def send(self, records: Sequence[Outgoing], *, timeout_s: float = 30.0) -> list[tuple[int, int]]:
        """Produce records and wait for their acks; returns (partition, offset) per record."""
        results: list[tuple[int, int] | None] = [None] * len(records)
        errors: list[str] = []

        def report(i: int, rec: Outgoing):
            def cb(err, msg):
                if err is not None:
                    errors.append(f"{rec.topic} key={rec.key!r}: {err.str()}")
                else:
                    results[i] = (msg.partition(), msg.offset())

            return cb

        for i, rec in enumerate(records):
            _produce(self._producer, rec, report(i, rec))
        remaining = self._producer.flush(timeout_s)
        if errors:
            raise DeliveryError("not acknowledged: " + "; ".join(errors[:5]))
        if remaining or any(r is None for r in results):
            raise DeliveryError(f"{remaining} record(s) not acknowledged within {timeout_s:.0f}s")
        return [r for r in results if r is not None]

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.flush(timeout_s)


class TransactionalProducer:
    """A transactional producer: records and consumer offsets become visible together or not at all."""

    def __init__(
        self,
        kafka: KafkaConfig,
        transactional_id: str,
        *,
        transaction_timeout_ms: int = 30000,
        init_timeout_s: float = 60.0,
        api: KafkaApi = REAL_KAFKA,
        **overrides: object,
    ):
        conf = kafka.producer(
            transactional_id=transactional_id, **{"transaction.timeout.ms": transaction_timeout_ms, **overrides}
        )
        self.transactional_id = transactional_id
        self._producer = api.Producer(conf)
        # Fences any earlier producer with the same id and aborts its open transaction.
        self._producer.init_transactions(init_timeout_s)
        self._in_txn = False

    @property
    def in_transaction(self) -> bool:
        return self._in_txn

    def begin(self) -> None:
        self._producer.begin_transaction()
        self._in_txn = True

    def produce(self, rec: Outgoing, on_delivery: Callable[[KafkaError | None, object], None] | None = None) -> None:
        """Queue a record in the open transaction; `on_delivery(err, msg)` runs once the broker answered."""
        _produce(self._producer, rec, on_delivery)

    def send_offsets(self, offsets: Sequence[TopicPartition], group_metadata, *, timeout_s: float = 30.0) -> None:
        """Add consumer offsets (the next offset to read, per partition) to the open transaction."""
        self._producer.send_offsets_to_transaction(list(offsets), group_metadata, timeout_s)

    def commit(self, *, timeout_s: float = 60.0) -> None:
        self._producer.commit_transaction(timeout_s)
        self._in_txn = False

    def abort(self, *, timeout_s: float = 60.0) -> None:
        self._producer.abort_transaction(timeout_s)
        self._in_txn = False

    @contextmanager
    def transaction(self) -> Iterator[TransactionalProducer]:
        """Begin; commit when the block ends, abort (best effort) and re-raise when it raises."""
        self.begin()
        try:
            yield self
            self.commit()
        except BaseException:
            try:
                self.abort()
            except KafkaException:
                pass
            raise
        finally:
            self.flush(5)

    def poll(self, timeout_s: float = 0.0) -> None:
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> int:
        return self._producer.flush(timeout_s)


def is_fatal(exc: KafkaException) -> bool:
    """True for errors after which the producer must be discarded (e.g. fenced by a newer instance)."""
    err: KafkaError = exc.args[0]
    return bool(err.fatal()) or is_fenced(exc) or err.code() == KafkaError.INVALID_PRODUCER_EPOCH


def is_fenced(exc: KafkaException) -> bool:
    """True when a newer producer with the same transactional id has taken over."""
    return exc.args[0].code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED)


def requires_abort(exc: KafkaException) -> bool:
    return bool(exc.args[0].txn_requires_abort())
