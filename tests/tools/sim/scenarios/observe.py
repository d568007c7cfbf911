"""How a scenario writes down what a client saw, so the real run and the model's can be compared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition


def kerr(err: KafkaError) -> tuple[str, bool, bool, bool]:
    """An error as the code and flags rlstream reads: (name, fatal, retriable, txn_requires_abort)."""
    return (err.name(), bool(err.fatal()), bool(err.retriable()), bool(err.txn_requires_abort()))


def outcome(fn: Callable[[], Any]) -> Any:
    """`("ok", result)`, or the Kafka error raised as `kerr`, or `("raised", type name)`."""
    try:
        return ("ok", fn())
    except KafkaException as exc:
        return kerr(exc.args[0])
    except (BufferError, RuntimeError) as exc:
        return ("raised", type(exc).__name__)


def read(w, topic: str, partition: int = 0, *, read_committed: bool = True, start: int = 0, settle_s: float = 3.0):
    """Everything a fresh assign-only reader gets from `start`: watermarks, (offset, key, value) and its
    final position; read until the position reaches the reader's high mark."""
    c = w.consumer(read_committed=read_committed)
    tp = TopicPartition(topic, partition)
    try:
        low, high = c.get_watermark_offsets(tp, timeout=10, cached=False)
        got: list[tuple[int, bytes | None, bytes | None]] = []
        if high <= max(low, start):
            return {"low": low, "high": high, "records": got, "position": None}
        c.assign([TopicPartition(topic, partition, start)])
        deadline = w.now() + settle_s
        while True:
            for m in c.consume(100, 0.2):
                if m.error() is None:
                    got.append((m.offset(), m.key(), m.value()))
            position = c.position([tp])[0].offset
            if position >= high or w.now() > deadline:
                break
        return {"low": low, "high": high, "records": got, "position": position}
    finally:
        c.close()


def settled(consumers: dict[str, Any], partitions: int, w, timeout_s: float = 30.0, errors: list | None = None) -> None:
    """Poll every consumer until their assignments cover `partitions` partitions between them, each owning some."""

    def done() -> bool:
        for c in consumers.values():
            for m in c.consume(10, 0.05):
                if m.error() is not None and errors is not None:
                    errors.append(kerr(m.error()))
        owned = [len(c.assignment()) for c in consumers.values()]
        return sum(owned) == partitions and all(owned)

    w.wait(done, timeout_s, f"{len(consumers)} consumers to share {partitions} partitions")


def owned(c) -> list[int]:
    return sorted(tp.partition for tp in c.assignment())


def balanced(assignments: dict[str, list[int]], partitions: int) -> bool:
    """Disjoint, complete, and no two members' counts differ by more than one."""
    every = [p for ps in assignments.values() for p in ps]
    counts = [len(ps) for ps in assignments.values()]
    return sorted(every) == list(range(partitions)) and max(counts) - min(counts) <= 1
