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
  (later transactions do not extend the wait), bounded by `wait_s` (default past the largest
  `transaction_timeout_ms` the broker allows a reassembler plus its abort scan), with a progress line
  at once and every 10 s naming the partitions still held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from confluent_kafka import Consumer, KafkaException, TopicPartition

from streams.config import KafkaConfig
from streams.consumer import partitions_of
from streams.producer import TransactionalProducer
from workers.trainer.errors import OpenTransaction

# The largest transaction_timeout_ms a reassembler may set (900 s), and the coordinator's scan for
# timed-out transactions (10 s by default), with a margin.
DEFAULT_WAIT_S = 960.0
PROGRESS_EVERY_S = 10.0


def abort_transactions(kafka: KafkaConfig, transactional_ids: Sequence[str], log: Callable[[str], None]) -> None:
    """Start a producer under each id: its open transaction, if any, is aborted and its producer fenced."""
    for tid in transactional_ids:
        producer = TransactionalProducer(kafka, tid)
        producer.flush(5)
        log(f"resume: {tid}: any transaction it left open is aborted (its producer fenced)")


def _offsets(c: Consumer, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    return {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10, cached=False)[1] for t, p in tps}


def wait_for_stable(
    kafka: KafkaConfig,
    topics: Sequence[str],
    *,
    wait_s: float = DEFAULT_WAIT_S,
    log: Callable[[str], None],
    poll_s: float = 0.5,
) -> float:
    """Wait until each partition of `topics` is stable up to the end it had now; returns the seconds waited.

    Raises OpenTransaction naming the partitions still held once `wait_s` has passed.
    """
    uncommitted = Consumer(kafka.consumer("rlstream-resume-ends", read_committed=False))
    committed = Consumer(kafka.consumer("rlstream-resume-stable", read_committed=True))
    try:
        tps = [(t, p) for t in topics for p in partitions_of(uncommitted, t)]
        ends = _offsets(uncommitted, tps)
        t0 = time.monotonic()
        said = t0 - PROGRESS_EVERY_S  # the first line at once, then one every PROGRESS_EVERY_S
        while True:
            stable = _offsets(committed, tps)
            held = {tp: (stable[tp], ends[tp]) for tp in tps if stable[tp] < ends[tp]}
            waited = time.monotonic() - t0
            if not held:
                if said > t0 - PROGRESS_EVERY_S:
                    log(f"resume: the open transactions ended after {waited:.0f} s")
                return waited
            names = ", ".join(f"{t}[{p}] (stable to {s} of {e})" for (t, p), (s, e) in sorted(held.items())[:4])
            if waited > wait_s:
                raise OpenTransaction(
                    f"a transaction stayed open for more than {wait_s:.0f} s on {names}: pass the dead job's"
                    " reassembler worker ids (--reassembler-worker-id) to abort it, or wait and resume again"
                )
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                log(
                    f"resume: waiting for an open transaction to end on {names},"
                    f" {waited:.0f} s of at most {wait_s:.0f} s"
                )
            time.sleep(poll_s)
    finally:
        uncommitted.close()
        committed.close()


def stable_committed(
    kafka: KafkaConfig, consumer_group: str, topic: str, *, wait_s: float = DEFAULT_WAIT_S, log: Callable[[str], None]
) -> dict[int, tuple[int, str | None]]:
    """partition -> (committed offset, metadata) of `consumer_group` on `topic` (partitions without one left
    out), retried while a transaction's offsets are still pending (the broker answers only stable ones)."""
    c = Consumer(kafka.consumer(consumer_group))
    try:
        parts = [TopicPartition(topic, p) for p in partitions_of(c, topic)]
        t0 = time.monotonic()
        while True:
            try:
                got = c.committed(parts, timeout=30)
                return {tp.partition: (tp.offset, tp.metadata) for tp in got if tp.offset >= 0}
            except KafkaException as exc:
                if exc.args[0].fatal() or time.monotonic() - t0 > wait_s:
                    raise
                log(f"resume: {consumer_group}'s offsets on {topic} are not stable yet ({exc.args[0].str()}); retrying")
                time.sleep(1.0)
    finally:
        c.close()
