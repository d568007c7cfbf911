"""Admission control for rollout workers: how many new prompt groups they may start, given the trainer's version.

In the manner of AReaL's staleness manager: with the trainer at version v consuming B groups per
version, a worker may have at most (eta + v + 1) * B groups accepted or running, and at most
`max_concurrent` running, so

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted - lost + running))

where eta is the staleness bound in versions. If groups finish roughly in the order they start,
a group started at version v is consumed by version v + eta at the latest, so the trainer's
staleness bound never has to evict it.

`lost` counts accepted groups that will never be trained: AReaL's arithmetic holds for the others,
and a lost group counts as one never accepted. Without it every loss stays counted forever: with
B = 4, eta = 1 and one group in ten lost, nothing is admitted from version 11 on, the trainer
cannot fill a batch, its version never moves, and the gate never opens again. A gate learns of losses where they happen:

- the trainer's (evicted as too stale, dropped for rows missing from TQ): the trainer counts them in
  `TrainerVersion.lost_groups` on the version topic, which it publishes when they change;
- the reassemblers' (a group dead-lettered whole: every rollout failed, no valid row, its build
  failed): the closing entry of that group on the reassemblers' state topic, outcome dead_lettered.

Each loss returns capacity once: trainer counts are followed per trainer run (a restarted trainer
counts from 0 again), and a group's closings are counted once by group id. Losses from before the
gate started are not its own. A worker sharing the trainer with others (`batch_share` 1/N) gets
that share of each loss, as of B.

`StalenessBudget` is that arithmetic and its counters, thread-safe and free of I/O. `AdmissionGate`
feeds it from the two topics in a background tick (its `Runtime`'s `periodic`; the consumer from its
`KafkaApi`: the process's own thread and confluent-kafka by default, a simulator's under the explorer).
A worker calls `acquire(n, timeout)` before starting n groups (or checks `capacity()` itself and calls
`on_started(n)`), then `on_finished(accepted)` once per group: accepted once it is published, rejected
when it was dropped before publishing (filtered out). What becomes of a published group downstream is the
gate's to learn, not the worker's to guess: one whose rollouts all failed is still accepted, and
returns its capacity when the reassembler dead-letters it.

Versions count from the first one a budget sees: a worker joining a trainer at version 40 may run
(eta + 1) * B groups ahead of it, not 41 * B.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaException, TopicPartition

from schemas.errors import InvalidArgument, SchemaError
from schemas.state import CLOSED, DEAD_LETTERED, HANDED_BACK, GroupState
from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from streams.consumer import partitions_of
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime
from workers.topics import STATE_ROLE, TopicNames, decode_value

log = logging.getLogger("rlstream.rollout.gate")


# How many dead-lettered group ids a gate remembers: a group's closing is written again (its staging
# cleared) within a step or two, so this only has to span the losses of a few seconds.
RECENT_LOSSES = 10_000


def staleness_capacity(
    *,
    version: int,
    max_staleness: int,
    batch_groups: float,
    accepted: int,
    running: int,
    max_concurrent: int,
    lost: float = 0.0,
) -> int:
    """min(max_concurrent - running, floor((eta + v + 1) * B - (accepted - lost)) - running); may be negative."""
    by_staleness = math.floor((max_staleness + version + 1) * batch_groups - (accepted - lost)) - running
    return min(max_concurrent - running, by_staleness)


@dataclass(frozen=True)
class GateCounts:
    """A snapshot of a budget: groups started, running, accepted and rejected, losses seen, and the version."""

    started: int
    running: int
    accepted: int
    rejected: int
    version: int | None
    batch_groups: int | None
    lost: int = 0


class StalenessBudget:
    """The gate's arithmetic and counters; no capacity until a trainer version has been observed.

    `batch_share` scales B for a worker that is one of several sharing a trainer (1/N each).
    """

    def __init__(self, max_staleness: int, *, max_concurrent: int = 1_000_000, batch_share: float = 1.0):
        if max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {max_staleness}")
        if max_concurrent < 1:
            raise InvalidArgument(f"max_concurrent must be >= 1, got {max_concurrent}")
        if not 0 < batch_share <= 1:
            raise InvalidArgument(f"batch_share must be in (0, 1], got {batch_share}")
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self.batch_share = batch_share
        self._cond = threading.Condition()
        self._closed = False
        self._base: int | None = None
        self._version: int | None = None
        self._batch: int | None = None
        self._started = self._running = self._accepted = self._rejected = self._lost = 0

    def observe(self, version: int, batch_groups: int) -> None:
        """The trainer is at `version`, consuming `batch_groups` groups per version; wakes waiters."""
        if version < 0 or batch_groups < 1:
            raise InvalidArgument(f"bad trainer version {version} / batch_groups {batch_groups}")
        with self._cond:
            if self._base is None:
                self._base = version
            self._version, self._batch = version, batch_groups
            self._cond.notify_all()

    @property
    def version(self) -> int | None:
        """The trainer version last observed (absolute), None before the first."""
        with self._cond:
            return self._version

    def capacity(self) -> int:
        """How many groups may start now (0 or less: none); 0 until a version has been observed."""
        with self._cond:
            return self._capacity()

    def _capacity(self) -> int:
        if self._version is None or self._batch is None or self._base is None:
            return 0
        return staleness_capacity(
            version=self._version - self._base,
            max_staleness=self.max_staleness,
            batch_groups=self._batch * self.batch_share,
            accepted=self._accepted,
            running=self._running,
            max_concurrent=self.max_concurrent,
            lost=self._lost * self.batch_share,
        )

    def acquire(self, n: int = 1, timeout: float | None = None) -> bool:
        """Wait until n groups may start and count them as running; False on timeout or once closed."""
        if n < 1:
            raise InvalidArgument(f"acquire needs n >= 1, got {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._capacity() < n:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            if self._closed:
                return False
            self._start(n)
            return True

    def on_started(self, n: int = 1) -> None:
        """Count n groups as running without waiting (for callers that checked `capacity()` themselves)."""
        with self._cond:
            self._start(n)

    def _start(self, n: int) -> None:
        self._started += n
        self._running += n

    def on_finished(self, accepted: bool) -> None:
        """One running group ended: accepted (published) or rejected (dropped before publishing)."""
        with self._cond:
            if self._running <= 0:
                raise InvalidArgument("on_finished called with no group running")
            self._running -= 1
            if accepted:
                self._accepted += 1
            else:
                self._rejected += 1
            self._cond.notify_all()

    def on_lost(self, n: int = 1) -> None:
        """n accepted groups will never be trained (evicted, dead-lettered, rows missing): their capacity
        comes back, as if they had never been accepted (this worker's `batch_share` of it)."""
        if n < 0:
            raise InvalidArgument(f"on_lost needs n >= 0, got {n}")
        with self._cond:
            self._lost += n
            self._cond.notify_all()

    def counts(self) -> GateCounts:
        with self._cond:
            return GateCounts(
                self._started, self._running, self._accepted, self._rejected, self._version, self._batch, self._lost
            )

    def close(self) -> None:
        """Release every waiter (their `acquire` returns False)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def lost_group(value: bytes) -> str | None:
    """The group id of a state entry that closes a group with no rows to train, else None.

    Dead-lettered and handed-back groups alike: a handed-back group's regeneration is admitted as a
    new group under its own id, so the original's admission would otherwise be held forever.
    """
    entry = decode_value(value, STATE_ROLE)
    if isinstance(entry, GroupState) and entry.status == CLOSED and entry.outcome in (DEAD_LETTERED, HANDED_BACK):
        return entry.group_id
    return None


class TrainerLosses:
    """One trainer's loss count as read from its records: how many of its losses are new to this gate.

    Counted per run (one publisher's life): the first run read starts from what it had counted
    already (losses from before this gate started are not its own), a later run from 0 (a
    restarted trainer counts from 0 again). Within a run only a count above the highest read so far
    is new: a publisher never sends a lower one, and a lower one read anyway (a version before
    that rule) is ignored rather than counted again when the count climbs back.
    """

    def __init__(self) -> None:
        self._run: str | None = None
        self._counted = 0

    def new_losses(self, run: str, lost_groups: int) -> int:
        if self._run is None:
            self._run, self._counted = run, lost_groups
        elif run != self._run:
            self._run, self._counted = run, 0
        new = max(0, lost_groups - self._counted)
        self._counted += new
        return new


class AdmissionGate(StalenessBudget):
    """A `StalenessBudget` following one trainer's records on the version topic, and the groups the
    reassemblers dead-letter on their state topic, in a background tick.

    `trainer_id` None follows whichever trainer wrote last (one trainer per topic prefix). `api` makes
    its consumer and `runtime` runs its tick (back to back, each waiting up to `poll_s` for records)
    and its sleeps; `acquire` and `wait_for_version` wait on the process's own clock (a simulated
    rollout worker checks `capacity()` and calls `on_started` instead).
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicNames,
        *,
        max_staleness: int,
        trainer_id: str | None = None,
        max_concurrent: int = 1_000_000,
        batch_share: float = 1.0,
        poll_s: float = 0.1,
        api: KafkaApi = REAL_KAFKA,
        runtime: Runtime = REAL_RUNTIME,
    ):
        super().__init__(max_staleness, max_concurrent=max_concurrent, batch_share=batch_share)
        self._topic = topics.trainer_version
        self._state_topic = topics.state
        self._trainer_id = trainer_id
        self._poll_s = poll_s
        self._runtime = runtime
        self._stop = threading.Event()
        self._stopped = threading.Event()  # the follower closed its consumer and ticks no more
        self._trainer_losses = TrainerLosses()
        self._dead: OrderedDict[str, None] = OrderedDict()  # dead-lettered groups counted, newest last
        # Per version partition, its end offset when assigned while the history up to it is read (None:
        # not assigned yet); the latest matching record of that history.
        self._behind: dict[int, int] | None = None
        self._latest: tuple[bytes | None, bytes] | None = None
        self._ticking: int | None = None  # the thread running a tick now
        self._follower = None
        # read_committed: a reassembler's aborted step must not count its dead letters.
        self._consumer = api.Consumer(kafka.consumer(f"rlstream-gate-{uuid.uuid4().hex[:12]}", read_committed=True))
        self._follower = runtime.periodic(0.0, self._follow, name="admission-gate")

    def wait_for_version(self, timeout: float) -> int | None:
        """Block until a trainer version has been read (or `timeout`); returns it, or None."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._version is None and not self._closed and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._version

    def _assign(self) -> dict[int, int] | None:
        """The version topic from its beginning, the state topic from its end; returns each version
        partition's end offset now, None if a topic is not there yet."""
        try:
            parts = partitions_of(self._consumer, self._topic, timeout_s=5.0)
            ends = {p: self._consumer.get_watermark_offsets(TopicPartition(self._topic, p), timeout=5.0) for p in parts}
            state = partitions_of(self._consumer, self._state_topic, timeout_s=5.0)
        except KafkaException as exc:  # not created yet: the pipeline's setup creates them
            log.debug("topic %s or %s not readable yet: %s", self._topic, self._state_topic, exc)
            return None
        self._consumer.assign(
            [TopicPartition(self._topic, p, OFFSET_BEGINNING) for p in parts]
            + [TopicPartition(self._state_topic, p, OFFSET_END) for p in state]
        )
        return {p: high for p, (low, high) in ends.items() if high > low}

    def _follow(self) -> None:
        """One tick of the follower: assign (once the topics exist), then one consume and what it read."""
        if self._stopped.is_set():
            return
        self._ticking = threading.get_ident()
        try:
            if self._stop.is_set():
                self._finish()
                return
            if self._behind is None:
                self._behind = self._assign()
                if self._behind is None:
                    self._runtime.sleep(0.5)
                return
            # The history up to the end offsets found at assignment is read first and only its latest
            # record applied: compaction is lazy, and counting from an old version would over-admit.
            behind = self._behind
            for msg in self._consumer.consume(100, timeout=self._poll_s):
                if msg.error() is not None or msg.value() is None:
                    continue
                if msg.topic() == self._state_topic:
                    self._closing(msg.value())
                    continue
                if not behind:
                    self._apply(msg.key(), msg.value())
                    continue
                if self._matches(msg.value()):
                    self._latest = (msg.key(), msg.value())
                if msg.offset() + 1 >= behind.get(msg.partition(), 0):
                    behind.pop(msg.partition(), None)
                if not behind and self._latest is not None:
                    self._apply(*self._latest)
        except Exception:  # noqa: BLE001 - a dead follower must not pass silently; waiters time out
            log.exception("admission gate stopped following %s", self._topic)
            self._finish()
        finally:
            self._ticking = None

    def _finish(self) -> None:
        if self._follower is not None:  # else its first tick came first: the stopped flag ends the others
            self._follower.stop()
        try:
            self._consumer.close()
        finally:
            self._stopped.set()

    def _closing(self, value: bytes) -> None:
        """A state entry: a group closed without rows is a loss, counted once however often it is written."""
        try:
            group_id = lost_group(value)
        except SchemaError as exc:
            log.debug("ignoring a bad record on %s: %s", self._state_topic, exc)
            return
        if group_id is None or group_id in self._dead:
            return
        self._dead[group_id] = None
        if len(self._dead) > RECENT_LOSSES:
            self._dead.popitem(last=False)
        self.on_lost(1)

    def _matches(self, value: bytes) -> bool:
        try:
            return self._trainer_id is None or TrainerVersion.from_bytes(value).trainer_id == self._trainer_id
        except SchemaError:
            return False

    def _apply(self, key: bytes | None, value: bytes) -> None:
        try:
            record = TrainerVersion.from_bytes(value)
        except SchemaError as exc:
            log.warning("ignoring a bad record on %s (key %r): %s", self._topic, key, exc)
            return
        if self._trainer_id is not None and record.trainer_id != self._trainer_id:
            return
        new = self._trainer_losses.new_losses(record.run, record.lost_groups)
        if new:
            self.on_lost(new)
        self.observe(record.version, record.batch_groups)

    def close(self) -> None:
        """Stop following the topics and release every waiter; the follower closes its consumer."""
        super().close()
        self._stop.set()
        if self._ticking == threading.get_ident():
            return  # called from the follower's own tick: it finishes when the tick returns
        deadline = self._runtime.monotonic() + 10
        while not self._stopped.is_set() and self._runtime.monotonic() < deadline:
            self._runtime.sleep(0.02)
