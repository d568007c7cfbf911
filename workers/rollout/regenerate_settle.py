"""After a whole-job restart: hand-backs generated already are settled, so no rollout worker generates them twice.

A `RegenerateFeed` commits past a hand-back once it was generated and published. A job killed in
between leaves the hand-back uncommitted with its regeneration's receipts already on Kafka; the
next feed would take it again and stage a second copy under the first one's keys. The feed skips
what it was told was generated (`generated=`), but only the caller could tell it. So `resume`
settles the feed's consumer group before any rollout worker starts: it reads the hand-backs past
the group's committed offsets, and in a partition where one of them was generated already (its
new group id has receipts: the caller says which) it commits the group past them all and, in the
same transaction, puts the ones not generated yet at the partition's end again (one copy per new
group id). The feed then takes each hand-back still owed exactly once.

The commit is the consumer group's own (`send_offsets_to_transaction` with its metadata, no
member): the broker takes it once the group is empty, so it is retried while the killed job's
members have not timed out yet (a session timeout), with a progress line. A partition whose
hand-backs were none of them generated is left as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition

from schemas.errors import SchemaError
from schemas.regenerate import Regenerate
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import Outgoing, TransactionalProducer
from workers.topics import TopicNames

RETRY_EVERY_S = 2.0


@dataclass
class FeedSettled:
    """What settling the feed found: hand-backs owed, generated already (now skipped), put again."""

    owed: int = 0
    generated: int = 0
    requeued: int = 0


def pending_hand_backs(
    kafka: KafkaConfig, names: TopicNames, committed: dict[int, int]
) -> dict[int, list[tuple[int, bytes | None, Regenerate]]]:
    """Per partition, the hand-backs from `committed` (from the start where it has none) to the end."""
    out: dict[int, list[tuple[int, bytes | None, Regenerate]]] = {}
    for r in read_topic(kafka, names.regenerate, start=committed):
        try:
            back = Regenerate.from_bytes(r.value)
        except SchemaError:
            continue  # the feed logs it and skips it
        out.setdefault(r.partition, []).append((r.offset, r.key, back))
    return out


def settle_feed(
    kafka: KafkaConfig,
    names: TopicNames,
    consumer_group: str,
    committed: dict[int, int],
    pending: dict[int, list[tuple[int, bytes | None, Regenerate]]],
    generated: Callable[[str], bool],
    ends: dict[int, int],
    *,
    wait_s: float,
    log: Callable[[str], None],
) -> FeedSettled:
    """Commit `consumer_group` past hand-backs generated already, putting the others back at the end.

    `ends` is each partition's end offset when `pending` was read (what the commit passes).
    """
    result = FeedSettled(owed=sum(len(v) for v in pending.values()))
    offsets, again = [], []
    for part, backs in sorted(pending.items()):
        done = [b for _, _, b in backs if generated(b.new_group_id)]
        if not done:
            continue
        result.generated += len(done)
        seen = set()
        for _, key, back in backs:
            if generated(back.new_group_id) or back.new_group_id in seen:
                continue
            seen.add(back.new_group_id)
            again.append(Outgoing(names.regenerate, key, back.to_bytes(), partition=part))
        offsets.append(TopicPartition(names.regenerate, part, ends[part]))
    if not offsets:
        return result
    result.requeued = len(again)
    _commit(kafka, names, consumer_group, offsets, again, wait_s=wait_s, log=log)
    log(
        f"resume: hand-backs on {names.regenerate}: {result.generated} generated already, skipped; "
        f"{result.requeued} put again at the end for {consumer_group}"
    )
    return result


def _commit(kafka, names, consumer_group, offsets, again, *, wait_s: float, log) -> None:
    member = Consumer(kafka.consumer(consumer_group))
    producer = TransactionalProducer(kafka, f"rlstream-resume.{consumer_group}")
    t0 = time.monotonic()
    try:
        while True:
            try:
                with producer.transaction():
                    for rec in again:
                        producer.produce(rec)
                    producer.send_offsets(offsets, member.consumer_group_metadata())
                return
            except KafkaException as exc:
                # Refused while the killed job's members are in the group (until their session times out).
                if exc.args[0].fatal() or time.monotonic() - t0 > wait_s:
                    raise
                log(
                    f"resume: cannot commit for {consumer_group} yet ({exc.args[0].str()}): waiting for the killed"
                    f" job's rollout workers to leave it, {time.monotonic() - t0:.0f} s of at most {wait_s:.0f} s"
                )
                time.sleep(RETRY_EVERY_S)
    finally:
        producer.flush(5)
        member.close()
