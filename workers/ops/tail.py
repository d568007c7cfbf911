"""`rlstream tail`: follow a topic and print each record decoded, without joining any consumer group."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from streams.config import KafkaConfig
from streams.consumer import Record, partitions_of
from workers.ops.records import describe_record, matches_group
from workers.topics import topic_role


def tail(
    kafka: KafkaConfig,
    topic: str,
    emit: Callable[[dict[str, Any]], None],
    *,
    from_beginning: bool = False,
    group_id: str | None = None,
    max_records: int | None = None,
    idle_exit_s: float | None = None,
    stop: threading.Event | None = None,
    read_committed: bool = True,
) -> int:
    """Decode the topic's records (by its role) and `emit` each, following new ones.

    Returns after `max_records` emitted, after `idle_exit_s` without any new record, or when `stop`
    is set; returns how many were emitted. `group_id` keeps only that prompt group's records.
    """
    role = topic_role(topic)
    c = Consumer(kafka.consumer(f"rlstream-tail-{uuid.uuid4().hex[:12]}", read_committed=read_committed))
    emitted = 0
    try:
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        c.assign([TopicPartition(topic, p, start) for p in partitions_of(c, topic)])
        last = time.monotonic()
        while not (stop is not None and stop.is_set()):
            msgs = c.consume(200, timeout=0.2)
            if not msgs:
                if idle_exit_s is not None and time.monotonic() - last >= idle_exit_s:
                    break
                continue
            last = time.monotonic()
            for m in msgs:
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(m.error())
                desc = describe_record(Record.of(m), role)
                if not matches_group(desc, group_id):
                    continue
                emit(desc)
                emitted += 1
                if max_records is not None and emitted >= max_records:
                    return emitted
    finally:
        c.close()
    return emitted
