"""The asyncio publisher: concurrent tasks, every receipt visible only after its rows are in TQ, and its error path:
a timeout names what was not acknowledged, and a retry of it finalizes each group once."""

import asyncio
import threading
import time
from collections import Counter

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from schemas.deadletter import DUPLICATE_RECEIPT, LATE_RECEIPT
from schemas.receipt import Receipt
from streams.config import KafkaConfig
from streams.consumer import read_topic, wait_until
from streams.tq import STAGING, TRAIN
from tests.integration.helpers import dead_letters, drive, finalized_records, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.async_publisher import AsyncRolloutPublisher
from workers.rollout.errors import UnacknowledgedReceipts
from workers.rollout.synthetic import SyntheticShape, make_group

SHAPE = SyntheticShape(group_size=3, calls=(1, 3), prompt_len=(4, 8), answer_len=(4, 8), observation_len=(2, 4))


class RecordingStore:
    """The real store, noting when each staging key's put returned."""

    def __init__(self, store):
        self._store = store
        self.staged_at: dict[str, float] = {}

    def put(self, partition, keys, fields, tags):
        time.sleep(0.05)  # a slow TQ: a receipt sent before the put returns would be caught below
        self._store.put(partition, keys, fields, tags)
        now = time.time()
        self.staged_at.update(dict.fromkeys(keys, now))


def watch_receipts(kafka, topic, store, seen, stop):
    """Reads receipts as they arrive and checks at once that their staged rows are in TQ."""
    c = Consumer(kafka.consumer(f"watch-{topic}", read_committed=False))
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
    try:
        while not stop.is_set():
            for m in c.consume(100, timeout=0.1):
                if m.error() is None:
                    r = Receipt.from_bytes(m.value())
                    keys = [call.staging_key for call in r.manifest]
                    present = set(store.tags(STAGING, keys)) if keys else set()
                    seen[r.rollout_id] = (m.timestamp()[1], present == set(keys))
    finally:
        c.close()


def test_concurrent_tasks_publish_every_receipt_after_its_rows_are_staged(kafka, tq_store, make_topic, unique):
    topic = make_topic("receipts", 2)
    store = RecordingStore(tq_store)
    seen: dict[str, tuple[int, bool]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_receipts, args=(kafka, topic, tq_store, seen, stop), daemon=True)
    watcher.start()
    groups = [make_group(f"{unique}-g{i}", i, 1, shape=SHAPE, seed=i) for i in range(6)]

    async def main():
        async with AsyncRolloutPublisher(kafka, store, topic, staging_threads=3) as pub:
            # One task per rollout batch, all at once on one publisher.
            acks = await asyncio.gather(*(pub.publish(g[:2]) for g in groups), *(pub.publish(g[2:]) for g in groups))
            return [a for batch in acks for a in batch]

    acks = asyncio.run(main())
    rollouts = [r for g in groups for r in g]
    assert len(acks) == len(rollouts) and {p for p, _ in acks} <= {0, 1}
    try:
        deadline = time.monotonic() + 30
        while len(seen) < len(rollouts) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert set(seen) == {r.receipt.rollout_id for r in rollouts}
    for r in rollouts:
        created_ms, staged_when_seen = seen[r.receipt.rollout_id]
        assert staged_when_seen, f"{r.receipt.rollout_id}: receipt visible before its rows were in TQ"
        for call in r.receipt.manifest:
            assert store.staged_at[call.staging_key] * 1000 <= created_ms + 1, call.staging_key
    # Every receipt exactly once, keyed by its group.
    records = list(read_topic(kafka, topic, read_committed=False))
    assert sorted(Receipt.from_bytes(rec.value).rollout_id for rec in records) == sorted(seen)
    assert all(rec.key == Receipt.from_bytes(rec.value).group_id.encode() for rec in records)
    tq_store.clear(STAGING, list(store.staged_at))


class HeldReports:
    """The real producer, except that its delivery reports wait while `held` is set: receipts reach the
    broker, but the publisher hears nothing (a broker slow to acknowledge, a stalled network path)."""

    def __init__(self, conf):
        self._producer = Producer(conf)
        self.held = threading.Event()
        self.held.set()

    def poll(self, timeout=0):
        if self.held.is_set():
            time.sleep(timeout)
            return 0
        return self._producer.poll(timeout)

    def __getattr__(self, name):
        return getattr(self._producer, name)


class _HeldApi:
    """A `KafkaApi` whose producers hold their delivery reports back (the publisher's only client)."""

    def __init__(self, made: list[HeldReports]):
        self._made = made

    def Producer(self, conf):  # noqa: N802 - confluent-kafka's name
        self._made.append(HeldReports(conf))
        return self._made[-1]


def _held_publisher(kafka, store, topic, made: list[HeldReports]) -> AsyncRolloutPublisher:
    return AsyncRolloutPublisher(kafka, store, topic, api=_HeldApi(made))


def _staging_keys(rollouts) -> list[str]:
    return [c.staging_key for r in rollouts for c in r.receipt.manifest]


def test_a_timeout_names_every_receipt_not_acknowledged_and_its_staged_rollouts(kafka, tq_store, make_topic, unique):
    topic = make_topic("receipts", 1)
    group = make_group(f"{unique}-t", 0, 1, shape=SHAPE, seed=1)
    made: list[HeldReports] = []

    async def main():
        pub = _held_publisher(kafka, tq_store, topic, made)
        try:
            await pub.publish(group, timeout_s=1.0)
        finally:
            made[0].held.clear()
            await pub.close()

    with pytest.raises(UnacknowledgedReceipts) as err:
        asyncio.run(main())
    ids = [r.receipt.rollout_id for r in group]
    assert err.value.unacknowledged == tuple(ids) and err.value.staged == tuple(ids)
    assert f"{len(ids)} of {len(ids)} receipt(s)" in str(err.value) and "within 1s" in str(err.value)
    # Not acknowledged is not lost: they reached the broker after all.
    assert sorted(
        Receipt.from_bytes(r.value).rollout_id for r in read_topic(kafka, topic, read_committed=False)
    ) == sorted(ids)
    tq_store.clear(STAGING, _staging_keys(group))


def test_a_producer_queue_that_stays_full_cannot_hold_a_publish_past_its_timeout(kafka, tq_store, make_topic, unique):
    topic = make_topic("receipts", 1)
    group = make_group(f"{unique}-q", 0, 1, shape=SHAPE, seed=2)
    made: list[HeldReports] = []
    # Room for two queued receipts: with the reports held the queue never drains.
    small = KafkaConfig(kafka.bootstrap_servers, {**kafka.client_settings, "queue.buffering.max.messages": "2"})

    async def main():
        pub = _held_publisher(small, tq_store, topic, made)
        try:
            await asyncio.wait_for(pub.publish(group, timeout_s=1.0), timeout=15.0)
        finally:
            made[0].held.clear()
            await pub.close()

    started = time.monotonic()
    with pytest.raises(UnacknowledgedReceipts) as err:
        asyncio.run(main())
    assert time.monotonic() - started < 10.0
    assert err.value.unacknowledged == tuple(r.receipt.rollout_id for r in group)
    assert f"{len(group) - 2} never sent" in str(err.value)
    tq_store.clear(STAGING, _staging_keys(group))


def test_a_publish_retried_after_a_timeout_finalizes_each_group_once(kafka, tq_store, unique):
    names = setup_topics(kafka, f"retry-{unique}", partitions=2)
    groups = [make_group(f"{unique}-r{i}", i, 1, shape=SHAPE, seed=10 + i) for i in range(3)]
    rollouts = [r for g in groups for r in g]
    made: list[HeldReports] = []

    async def first_then_retry():
        pub = _held_publisher(kafka, tq_store, names.receipts, made)
        try:
            with pytest.raises(UnacknowledgedReceipts) as err:
                await pub.publish(rollouts, timeout_s=1.0)
        finally:
            made[0].held.clear()
            await pub.close()  # flushes: the first receipts land too
        async with AsyncRolloutPublisher(kafka, tq_store, names.receipts) as again:
            return err.value, await again.publish(
                [r for r in rollouts if r.receipt.rollout_id in err.value.unacknowledged]
            )

    err, acks = asyncio.run(first_then_retry())
    assert len(err.unacknowledged) == len(rollouts) == len(acks)
    assert len(list(read_topic(kafka, names.receipts, read_committed=False))) == 2 * len(rollouts)
    worker = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="w", consumer_group=f"re-{unique}")
    )
    try:
        drive(
            [worker],
            lambda: (
                len(finalized_records(kafka, names)) >= len(groups) and len(dead_letters(kafka, names)) >= len(rollouts)
            ),
            timeout_s=120,
        )
    finally:
        worker.close()
    finalized = Counter(r.group_id for r in finalized_records(kafka, names))
    assert finalized == {g[0].receipt.group_id: 1 for g in groups}
    assert all(
        r.valid_row_count == len(g)
        for r, g in zip(sorted(finalized_records(kafka, names), key=lambda r: r.group_id), groups)
    )
    letters = dead_letters(kafka, names)
    assert len(letters) == len(rollouts) and {d.error_kind for d in letters} <= {DUPLICATE_RECEIPT, LATE_RECEIPT}
    wait_until(
        lambda: not tq_store.present(STAGING, _staging_keys(rollouts)),
        timeout_s=30,
        what="the rows staged again cleared",
    )
    tq_store.clear(TRAIN, [s for r in finalized_records(kafka, names) for s in r.sample_ids])
