"""Before `resume` reads: no transaction of the dead job is left open on the topics it reads (issue 30).

A reassembler killed inside its step's transaction leaves it open on the broker until
`transaction_timeout_ms` passes (up to 900 s): a `read_committed` reader stops at the last stable
offset, below its first record, so it does not see what other workers committed after it in those
partitions either, and the reassemblers' committed offsets stay unstable. Read then, resume would
count those groups unaccounted for and leave their spilled rows out.

Two ways past it, in this order:

- **abort**: a producer started under the dead worker's transactional id (`<consumer group>.<worker
  id>`) aborts its open transaction and fences it, exactly what that worker does when it starts
  again. Right when the ids are known (the GRPO example's workers; `rlstream resume
  --reassembler-worker-id` for workers started with `--worker-id`), since the whole job, that worker
  included, is dead. A live worker under such an id (resume run while reassemblers run) is fenced
  once, rides that out with a new producer and redoes its step: nothing lost, nothing doubled.
- **wait**: until every partition's last stable offset reaches the end it had when resume began
  (later transactions do not extend the wait), within resume's one deadline (default past the
  largest `transaction_timeout_ms` a reassembler may set plus the coordinator's abort scan), with a
  progress line at once and every 10 s naming the partitions still held.

`open_now` tells which partitions a transaction holds when resume begins, so its report (and the
job-restart drill) can show there was one to abort or wait for. Every client here comes from the
`KafkaApi` given and every wait is on the `Runtime` given (the real ones by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaException, TopicPartition

from streams.config import KafkaConfig
from streams.consumer import partitions_of
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.producer import TransactionalProducer
from streams.runtime import REAL_RUNTIME, Runtime
from workers.deadline import Deadline
from workers.trainer.errors import OpenTransaction

# The largest transaction_timeout_ms a reassembler may set (900 s), and the coordinator's scan for
# timed-out transactions (10 s by default), with a margin.
DEFAULT_WAIT_S = 960.0
PROGRESS_EVERY_S = 10.0


def abort_transactions(
    kafka: KafkaConfig, transactional_ids: Sequence[str], log: Callable[[str], None], *, api: KafkaApi = REAL_KAFKA
) -> None:
    """Start a producer under each id: its open transaction, if any, is aborted and its producer fenced."""
    for tid in transactional_ids:
        producer = TransactionalProducer(kafka, tid, api=api)
        producer.flush(5)
        log(f"resume: {tid}: any transaction it left open is aborted (its producer fenced)")


def _offsets(c: Any, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    return {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10, cached=False)[1] for t, p in tps}


class Stability:
    """Each partition's end as a read_uncommitted reader sees it, and how far a read_committed one gets."""

    def __init__(self, kafka: KafkaConfig, topics: Sequence[str], *, api: KafkaApi = REAL_KAFKA):
        self._uncommitted = api.Consumer(kafka.consumer("rlstream-resume-ends", read_committed=False))
        self._committed = api.Consumer(kafka.consumer("rlstream-resume-stable", read_committed=True))
        self.partitions = [(t, p) for t in topics for p in partitions_of(self._uncommitted, t)]

    def ends(self) -> dict[tuple[str, int], int]:
        return _offsets(self._uncommitted, self.partitions)

    def held(self, ends: dict[tuple[str, int], int]) -> dict[tuple[str, int], tuple[int, int]]:
        """(stable, end) of the partitions whose last stable offset is still below `ends`: a transaction is open."""
        stable = _offsets(self._committed, self.partitions)
        return {tp: (stable[tp], ends[tp]) for tp in self.partitions if stable[tp] < ends[tp]}

    def close(self) -> None:
        self._uncommitted.close()
        self._committed.close()


def describe(held: dict[tuple[str, int], tuple[int, int]], most: int = 4) -> str:
    return ", ".join(f"{t}[{p}] (stable to {s} of {e})" for (t, p), (s, e) in sorted(held.items())[:most])


def open_now(
    kafka: KafkaConfig, topics: Sequence[str], *, api: KafkaApi = REAL_KAFKA
) -> dict[tuple[str, int], tuple[int, int]]:
    """The partitions of `topics` an open transaction holds now (stable offset below the end), with (stable, end)."""
    stability = Stability(kafka, topics, api=api)
    try:
        return stability.held(stability.ends())
    finally:
        stability.close()


def wait_for_stable(
    kafka: KafkaConfig,
    topics: Sequence[str],
    *,
    deadline: Deadline,
    log: Callable[[str], None],
    poll_s: float = 0.5,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> float:
    """Wait until each partition of `topics` is stable up to the end it had now; returns the seconds waited.

    Raises OpenTransaction naming the partitions still held once `deadline` has passed.
    """
    stability = Stability(kafka, topics, api=api)
    try:
        ends = stability.ends()
        t0 = runtime.monotonic()
        said = t0 - PROGRESS_EVERY_S  # the first line at once, then one every PROGRESS_EVERY_S
        while True:
            held = stability.held(ends)
            waited = runtime.monotonic() - t0
            if not held:
                if said > t0 - PROGRESS_EVERY_S:
                    log(f"resume: the open transactions ended after {waited:.0f} s")
                return waited
            names = describe(held)
            if deadline.passed():
                raise OpenTransaction(
                    f"a transaction stayed open past resume's {deadline.seconds:.0f} s on {names}: pass the dead"
                    " job's reassembler worker ids (--reassembler-worker-id) to abort it, or wait and resume again"
                )
            if runtime.monotonic() - said >= PROGRESS_EVERY_S:
                said = runtime.monotonic()
                log(
                    f"resume: waiting for an open transaction to end on {names},"
                    f" {deadline.elapsed():.0f} s of at most {deadline.seconds:.0f} s"
                )
            runtime.sleep(poll_s)
    finally:
        stability.close()


def stable_committed(
    kafka: KafkaConfig,
    consumer_group: str,
    topic: str,
    *,
    deadline: Deadline,
    log: Callable[[str], None],
    consumer: Callable[[], Any] | None = None,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> dict[int, tuple[int, str | None]]:
    """partition -> (committed offset, metadata) of `consumer_group` on `topic` (partitions without one left
    out), retried while a transaction's offsets are still pending (the broker answers only stable ones).

    `consumer` makes the consumer of the group that asks (one that never joins it); a plain one from `api`
    by default.
    """
    c = consumer() if consumer is not None else api.Consumer(kafka.consumer(consumer_group))
    try:
        parts = [TopicPartition(topic, p) for p in partitions_of(c, topic)]
        while True:
            try:
                got = c.committed(parts, timeout=max(1.0, min(30.0, deadline.left())))
                return {tp.partition: (tp.offset, tp.metadata) for tp in got if tp.offset >= 0}
            except KafkaException as exc:
                if exc.args[0].fatal() or deadline.passed():
                    raise
                log(f"resume: {consumer_group}'s offsets on {topic} are not stable yet ({exc.args[0].str()}); retrying")
                runtime.sleep(1.0)
    finally:
        c.close()
