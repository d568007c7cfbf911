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

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from workers.trainer.clears import RowClears
from workers.trainer.outbox import Outbox
from workers.trainer.pending import PendingGroups
from workers.trainer.progress import ProgressCarrier, ProgressUnavailable
from workers.trainer.starts import COMMITTED_TIMEOUT_S

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

    def round(self) -> None:
        """Commit what is resolved; rows waiting for a commit naming their records go after it, and the
        offset passes those records with the next commit."""
        if self._clears.deferred:  # offsets move with durable checkpoints only
            self._durable_steps()
            return
        what = f"{self._topic} offsets"
        if not self.commit(self._pending.commit_points(self._outbox.offsets, self._clears.held), what):
            return
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
        if self._naming and not self.commit(self._naming, what):
            return
        self._naming = []
        if self._release_cut is not None:
            self._clears.release_through(self._release_cut)
            self._release_cut = None
        if self._durable and self.commit(self._durable, what):
            self._durable = []

    def commit(self, points: list[Point], what: str) -> bool:
        """Commit the points, each naming its resolved ranges; False, logged, when that cannot be done now."""
        if not points:
            return True
        try:
            for part in {p for p, _, _ in points if self._carrier.attempts_full(p)}:
                self._reconcile(part)
            # Each point's ranges inline, or an entry naming them written (and acknowledged) first.
            metadata = [self._carrier.metadata(part, offset, ranges) for part, offset, ranges in points]
        except ProgressUnavailable as exc:
            log.warning("commit of %s waits: %s", what, exc)
            return False
        carried = [(part, offset, ranges, m) for (part, offset, ranges), m in zip(points, metadata, strict=True)]
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
            return False
        for part, offset, ranges, m in carried:
            self._pending.committed(part, offset, ranges)
            self._carrier.committed(part, m)
        return True

    def _reconcile(self, partition: int) -> None:
        """Commits of the partition raised often enough to leave `MAX_ATTEMPTS` entries: the standing commit
        says which landed (a commit that timed out may have), so the others can go."""
        try:
            (tp,) = self._consumer.committed([TopicPartition(self._topic, partition)], timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            if exc.args[0].fatal():
                raise
            raise ProgressUnavailable(f"{self._topic}[{partition}]: committed offset unreadable ({exc})") from exc
        if tp.error is not None:
            raise ProgressUnavailable(f"{self._topic}[{partition}]: committed offset unreadable ({tp.error.str()})")
        landed = self._carrier.reconcile(partition, tp.metadata)
        if landed is not None:
            self._pending.committed(partition, *landed)
