"""The rollout publisher for asyncio rollout workers: stage in TQ off the event loop, then publish, awaited.

`AsyncRolloutPublisher.publish` keeps `RolloutPublisher`'s contract, a receipt is never visible
before its tensors are staged: it runs the TQ put (`stage_rollouts`) in a thread pool, awaits it,
and only then produces the receipts. Their acks are awaited as asyncio futures, resolved from the
producer's delivery callbacks, which a poller thread serves and hands to the loop with
`call_soon_threadsafe`. Any number of tasks may publish concurrently on one publisher.

A publish that ends before every receipt is acknowledged raises `UnacknowledgedReceipts`, naming the
rollouts whose receipts were not acknowledged (refused, not acknowledged in time, or never handed to
the producer because its queue stayed full) and which of them have rows staged. What it leaves:

- the rows of every staged rollout, in TQ staging, whether or not its receipt got out;
- receipts handed to the producer and not acknowledged yet: librdkafka keeps sending them after the
  publish gave up, so they may still land.

So a caller retries with the same rollouts (same rollout ids, so the same staging keys and receipts).
A receipt that lands twice is no harm: the reassembler refuses the second as `duplicate_receipt`
(its group still open) or `late_receipt` (closed), as a dead letter, never finalizing a group twice,
and clears the rows the retry staged again once their group's rows are out. Rows staged for a
receipt that never lands (the caller gives up) are what the reassembler's staging sweep removes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from schemas.metadata_guard import assert_metadata_only
from streams.config import KafkaConfig
from streams.errors import DeliveryError
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from streams.tq import STAGING, KVStore
from workers.rollout.errors import UnacknowledgedReceipts
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
    The producer comes from `api` (confluent-kafka by default; a test's that holds reports back) and the
    rows' `staged_at_ms` from `runtime`'s wall clock.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        receipts_topic: str,
        *,
        staging_partition: str = STAGING,
        staging_threads: int = 4,
        api: KafkaApi = REAL_KAFKA,
        runtime: Runtime = REAL_RUNTIME,
    ):
        self._producer = api.Producer(kafka.producer())
        self._runtime = runtime
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

        `timeout_s` bounds the Kafka side, from the end of staging to the last acknowledgement,
        including waits for room in the producer's queue (staging is bounded by TQ's own retries).
        Raises `UnacknowledgedReceipts` when a receipt is refused or not acknowledged in time; a
        staging failure raises TQ's error, with no receipt sent and some rows possibly staged.
        """
        if self._closed.is_set():
            raise RuntimeError("publish on a closed AsyncRolloutPublisher")
        for r in rollouts:
            assert_metadata_only(r.receipt, path="receipt")
        loop = asyncio.get_running_loop()
        staged = [r for r in rollouts if r.receipt.manifest]
        if staged:
            now_ms = self._runtime.wall_ms()
            await loop.run_in_executor(
                self._executor, lambda: stage_rollouts(self._store, staged, self._staging, now_ms=now_ms)
            )
        deadline = loop.time() + timeout_s
        futures: list[asyncio.Future] = []
        try:
            for r in rollouts:
                fut = await self._produce(loop, r, deadline)
                if fut is None:  # the queue stayed full until the deadline: this one and the rest never went
                    break
                futures.append(fut)
            if futures:
                await asyncio.wait(futures, timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            for fut in futures:
                fut.cancel()  # no one awaits their reports now; the receipts handed over may still land
            raise
        acks = [f.result() for f in futures if f.done() and f.exception() is None]
        if len(acks) == len(rollouts):
            return acks
        raise self._incomplete(rollouts, futures, timeout_s)

    def _incomplete(
        self, rollouts: Sequence[StagedRollout], futures: list[asyncio.Future], timeout_s: float
    ) -> UnacknowledgedReceipts:
        refused: list[BaseException] = []
        late = 0
        missing: list[str] = []
        staged: list[str] = []
        for i, r in enumerate(rollouts):
            fut = futures[i] if i < len(futures) else None
            if fut is not None and not fut.done():
                fut.cancel()  # its delivery report, if one comes, finds it done and is dropped
                late += 1
            elif fut is not None and fut.exception() is not None:
                refused.append(fut.exception())
            elif fut is not None:
                continue
            missing.append(r.receipt.rollout_id)
            if r.receipt.manifest:
                staged.append(r.receipt.rollout_id)
        unsent = len(rollouts) - len(futures)
        why = [f"{len(refused)} refused: {'; '.join(str(e) for e in refused[:3])}"] if refused else []
        why += [f"{late} not acknowledged within {timeout_s:g}s"] if late else []
        why += [f"{unsent} never sent, the producer's queue staying full"] if unsent else []
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        return UnacknowledgedReceipts(
            f"{len(missing)} of {len(rollouts)} receipt(s) on {self._topic} not acknowledged ({'; '.join(why)}):"
            f" rollouts {shown}, {len(staged)} of them with rows staged; publish them again (a receipt"
            " that lands twice is refused by the reassembler as a duplicate)",
            unacknowledged=missing,
            staged=staged,
        )

    async def _produce(
        self, loop: asyncio.AbstractEventLoop, rollout: StagedRollout, deadline: float
    ) -> asyncio.Future | None:
        """The receipt handed to the producer, its ack's future; None if the queue had no room by `deadline`."""
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
                left = deadline - loop.time()
                if left <= 0:
                    return None
                await asyncio.sleep(min(0.05, left))

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
