"""Debugging tools over the pipeline's topics and TQ: decode records, tail a topic, inspect one group, lag.

Every reader here uses manual assignment or throwaway consumer groups: looking never moves a
production consumer group's offsets.
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from schemas.deadletter import DeadLetter
from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from schemas.receipt import Receipt
from streams.config import KafkaConfig
from streams.consumer import Record, committed_offsets, end_offsets, partitions_of, read_topic
from streams.tq import STAGING, TRAIN, KVStore
from workers.topics import TopicNames, decode_value, message_group_id, topic_role


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(data).decode()


def describe_record(rec: Record, role: str | None = None) -> dict[str, Any]:
    """A JSON-able view of one record: position, key, headers and the decoded message (or why not).

    A dead letter shows `error_kind` and `message` at the top level and its original receipt decoded
    when it decodes (else the original's size); `role` None sniffs the message kind (replay topics).
    """
    out: dict[str, Any] = {
        "topic": rec.topic,
        "partition": rec.partition,
        "offset": rec.offset,
        "timestamp_ms": rec.timestamp_ms,
        "key": _text(rec.key),
        "headers": {k: _text(v) for k, v in rec.headers},
    }
    try:
        msg = decode_value(rec.value, role)
    except SchemaError as exc:
        out.update(kind=None, decode_error=str(exc), value_bytes=len(rec.value or b""))
        return out
    out["kind"] = msg.kind()
    value = msg.to_dict()
    if isinstance(msg, DeadLetter):
        value.pop("original")
        value["source_key"] = _text(msg.source_key)
        out.update(error_kind=msg.error_kind, message=msg.message, redrive_count=msg.redrive_count)
        try:
            value["original_receipt"] = Receipt.from_bytes(msg.original).to_dict()
        except SchemaError:
            value["original_bytes"] = len(msg.original)
    out["value"] = value
    out["group_id"] = message_group_id(msg)
    return out


def _matches_group(desc: dict[str, Any], group_id: str | None) -> bool:
    return (
        group_id is None
        or desc.get("group_id") == group_id
        or (desc.get("group_id") is None and desc.get("key") == group_id)
    )


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
                if not _matches_group(desc, group_id):
                    continue
                emit(desc)
                emitted += 1
                if max_records is not None and emitted >= max_records:
                    return emitted
    finally:
        c.close()
    return emitted


def inspect_group(
    kafka: KafkaConfig,
    names: TopicNames,
    group_id: str,
    *,
    store: KVStore | None = None,
    staging_partition: str = STAGING,
) -> dict[str, Any]:
    """Everything about one prompt group: receipts, state entries, finalized records, dead letters and,
    with a store, which of its staging keys and train sample ids are still in TQ."""
    found: dict[str, list[dict[str, Any]]] = {}
    for section, topic in (
        ("receipts", names.receipts),
        ("state", names.state),
        ("finalized", names.finalized),
        ("dead_letters", names.deadletter),
    ):
        role = topic_role(topic)
        found[section] = [
            d for d in (describe_record(r, role) for r in read_topic(kafka, topic)) if _matches_group(d, group_id)
        ]
    report: dict[str, Any] = {"group_id": group_id, **found}
    receipts = [d["value"] for d in found["receipts"] if d.get("kind") == Receipt.kind()]
    receipts += [
        d["value"]["original_receipt"] for d in found["dead_letters"] if "original_receipt" in d.get("value", {})
    ]
    staging_keys = sorted({c["staging_key"] for r in receipts for c in r["manifest"]})
    finalized = [d["value"] for d in found["finalized"] if d.get("kind") == FinalizedGroup.kind()]
    sample_ids = sorted({s for f in finalized for s in f["sample_ids"]})
    train = finalized[-1]["partition_id"] if finalized else TRAIN
    outcome = (
        "finalized" if finalized else "dead_lettered" if found["dead_letters"] else "open" if receipts else "unknown"
    )
    report["summary"] = {
        "receipts": len(found["receipts"]),
        "state_entries": len(found["state"]),
        "finalized_records": len(finalized),
        "dead_letters": len(found["dead_letters"]),
        "outcome": outcome,
    }
    if store is not None:
        staged = store.present(staging_partition, staging_keys)
        trained = store.present(train, sample_ids)
        report["tq"] = {
            "staging_partition": staging_partition,
            "train_partition": train,
            "staging_keys": {k: k in staged for k in staging_keys},
            "sample_ids": {s: s in trained for s in sample_ids},
        }
    return report


@dataclass(frozen=True)
class LagRow:
    group: str
    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int

    def line(self) -> str:
        committed = "-" if self.committed is None else str(self.committed)
        return f"{self.group}\t{self.topic}\t{self.partition}\t{committed}\t{self.end}\t{self.lag}"


def group_lag(kafka: KafkaConfig, group: str, topic: str) -> list[LagRow]:
    """Per partition: the group's committed offset (None if it has none), the end offset and the lag.

    The end is the last stable offset (read_committed), what a transactional consumer can reach;
    a group without a committed offset lags by everything still retained. As in Kafka's own tools,
    a trailing transaction marker counts as 1 until the next record is consumed past it.
    """
    ends = end_offsets(kafka, topic)
    committed = committed_offsets(kafka, group, topic)
    rows = []
    for p, (low, high) in sorted(ends.items()):
        c = committed.get(p, -1001)
        rows.append(LagRow(group, topic, p, c if c >= 0 else None, high, max(0, high - (c if c >= 0 else low))))
    return rows


def lag(
    kafka: KafkaConfig,
    names: TopicNames,
    *,
    reassembler_group: str = "reassemblers",
    trainer_group: str = "trainer",
    input_topic: str | None = None,
) -> list[LagRow]:
    """Lag of the reassembler group on receipts (or `input_topic`) and of the trainer group on finalized."""
    return group_lag(kafka, reassembler_group, input_topic or names.receipts) + group_lag(
        kafka, trainer_group, names.finalized
    )
