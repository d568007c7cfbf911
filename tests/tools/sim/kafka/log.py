"""One partition's log: records and transaction markers by offset, the last stable offset, compaction, retention.

A single broker acknowledges with acks=all at once, so the high watermark is the log end. A
transactional record belongs to its transaction's run on this partition (`TxnRun`); the run's marker
(commit or abort) takes an offset of its own. A read_committed reader sees records below the last
stable offset (the first offset of the earliest run still open) that are not aborted; a
read_uncommitted one sees every data record below the high watermark. Markers and aborted records
take offsets a reader never sees; its position moves past them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

OPEN, COMMITTED, ABORTED = "open", "committed", "aborted"


@dataclass
class TxnRun:
    """A transaction's records on one partition, from its first offset to its marker."""

    producer_id: int
    first_offset: int
    state: str = OPEN


@dataclass
class Entry:
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] | None
    timestamp_ms: int
    run: TxnRun | None = None
    # "commit" or "abort" for a transaction marker; None for a data record.
    control: str | None = None

    def visible(self, read_committed: bool) -> bool:
        if self.control is not None:
            return False
        if self.run is None or not read_committed:
            return True
        return self.run.state == COMMITTED


@dataclass
class PartitionLog:
    topic: str
    partition: int
    entries: list[Entry] = field(default_factory=list)
    end_offset: int = 0
    log_start: int = 0
    open_runs: dict[int, TxnRun] = field(default_factory=dict)

    def append(
        self,
        key: bytes | None,
        value: bytes | None,
        headers,
        timestamp_ms: int,
        producer_id: int | None = None,
        transactional: bool = False,
    ) -> int:
        run = None
        if transactional:
            run = self.open_runs.get(producer_id)
            if run is None:
                run = self.open_runs[producer_id] = TxnRun(producer_id, self.end_offset)
        offset = self.end_offset
        self.entries.append(Entry(offset, key, value, headers, timestamp_ms, run))
        self.end_offset += 1
        return offset

    def end_run(self, producer_id: int, commit: bool, timestamp_ms: int) -> int | None:
        """Write the marker of `producer_id`'s open transaction here; None if it has none open."""
        run = self.open_runs.pop(producer_id, None)
        if run is None:
            return None
        run.state = COMMITTED if commit else ABORTED
        offset = self.end_offset
        self.entries.append(Entry(offset, None, None, None, timestamp_ms, run, "commit" if commit else "abort"))
        self.end_offset += 1
        return offset

    @property
    def last_stable_offset(self) -> int:
        return min((r.first_offset for r in self.open_runs.values()), default=self.end_offset)

    def high(self, read_committed: bool) -> int:
        return self.last_stable_offset if read_committed else self.end_offset

    def read(self, start: int, read_committed: bool, max_records: int) -> tuple[list[Entry], int]:
        """Up to `max_records` visible records from `start`, and the position after them.

        The position passes markers, aborted records and gaps up to the reader's limit (the last
        stable offset or the high watermark) when fewer records than asked were found.
        """
        limit = self.high(read_committed)
        out: list[Entry] = []
        i = bisect.bisect_left(self.entries, start, key=lambda e: e.offset)
        position = max(start, self.log_start)
        while i < len(self.entries) and self.entries[i].offset < limit:
            entry = self.entries[i]
            if entry.visible(read_committed):
                if len(out) >= max_records:
                    return out, position
                out.append(entry)
            position = entry.offset + 1
            i += 1
        return out, max(position, limit)

    def offset_for_time(self, timestamp_ms: int) -> int:
        for e in self.entries:
            if e.control is None and e.timestamp_ms >= timestamp_ms:
                return e.offset
        return -1

    def compact(self, upto: int, *, drop_tombstones: bool = False) -> list[int]:
        """Compaction of everything below `upto`: aborted records go, then only the last record of each
        key among those below `upto` stays (a tombstone too, unless `drop_tombstones`). Records at or
        above `upto` (the active segment, which the cleaner never touches) stay and shadow nothing.
        Markers stay. Returns the offsets removed."""
        latest: dict[bytes | None, int] = {}
        for e in self.entries:
            if e.offset >= upto:
                break
            if e.control is None and (e.run is None or e.run.state == COMMITTED):
                latest[e.key] = e.offset
        keep: list[Entry] = []
        removed: list[int] = []
        for e in self.entries:
            if e.offset >= upto or e.control is not None or (e.run is not None and e.run.state == OPEN):
                drop = False
            elif e.run is not None and e.run.state == ABORTED:
                drop = True
            else:
                drop = latest.get(e.key) != e.offset or (drop_tombstones and e.value is None)
            if drop:
                removed.append(e.offset)
            else:
                keep.append(e)
        self.entries = keep
        return removed

    def expire(self, now_ms: int, retention_ms: int) -> int:
        """Time retention: records older than `retention_ms` leave from the start; returns the new log start.

        The broker deletes whole segments; this deletes per record (the most a broker can delete).
        The log start never passes the last stable offset.
        """
        limit = self.last_stable_offset
        cut = 0
        while cut < len(self.entries) and self.entries[cut].offset < limit:
            if self.entries[cut].timestamp_ms >= now_ms - retention_ms:
                break
            cut += 1
        if cut:
            self.log_start = self.entries[cut - 1].offset + 1
            del self.entries[:cut]
        return self.log_start
