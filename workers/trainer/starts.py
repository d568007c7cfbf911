"""Where a partition assigned to the trainer starts reading, and why it waits until that is known.

A partition's start is its committed offset with the resolved records past it that the commit names,
or, for a partition a restored checkpoint names, the checkpoint's mark (read from the commit if that
is lower, so rows of records trained before the mark are cleared). Until the commit is read the
partition must not be read at all: read from an empty position, records the commit named resolved,
whose rows are gone on purpose, look new and are handed back to be trained twice. `committed()` fails
for a while when the group coordinator moves (a broker failover), and it must not be called in the
rebalance callback: librdkafka runs that inside poll, and blocking there holds up the rebalance and
the heartbeats. So the callback only assigns the partitions paused (`FinalizedIntake._on_assign`),
and the next polls fetch their commits outside it, retried with backoff while they fail, and resume
each partition once its start is known (`FinalizedIntake._settle_starts`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.trainer.backoff import Backoff
from workers.trainer.checkpoint import PartitionMark

log = logging.getLogger("rlstream.trainer")

# How long one fetch of committed offsets may block a poll; a failed one is retried after a delay.
COMMITTED_TIMEOUT_S = 5.0
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0

Range = tuple[int, int]


@dataclass(frozen=True)
class Start:
    """Where a partition starts: its commit (`committed` < 0: none, where the consumer's offset reset puts
    it); or, when a restored checkpoint names it, at `offset` with the `resolved` ranges past it the
    checkpoint names."""

    partition: int
    committed: int
    restored: PartitionMark | None = None

    @property
    def offset(self) -> int | None:
        """Where reading starts; None: no commit and no mark (the consumer's offset reset decides)."""
        if self.restored is None:
            return self.committed if self.committed >= 0 else None
        # A checkpoint's mark: records before it were resolved when the state was cut; reading from the
        # commit, if lower, clears the rows a crash before `checkpoint_durable` left of them.
        return min(self.restored.offset, self.committed if self.committed >= 0 else 0)

    @property
    def resolved(self) -> list[Range]:
        """A restored partition's resolved ranges from its start: those before the mark, then the mark's."""
        assert self.restored is not None and self.offset is not None
        before = [(self.offset, self.restored.offset - 1)] if self.offset < self.restored.offset else []
        return before + list(self.restored.trained)


class PartitionStarts:
    """Assigned partitions whose start is not known yet (paused meanwhile), and when to ask again."""

    def __init__(self, topic: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.topic = topic
        self._waiting: dict[int, PartitionMark | None] = {}
        self._backoff = Backoff(clock, RETRY_FIRST_S, RETRY_MAX_S)

    def __contains__(self, partition: int) -> bool:
        return partition in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, partition: int, mark: PartitionMark | None) -> None:
        self._waiting[partition] = mark
        self._backoff.now()  # a new assignment is asked about at once

    def revoke(self, partition: int) -> PartitionMark | None:
        """The partition was revoked before its start was known: its restored mark, if any, for the next time."""
        return self._waiting.pop(partition, None)

    def waiting(self) -> list[int]:
        return sorted(self._waiting)

    def due(self) -> bool:
        return bool(self._waiting) and self._backoff.due()

    def marks(self) -> dict[int, PartitionMark]:
        """The restored checkpoint's marks of the partitions waiting: a state cut meanwhile must keep them."""
        return {p: mark for p, mark in self._waiting.items() if mark is not None}

    def restored(self, partition: int) -> bool:
        """Whether a restored checkpoint's mark decides where the partition starts."""
        return self._waiting.get(partition) is not None

    def known(self, partition: int, committed: int) -> Start:
        """The partition's commit was read: its start, and it waits no longer (unless it is `add`ed back)."""
        return Start(partition, committed, self._waiting.pop(partition))

    def settled(self) -> None:
        """Every partition asked about this time started: the next failure waits the shortest delay again."""
        self._backoff.succeeded()

    def failed(self, partitions: list[int], reason: str) -> None:
        """They could not start (a commit unreadable, a seek refused): they stay paused, and are asked about
        again after a delay, doubled from the last while no round starts them all."""
        delay = self._backoff.failed()
        log.warning(
            "%s partitions %s: not started (%s); not read until their commits are read and their positions set,"
            " retrying in %.1fs",
            self.topic,
            partitions,
            reason,
            delay,
        )
