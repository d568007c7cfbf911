"""The rollout publisher for asyncio rollout workers: stage in TQ off the event loop, then publish, awaited.

`AsyncRolloutPublisher.publish` keeps `RolloutPublisher`'s contract, a receipt is never visible
before its tensors are staged: it runs the TQ put (`stage_rollouts`) in a thread pool, awaits it,
and only then produces the receipts. Their acks are awaited as asyncio futures, resolved from the
producer's delivery callbacks, which a poller thread serves and hands to the loop with
`call_soon_threadsafe`. Any number of tasks may publish concurrently on one publisher.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from confluent_kafka import Producer

from schemas.metadata_guard import assert_metadata_only
from streams.config import KafkaConfig
from streams.producer import DeliveryError
from streams.tq import STAGING, KVStore
from workers.rollout.publisher import StagedRollout, stage_rollouts

Ack = tuple[int, int]


def _settle(fut: asyncio.Future, outcome: Ack | DeliveryError) -> None:
    if fut.done():  # the publish gave up (timeout, cancelled) before the broker answered
        return
    if isinstance(outcome, DeliveryError):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


class AsyncRolloutPublisher:
    """Stages each call's deltas under `{rollout_id}/{call_id}`, then publishes the receipts; all awaited.

    `staging_threads` bounds concurrent TQ puts. Use as `async with` or call `close()` when done.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        receipts_topic: str,
        *,
        staging_partition: str = STAGING,
        staging_threads: int = 4,
    ):
        self._producer = Producer(kafka.producer())
        self._store = store
        self._topic = receipts_topic
        self._staging = staging_partition
        self._executor = ThreadPoolExecutor(max_workers=staging_threads, thread_name_prefix="tq-staging")
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._serve_deliveries, name="receipt-acks", daemon=True)
        self._poller.start()

    def _serve_deliveries(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0.05)

    async def publish(self, rollouts: Sequence[StagedRollout], *, timeout_s: float = 30.0) -> list[Ack]:
        """Stage (in a worker thread), then publish the receipts keyed by group_id; (partition, offset) each.

        Raises `DeliveryError` when a receipt is refused or not acknowledged within `timeout_s`.
        """
        if self._closed.is_set():
            raise RuntimeError("publish on a closed AsyncRolloutPublisher")
        for r in rollouts:
            assert_metadata_only(r.receipt, path="receipt")
        loop = asyncio.get_running_loop()
        staged = [r for r in rollouts if r.receipt.manifest]
        if staged:
            await loop.run_in_executor(self._executor, stage_rollouts, self._store, staged, self._staging)
        futures = [await self._produce(loop, r) for r in rollouts]
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout_s)
        except TimeoutError:
            left = sum(not f.done() for f in futures)
            raise DeliveryError(f"{left} receipt(s) not acknowledged within {timeout_s:.0f}s") from None
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise DeliveryError("; ".join(str(e) for e in errors[:5]))
        return list(outcomes)

    async def _produce(self, loop: asyncio.AbstractEventLoop, rollout: StagedRollout) -> asyncio.Future:
        fut = loop.create_future()
        key = rollout.receipt.group_id.encode()

        def delivered(err, msg) -> None:  # runs on the poller thread
            if err is not None:
                outcome: Ack | DeliveryError = DeliveryError(f"{self._topic} key={key!r} not acknowledged: {err.str()}")
            else:
                outcome = (msg.partition(), msg.offset())
            try:
                loop.call_soon_threadsafe(_settle, fut, outcome)
            except RuntimeError:  # the loop is closed: nobody awaits this receipt any more
                pass

        while True:
            try:
                self._producer.produce(self._topic, key=key, value=rollout.receipt.to_bytes(), on_delivery=delivered)
                return fut
            except BufferError:
                # The local queue is full: the poller thread drains it as the broker acks.
                await asyncio.sleep(0.05)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued, stop the poller and the staging threads."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._producer.flush, timeout_s)
        self._closed.set()
        await loop.run_in_executor(None, self._poller.join, timeout_s)
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> AsyncRolloutPublisher:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
