"""Where the trainer stands in one partition of the finalized topic, and what its offset commits say.

A partition's committed offset is its first record not yet resolved: a group held, ready, or yielded
and not released; a duplicate waiting for its original; a dead letter not yet acknowledged; or a
resolved record whose rows are still to be cleared (`clears.py`). Records past it that are resolved
already (released, evicted, dead-lettered) are named in the commit's metadata as offset ranges, so a
restarted trainer reading them again knows they were consumed: their rows are gone from TQ on
purpose, which is no alarm (or left for it to clear). Any other group whose rows are missing is one.

The metadata is `rlstream.trainer/1:` and comma-separated ranges `gap.length` (base 36), each gap
counted from the end of the previous range (the first from the committed offset). Ranges run across
offsets that never reach a consumer (transaction markers, aborted records), so their number is at
most the number of unresolved records plus one, bounded by backpressure. Past `MAX_METADATA_CHARS`
(the broker refuses commit metadata over `offset.metadata.max.bytes`, 4096 by default), about 870
alternating ranges, they travel on the progress topic instead (`progress.py`) and the metadata is
`rlstream.trainer/2:<token>:<chunks>`, naming the entry the commit relies on.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

METADATA_PREFIX = "rlstream.trainer/1:"  # the ranges inline
CARRIED_PREFIX = "rlstream.trainer/2:"  # the ranges on the progress topic, under the token named
MAX_METADATA_CHARS = 3500

Range = tuple[int, int]  # first and last offset, inclusive


def _b36(n: int) -> str:
    if n < 0:
        raise ValueError(f"commit metadata cannot count {n} (ranges must be sorted and past the offset)")
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if n == 0:
            return out


def encode_ranges(base: int, ranges: Iterable[Range], limit: int = MAX_METADATA_CHARS) -> tuple[str, bool]:
    """Commit metadata naming `ranges` (sorted, disjoint, all past `base`; none: ""); whether some were left out."""
    parts: list[str] = []
    size, prev = len(METADATA_PREFIX), base
    for first, last in ranges:
        item = f"{_b36(first - prev)}.{_b36(last - first)}"
        if size + len(item) + 1 > limit:
            return METADATA_PREFIX + ",".join(parts), True
        parts.append(item)
        size += len(item) + 1
        prev = last
    return (METADATA_PREFIX + ",".join(parts) if parts else ""), False


def decode_ranges(base: int, metadata: str | None) -> list[Range]:
    """The ranges a commit at `base` named; [] for no metadata or another writer's; ValueError if malformed."""
    if not metadata or not metadata.startswith(METADATA_PREFIX):
        return []
    body = metadata[len(METADATA_PREFIX) :]
    ranges: list[Range] = []
    prev = base
    for item in body.split(",") if body else []:
        gap, sep, length = item.partition(".")
        if not sep:
            raise ValueError(f"commit metadata range {item!r} is not gap.length")
        first = prev + int(gap, 36)
        last = first + int(length, 36)
        # The first range may start at the committed offset itself (a predecessor resolved the next
        # record already); later ones start past the one before.
        if first < prev or (ranges and first == prev) or last < first:
            raise ValueError(f"commit metadata range {item!r} overlaps the one before or goes backwards")
        ranges.append((first, last))
        prev = last
    return ranges


def carried_metadata(token: str, chunks: int) -> str:
    """Commit metadata naming the progress entry (`token`, in `chunks` chunks) that holds the commit's ranges."""
    if not token or ":" in token or chunks < 1:
        raise ValueError(f"a progress token must be non-empty without ':' and chunks >= 1, got {token!r}, {chunks}")
    return f"{CARRIED_PREFIX}{token}:{chunks:x}"


def carried(metadata: str | None) -> tuple[str, int] | None:
    """(token, chunks) when the metadata names a progress entry; None for other metadata; ValueError if malformed."""
    if not metadata or not metadata.startswith(CARRIED_PREFIX):
        return None
    token, sep, chunks = metadata[len(CARRIED_PREFIX) :].rpartition(":")
    try:
        count = int(chunks, 16) if sep and token else 0
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"commit metadata {metadata[:80]!r} names no progress entry as token:chunks")
    return token, count


def runs(resolved: Iterable[int], unresolved: Iterable[int]) -> list[Range]:
    """Ranges covering the resolved offsets, broken only where an unresolved offset lies between them."""
    events = sorted([(o, True) for o in resolved] + [(o, False) for o in unresolved])
    out: list[Range] = []
    current: list[int] | None = None
    for offset, done in events:
        if done:
            current = [offset, offset] if current is None else [current[0], offset]
        elif current is not None:
            out.append((current[0], current[1]))
            current = None
    if current is not None:
        out.append((current[0], current[1]))
    return out


def _merged(ranges: list[Range]) -> list[Range]:
    """Sorted, with ranges that touch or overlap joined."""
    out: list[Range] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


@dataclass
class PartitionPosition:
    """One assigned partition: records read since the last commit, which are resolved, and what to commit."""

    prior: list[Range] = field(default_factory=list)  # resolved by a predecessor, as its commit named them
    resolved: set[int] = field(default_factory=set)  # resolved by this consumer, past the committed offset
    position: int | None = None  # the next offset to read
    committed: tuple[int, tuple[Range, ...]] | None = None  # the last commit: its offset and the ranges it named
    start: int | None = None  # where reading starts (committed or restored offset), if known

    @classmethod
    def from_commit(cls, offset: int, ranges: Iterable[Range] = ()) -> PartitionPosition:
        """From the partition's committed offset (< 0: none) and the resolved ranges its commit names."""
        if offset < 0:
            return cls()
        ranges = tuple(ranges)
        return cls(prior=list(ranges), committed=(offset, ranges), start=offset)

    @classmethod
    def from_state(cls, offset: int, trained: list[Range]) -> PartitionPosition:
        """From a checkpoint's mark: reading starts at `offset`, and `trained` records are resolved already."""
        return cls(prior=sorted(trained), start=offset)

    def read(self, offset: int) -> bool:
        """Note the record at `offset` as read; True when a predecessor resolved it already (it is then resolved)."""
        self.position = offset + 1
        i = bisect.bisect_right(self.prior, (offset, float("inf"))) - 1
        if i >= 0 and self.prior[i][0] <= offset <= self.prior[i][1]:
            self.resolved.add(offset)
            return True
        return False

    def resolve(self, offset: int) -> None:
        self.resolved.add(offset)

    def snapshot(self, unresolved: Collection[int], held: Collection[int] = ()) -> tuple[int, list[Range]] | None:
        """(first unresolved offset, resolved ranges past it) given the unresolved offsets read; None before any.

        `held` are resolved records the offset must not pass yet (their rows are still to be cleared): the
        offset stops at the first of them, and the ranges name them as resolved.
        """
        if self.position is None:
            return None if self.start is None else (self.start, list(self.prior))
        stops = [*unresolved, *held]
        safe = min(stops) if stops else self.position
        self.resolved = {o for o in self.resolved if o >= safe}
        ranges = runs(self.resolved, [o for o in unresolved if o > safe])
        ranges += [(max(first, self.position), last) for first, last in self.prior if last >= self.position]
        return safe, _merged(ranges)

    def commit_point(self, unresolved: Collection[int], held: Collection[int] = ()) -> tuple[int, list[Range]] | None:
        """(offset, resolved ranges past it) to commit given the unresolved offsets read; None before any record."""
        return self.snapshot(unresolved, held) if self.position is not None else None

    def names(self, offset: int) -> bool:
        """Whether the last commit passed the record at `offset` or named it resolved."""
        if self.committed is None:
            return False
        base, ranges = self.committed
        if offset < base:
            return True
        i = bisect.bisect_right(ranges, (offset, float("inf"))) - 1
        return i >= 0 and ranges[i][0] <= offset <= ranges[i][1]
