"""Consumer-side helpers: reading a topic slice to its end, and committed versus end offsets.

Each helper builds its confluent-kafka `Consumer` through the `KafkaApi` it is given and waits (idle
timeouts, retries) on the `Runtime` it is given; the defaults are confluent-kafka and the process's
own clock, so a caller that passes neither gets the real thing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from streams.config import KafkaConfig
from streams.errors import ReadTimeout
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime


@dataclass(frozen=True)
class Record:
    """A consumed record detached from the client, so callers never hold librdkafka objects."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @staticmethod
    def of(msg) -> Record:
        return Record(
            msg.topic(),
            msg.partition(),
            msg.offset(),
            msg.key(),
            msg.value(),
            tuple(msg.headers() or ()),
            msg.timestamp()[1],
        )


def _throwaway_consumer_group() -> str:
    return f"rlstream-reader-{uuid.uuid4().hex[:12]}"


def partitions_of(consumer: Consumer, topic: str, timeout_s: float = 10.0) -> list[int]:
    md = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if md is None or md.error is not None:
        raise KafkaException(md.error if md is not None else f"topic {topic} not found")
    return sorted(md.partitions)


def end_offsets(
    kafka: KafkaConfig, topic: str, *, read_committed: bool = True, timeout_s: float = 10.0, api: KafkaApi = REAL_KAFKA
) -> dict[int, tuple[int, int]]:
    """partition -> (low, high) watermark; with read_committed, high is the last stable offset."""
    c = api.Consumer(kafka.consumer(_throwaway_consumer_group(), read_committed=read_committed))
    try:
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s, cached=False)
            for p in partitions_of(c, topic, timeout_s)
        }
    finally:
        c.close()


def committed_offsets(
    kafka: KafkaConfig, group_id: str, topic: str, *, timeout_s: float = 10.0, api: KafkaApi = REAL_KAFKA
) -> dict[int, int]:
    """partition -> committed offset of the group (-1001 when it has none)."""
    c = api.Consumer(kafka.consumer(group_id))
    try:
        tps = [TopicPartition(topic, p) for p in partitions_of(c, topic, timeout_s)]
        return {tp.partition: tp.offset for tp in c.committed(tps, timeout=timeout_s)}
    finally:
        c.close()


def _watermarks(c: Consumer, topic: str, partition: int, timeout_s: float, runtime: Runtime) -> tuple[int, int]:
    """A partition's (low, high) offsets; a leader that just died is retried until `timeout_s`."""
    deadline = runtime.monotonic() + timeout_s
    while True:
        try:
            return c.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
        except KafkaException as exc:
            # Leadership moves within seconds when a broker dies; only a fatal error is final.
            if exc.args[0].fatal() or runtime.monotonic() > deadline:
                raise
            runtime.sleep(0.2)


def read_topic(
    kafka: KafkaConfig,
    topic: str,
    *,
    read_committed: bool = True,
    start: dict[int, int] | None = None,
    stop: dict[int, int] | None = None,
    partitions: Sequence[int] | None = None,
    idle_timeout_s: float = 10.0,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> Iterator[Record]:
    """Yield a topic's records from `start` (default: beginning) up to `stop` (default: current end).

    Uses manual assignment and no group, so it never disturbs production consumer groups.
    """
    c = api.Consumer(kafka.consumer(_throwaway_consumer_group(), read_committed=read_committed))
    try:
        parts = list(partitions) if partitions is not None else partitions_of(c, topic)
        ends = {p: _watermarks(c, topic, p, idle_timeout_s, runtime) for p in parts}
        # A stop beyond the end would never be reached: clamp it to the end.
        stop_at = {p: min((stop or {}).get(p, ends[p][1]), ends[p][1]) for p in parts}
        begin = {p: (start or {}).get(p, OFFSET_BEGINNING) for p in parts}
        pending = {p for p in parts if stop_at[p] > max(ends[p][0], begin[p] if begin[p] >= 0 else 0)}
        if not pending:
            return
        c.assign([TopicPartition(topic, p, begin[p]) for p in sorted(pending)])
        last_progress = runtime.monotonic()
        while pending:
            got = c.consume(500, timeout=0.5)
            # A broker restarting arrives as error messages the client retries itself; they are not
            # progress, so a lasting outage still ends in the idle timeout.
            for m in got:
                if m.error() is not None and m.error().fatal():
                    raise KafkaException(m.error())
            msgs = [m for m in got if m.error() is None]
            if not msgs:
                # Aborted transaction markers and control records occupy offsets we never see;
                # the position tells us when a partition has reached its stop offset.
                for tp in c.position([TopicPartition(topic, p) for p in list(pending)]):
                    if tp.offset >= stop_at[tp.partition]:
                        pending.discard(tp.partition)
                if runtime.monotonic() - last_progress > idle_timeout_s:
                    raise ReadTimeout(
                        f"reading {topic}: no progress for {idle_timeout_s:.0f}s, "
                        f"partitions {sorted(pending)} short of their end"
                    )
                continue
            last_progress = runtime.monotonic()
            for m in msgs:
                p = m.partition()
                if p not in pending:
                    continue
                if m.offset() >= stop_at[p]:
                    pending.discard(p)
                    continue
                yield Record.of(m)
                if m.offset() + 1 >= stop_at[p]:
                    pending.discard(p)
    finally:
        c.close()


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    what: str = "condition",
    runtime: Runtime = REAL_RUNTIME,
) -> None:
    deadline = runtime.monotonic() + timeout_s
    while not predicate():
        if runtime.monotonic() > deadline:
            raise ReadTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        runtime.sleep(interval_s)
