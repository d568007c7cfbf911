"""The asyncio publisher: concurrent tasks, and every receipt becomes visible only after its rows are in TQ."""

import asyncio
import threading
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from schemas.receipt import Receipt
from streams.consumer import read_topic
from streams.tq import STAGING
from workers.rollout.async_publisher import AsyncRolloutPublisher
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
