"""When the TQ rows of a resolved finalized record may go: never before a commit a successor can read says
the record was consumed.

Rows cleared first and committed after can be lost to a crash or a failed commit in between: the next
trainer reads the record again from the old commit, finds its rows gone and reports a trained group as
data loss. So rows go only once the record is named resolved where a successor looks:

- plain (`deferred=False`): once a commit of the consumer's offsets names the record resolved. That
  commit stops short of the record (`PartitionPosition.snapshot`'s `held`), so a trainer dying between the
  commit and the clear leaves a successor that reads the record again, sees it named, and clears its
  rows; the next commit passes it once the rows are gone. A failed commit keeps the rows, and the
  successor trains the group again: at least once, never reported lost.
- checkpointed (`deferred=True`): once a durable checkpoint covers the ack (each deferral is numbered;
  a state's `cut` is the last number it covers), after the commit that names the records
  (`ExperienceConsumer.checkpoint_durable`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from streams.tq import KVStore


class RowClears:
    """Rows of resolved records, each cleared once a commit (or a durable checkpoint) names its record."""

    def __init__(self, store: KVStore, partition: str, *, deferred: bool):
        self._store = store
        self._partition = partition
        self.deferred = deferred
        self._seq = 0
        self._kept: list[tuple[int, int, list[str]]] = []  # deferred: (ack number, partition, sample ids)
        self._held: dict[int, dict[int, list[str]]] = {}  # plain: partition -> record offset -> sample ids

    def clear(self, sample_ids: list[str], partition: int, offset: int) -> None:
        """The rows of the resolved record at `partition`@`offset`: cleared once a commit names it."""
        if not sample_ids:
            return
        if self.deferred:
            self._seq += 1
            self._kept.append((self._seq, partition, sample_ids))
            return
        self._held.setdefault(partition, {}).setdefault(offset, []).extend(sample_ids)

    # ----- plain -------------------------------------------------------------------------------

    def held(self, partition: int) -> list[int]:
        """Offsets of the partition's records whose rows wait for a commit naming them."""
        return list(self._held.get(partition, ()))

    def release_named(self, names: Callable[[int, int], bool]) -> int:
        """Clear the rows of records the last commit names (`names(partition, offset)`); how many records.

        One TQ call; if it fails nothing is forgotten, and the next commit round tries again.
        """
        done = [(part, o) for part, by_offset in self._held.items() for o in by_offset if names(part, o)]
        ids = list(dict.fromkeys(s for part, o in done for s in self._held[part][o]))
        if ids:
            self._store.clear(self._partition, ids)
        for part, o in done:
            del self._held[part][o]
            if not self._held[part]:
                del self._held[part]
        return len(done)

    def drop(self, partition: int) -> None:
        """The partition was revoked: its next owner reads these records again and deals with their rows."""
        self._held.pop(partition, None)

    # ----- checkpointed ------------------------------------------------------------------------

    @property
    def cut(self) -> int:
        return self._seq

    @property
    def kept_rows(self) -> int:
        return sum(len(ids) for _, _, ids in self._kept) + sum(len(v) for p in self._held.values() for v in p.values())

    def due_through(self, cut: int) -> bool:
        """Whether any rows are deferred up to `cut`."""
        return any(seq <= cut for seq, _, _ in self._kept)

    def release_through(self, cut: int, waiting: Collection[int] = ()) -> int:
        """Clear the rows deferred up to `cut` (a durable checkpoint covers them) but those of the `waiting`
        partitions (the commit naming their records has not landed yet); returns how many."""
        done = [(seq, part, ids) for seq, part, ids in self._kept if seq <= cut and part not in waiting]
        flat = [s for _, _, ids in done for s in ids]
        if flat:
            self._store.clear(self._partition, flat)  # first: if it fails they are still due
        self._kept = [k for k in self._kept if k[0] > cut or k[1] in waiting]
        return len(flat)
