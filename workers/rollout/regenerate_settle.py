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
member id, generation -1). Kafka's classic group coordinator takes such a commit even while the
group has members, so a running feed would overwrite it with its own next commit: the commit is
made only while the group is empty (`group_members`, checked just before it; `resume` waited for
the killed job's members to leave already), else refused (`FeedBusy`) unless forced. A partition
whose hand-backs were none of them generated is left as it is.

A feed group with no commit at all on a topic holding hand-backs is refused too (`check_feed_group`):
a wrong or fresh `--rollout-consumer-group`, or offsets the broker expired, would read every
hand-back ever made (kept for good) and re-queue them all. Clients come from the `KafkaApi` given and
waits are on the `Runtime` given (the real ones by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaException, TopicPartition

from schemas.errors import RlstreamError, SchemaError
from schemas.regenerate import Regenerate
from streams.admin import group_members
from streams.config import KafkaConfig
from streams.consumer import end_offsets, read_topic
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.producer import Outgoing, TransactionalProducer
from streams.runtime import REAL_RUNTIME, Runtime
from workers.deadline import Deadline
from workers.topics import TopicNames

RETRY_EVERY_S = 2.0


class FeedBusy(RlstreamError):
    """The rollout workers' feed group cannot be settled: it has members, or no commit to settle from."""


@dataclass
class FeedSettled:
    """What settling the feed found: hand-backs owed, generated already (now skipped), put again."""

    owed: int = 0
    generated: int = 0
    requeued: int = 0


def pending_hand_backs(
    kafka: KafkaConfig,
    names: TopicNames,
    committed: dict[int, int],
    *,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> dict[int, list[tuple[int, bytes | None, Regenerate]]]:
    """Per partition, the hand-backs from `committed` (from the start where it has none) to the end."""
    out: dict[int, list[tuple[int, bytes | None, Regenerate]]] = {}
    for r in read_topic(kafka, names.regenerate, start=committed, api=api, runtime=runtime):
        try:
            back = Regenerate.from_bytes(r.value)
        except SchemaError:
            continue  # the feed logs it and skips it
        out.setdefault(r.partition, []).append((r.offset, r.key, back))
    return out


def check_feed_group(
    kafka: KafkaConfig,
    names: TopicNames,
    consumer_group: str,
    committed: dict[int, int],
    *,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> None:
    """Refuse a feed group with no commit on a regenerate topic that holds records (FeedBusy says why)."""
    if committed:
        return
    # One record is enough to know (markers are no hand-backs).
    records = read_topic(kafka, names.regenerate, api=api, runtime=runtime)
    try:
        any_record = next(records, None) is not None
    finally:
        records.close()
    if any_record:
        held = sum(high - low for low, high in end_offsets(kafka, names.regenerate, api=api).values())
        raise FeedBusy(
            f"consumer group {consumer_group!r} has no committed offset on {names.regenerate}, which holds"
            f" hand-backs (offsets up to {held}): a wrong or fresh --rollout-consumer-group (or offsets the"
            " broker expired, offsets.retention.minutes) would hand every one of them out again; check the"
            " name, or pass --force"
        )


def settle_feed(
    kafka: KafkaConfig,
    names: TopicNames,
    consumer_group: str,
    committed: dict[int, int],
    pending: dict[int, list[tuple[int, bytes | None, Regenerate]]],
    generated: Callable[[str], bool],
    ends: dict[int, int],
    *,
    deadline: Deadline,
    log: Callable[[str], None],
    force: bool = False,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> FeedSettled:
    """Commit `consumer_group` past hand-backs generated already, putting the others back at the end.

    `ends` is each partition's end offset when `pending` was read (what the commit passes). Raises
    FeedBusy while the group has members (unless `force`).
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
    members = group_members(kafka, [consumer_group], api=api, runtime=runtime).get(consumer_group, [])
    if members and not force:
        raise FeedBusy(
            f"consumer group {consumer_group!r} has members ({', '.join(str(m) for m in members[:4])}): a running"
            " feed would overwrite the commit that settles it; stop its rollout workers first"
        )
    _commit(kafka, consumer_group, offsets, again, deadline=deadline, log=log, api=api, runtime=runtime)
    log(
        f"resume: hand-backs on {names.regenerate}: {result.generated} generated already, skipped; "
        f"{result.requeued} put again at the end for {consumer_group}"
    )
    return result


def _commit(
    kafka, consumer_group, offsets, again, *, deadline: Deadline, log, api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> None:  # fmt: skip
    member = api.Consumer(kafka.consumer(consumer_group))
    producer = TransactionalProducer(kafka, f"rlstream-resume.{consumer_group}", api=api)
    try:
        while True:
            try:
                with producer.transaction():
                    for rec in again:
                        producer.produce(rec)
                    producer.send_offsets(offsets, member.consumer_group_metadata())
                return
            except KafkaException as exc:
                # A coordinator moving or loading: retried within resume's deadline.
                if exc.args[0].fatal() or deadline.passed():
                    raise
                log(
                    f"resume: cannot commit for {consumer_group} yet ({exc.args[0].str()}), retrying;"
                    f" {deadline.elapsed():.0f} s of at most {deadline.seconds:.0f} s"
                )
                runtime.sleep(RETRY_EVERY_S)
    finally:
        producer.flush(5)
        member.close()
