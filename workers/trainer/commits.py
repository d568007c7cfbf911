"""The trainer's offset commits, in the order rows may leave TQ (`clears.py`), with the resolved set each names.

Without checkpoints a round commits what is resolved with the records whose rows still wait named but
not passed, clears those rows, then commits past them. With checkpoints a durable checkpoint commits
from where the commit stands naming everything it trained, clears the rows it covers, then commits its
marks; each step is retried by the next round until it is done. Every commit's resolved ranges go in
its metadata, or on the progress topic first when they do not fit (`progress.py`): a commit whose
entry was not acknowledged is not made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from workers.trainer.backoff import Backoff
from workers.trainer.clears import RowClears
from workers.trainer.outbox import Outbox
from workers.trainer.pending import PendingGroups
from workers.trainer.progress import NotAskedYet, ProgressCarrier, ProgressUnavailable
from workers.trainer.starts import COMMITTED_TIMEOUT_S, RETRY_FIRST_S, RETRY_MAX_S

log = logging.getLogger("rlstream.trainer")

Range = tuple[int, int]
Point = tuple[int, int, list[Range]]  # partition, offset, the resolved ranges past it

# Commit failures that lose a race with a rebalance (or follow a max.poll.interval.ms leave).
_RETRY_COMMIT = (
    KafkaError._NO_OFFSET,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError._ASSIGNMENT_LOST,
    KafkaError._STATE,
)


class Commits:
    """One consumer's commits of the finalized topic: a round of what is resolved, or a durable checkpoint's."""

    def __init__(
        self,
        consumer,
        topic: str,
        pending: PendingGroups,
        clears: RowClears,
        outbox: Outbox,
        carrier: ProgressCarrier,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._consumer = consumer
        self._topic = topic
        self._pending = pending
        self._clears = clears
        self._outbox = outbox
        self._carrier = carrier
        # A durable checkpoint's commits, until done: one naming its records, its rows, then its marks.
        self._naming: list[Point] = []
        self._release_cut: int | None = None
        self._durable: list[Point] = []
        # A read of the standing commit blocks up to COMMITTED_TIMEOUT_S: while it fails, not on every commit.
        self._standing = Backoff(clock, RETRY_FIRST_S, RETRY_MAX_S)

    def round(self) -> None:
        """Commit what is resolved; rows waiting for a commit naming their records go after it, and the
        offset passes those records with the next commit."""
        if self._clears.deferred:  # offsets move with durable checkpoints only
            self._durable_steps()
            return
        what = f"{self._topic} offsets"
        points = self._pending.commit_points(self._outbox.offsets, self._clears.held)
        if points and len(self.commit(points, what)) == len(points):
            return
        # The rows of records a commit landed naming (per partition: another's may still wait) go now.
        if self._clears.release_named(self._pending.named):
            self.commit(self._pending.commit_points(self._outbox.offsets, self._clears.held), what)

    def durable(self, marks: list[Point], naming: list[Point], release_cut: int | None) -> None:
        """A durable checkpoint's commits: `naming` first (none: nothing to clear), the rows up to
        `release_cut`, then `marks`; done now as far as the broker lets, the rest by later rounds."""
        self._durable, self._naming = marks, naming if release_cut is not None else []
        self._release_cut = release_cut
        self._durable_steps()

    def _durable_steps(self) -> None:
        what = f"{self._topic} offsets of a durable checkpoint"
        # Each step keeps only the points not committed yet, partition by partition: a partition's rows go
        # once its naming commit landed, and its mark is committed once its rows are gone.
        self._naming = self.commit(self._naming, what)
        waiting = {part for part, _, _ in self._naming}
        if self._release_cut is not None:
            self._clears.release_through(self._release_cut, waiting)
            if not waiting:
                self._release_cut = None
        later = [point for point in self._durable if point[0] in waiting]
        self._durable = later + self.commit([point for point in self._durable if point[0] not in waiting], what)

    def commit(self, points: list[Point], what: str) -> list[Point]:
        """Commit the points, each naming its resolved ranges; the points that could not be committed now
        (logged), to be tried again. A partition whose ranges need an entry that cannot be written (or whose
        standing commit must be read first and cannot be) waits alone: the others are committed."""
        if not points:
            return []
        held: dict[int, ProgressUnavailable] = {}
        full = sorted({p for p, _, _ in points if self._carrier.attempts_full(p)})
        try:
            self._reconcile(full)
        except ProgressUnavailable as exc:
            held.update(dict.fromkeys(full, exc))
        carried = []
        for part, offset, ranges in points:
            if part in held:
                continue
            try:
                # The ranges inline, or an entry naming them written (and acknowledged) first.
                carried.append((part, offset, ranges, self._carrier.metadata(part, offset, ranges)))
            except ProgressUnavailable as exc:
                held[part] = exc
        for exc in {id(e): e for e in held.values()}.values():
            log.log(
                logging.DEBUG if isinstance(exc, NotAskedYet) else logging.WARNING, "commit of %s waits: %s", what, exc
            )
        waiting = [point for point in points if point[0] in held]
        if not carried:
            return waiting
        offsets = [TopicPartition(self._topic, part, offset, metadata=m) for part, offset, _, m in carried]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.fatal():
                raise
            # Retried by the next call; a record read again meanwhile is known to be resolved.
            level = logging.DEBUG if err.code() in _RETRY_COMMIT else logging.WARNING
            log.log(level, "commit of %s failed, retrying later: %s", what, err.str())
            return points
        for part, offset, ranges, m in carried:
            self._pending.committed(part, offset, ranges)
            self._carrier.committed(part, m)
        return waiting

    def _reconcile(self, partitions: list[int]) -> None:
        """Commits of these partitions raised often enough to leave `MAX_ATTEMPTS` entries each: the standing
        commits say which landed (a commit that timed out may have), so the others can go. One read for all,
        asked again after a delay while it fails."""
        if not partitions:
            return
        where = f"{self._topic}{partitions}"
        if not self._standing.due():
            raise NotAskedYet(f"{where}: standing commits unreadable, asked again later")
        try:
            tps = [TopicPartition(self._topic, p) for p in partitions]
            standing = self._consumer.committed(tps, timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            if exc.args[0].fatal():
                raise
            delay = self._standing.failed()
            raise ProgressUnavailable(
                f"{where}: standing commits unreadable ({exc}), next try in {delay:.1f}s"
            ) from exc
        errors = [f"[{tp.partition}] {tp.error.str()}" for tp in standing if tp.error is not None]
        if errors:
            delay = self._standing.failed()
            raise ProgressUnavailable(
                f"{where}: standing commits unreadable ({'; '.join(errors)}), next try in {delay:.1f}s"
            )
        self._standing.succeeded()
        for tp in standing:
            landed = self._carrier.reconcile(tp.partition, tp.metadata)
            if landed is not None:
                self._pending.committed(tp.partition, *landed)
