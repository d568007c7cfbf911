"""Where a trainer's commit keeps the resolved records past its offset: in its metadata, or on the progress topic.

A commit names the records past its offset that are resolved already, so a successor reading them
again knows they were consumed (their rows are gone on purpose). Up to `MAX_METADATA_CHARS` the
ranges travel inline in the commit's metadata (`rlstream.trainer/1:`, `position.py`). Past that (about
870 alternating ranges, reachable with `max_waiting_groups` at 10,000) they go to the compacted
`<prefix>.trainer.progress` topic as `TrainerProgress` chunks (`schemas/trainer_progress.py`),
produced and acknowledged before the commit, whose metadata names them: `rlstream.trainer/2:<token>:<chunks>`.
Nothing is left out at any size.

The keys are the chunk's (consumer group, topic, partition, token, chunk), one per entry, not one per
partition: an entry produced for a commit that then failed, or by a trainer that had lost the
partition, would otherwise replace the one the standing commit relies on, and compaction could remove
that for good. A reader takes the entry whose token and chunk count the commit names, at or below its
offset, and no other. Each trainer tombstones the entries no commit relies on any more once a later
commit of its own has landed: its own earlier ones, and those it found (a predecessor's, or ones
written for commits that failed). A commit that raised may still have landed (a timeout), so its
entry stays until a later commit lands; while commits keep failing, a partition writes at most
`MAX_ATTEMPTS` entries, then asks the broker for its standing commit (`Commits`): the attempt it
names landed, and the others go. A trainer that dies before its tombstones leaves entries a successor
finds and removes: on assignment when a commit it reads names an entry (the topic is read then, once),
else before it writes its own first entry for the partition. So a partition has live at most its
committed entry, `MAX_ATTEMPTS` more of its owner's, and those one predecessor left (a predecessor that
wrote any removed those of the one before), bounded by construction.

A commit naming the same resolved set as the one before at a higher offset (the commit passing records
whose rows are gone, after the one that named them) names that commit's entry again instead of writing
its own: an entry at offset o read for a commit at o' >= o gives its ranges from o' on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from schemas.errors import SchemaError
from schemas.trainer_progress import MAX_CHUNK_RANGES, TrainerProgress, join_chunks, progress_chunks
from streams.errors import DeliveryError
from streams.producer import Outgoing
from workers.trainer.backoff import Backoff
from workers.trainer.clients import Acked, TrainerClients
from workers.trainer.position import carried, carried_metadata, decode_ranges, encode_ranges

log = logging.getLogger("rlstream.trainer")

Range = tuple[int, int]
Entry = tuple[int, tuple[Range, ...], str]  # an entry written: its offset, its ranges, the metadata naming it
Found = dict[int, dict[str, dict[int, bytes]]]  # entries on the topic: partition -> token -> chunk -> value
# How long a write of progress entries may take; one that failed is not tried again for a while.
SEND_TIMEOUT_S = 10.0
# Entries a partition may have written for commits not known to have landed, before its commits reuse one.
MAX_ATTEMPTS = 4
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0


def from_offset(ranges: Iterable[Range], offset: int) -> list[Range]:
    """The part of `ranges` at or past `offset`."""
    return [(max(first, offset), last) for first, last in ranges if last >= offset]


class ProgressUnavailable(Exception):
    """The progress entry a commit needs could not be written, or one a commit names could not be read."""


class NotAskedYet(ProgressUnavailable):
    """The call failed a moment ago (said then, at WARNING) and is not made again before its delay has passed."""


@dataclass(frozen=True)
class CommitRanges:
    """What the commits read on assignment name: per partition its resolved ranges, or why they are unknown."""

    ranges: dict[int, list[Range]]
    unreadable: dict[int, str]


def entry_key(consumer_group: str, topic: str, partition: int, token: str, chunk: int) -> bytes:
    return json.dumps([consumer_group, topic, partition, token, chunk], separators=(",", ":")).encode()


def _parse_key(key: bytes | None) -> tuple[str, str, int, str, int] | None:
    try:
        group, topic, partition, token, chunk = json.loads(key or b"")
    except (ValueError, TypeError):
        return None
    return group, topic, partition, token, chunk


class ProgressCarrier:
    """One trainer's progress entries: written for the commits that need them, read on assignment, tombstoned."""

    def __init__(
        self,
        clients: TrainerClients,
        progress_topic: str,
        consumer_group: str,
        topic: str,
        run: str,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        chunk_ranges: int = MAX_CHUNK_RANGES,
    ):
        # `chunk_ranges`: ranges per entry (a test's fewer, to see entries of many chunks).
        self._chunk_ranges = chunk_ranges
        self._clients = clients
        self.progress_topic = progress_topic
        self._group = consumer_group
        self._topic = topic
        self._run = run
        self._clock = clock
        self._wall_ms = wall_ms
        self._producer: Acked | None = None
        self._seq = 0
        # Per partition, the entries on the topic this trainer knows of (token -> chunk numbers): written
        # by it, or found on assignment. All but the one its last commit names are tombstoned.
        self._live: dict[int, dict[str, set[int]]] = {}
        # Per partition, the entries written since its last commit landed: (offset, ranges, metadata).
        # A commit that failed may still have landed, so they stay live until a later one is known to.
        self._attempts: dict[int, list[Entry]] = {}
        # Per partition, the entry its last commit landed naming, which a later commit may name again.
        self._landed: dict[int, Entry] = {}
        self._backoff = Backoff(clock, RETRY_FIRST_S, RETRY_MAX_S)
        # The partitions whose commits this trainer read (assigned to it), and of those, the ones whose
        # entries on the topic it has looked for (found ones are in `_live`, to be tombstoned).
        self._owned: set[int] = set()
        self._swept: set[int] = set()
        # What the last read of the topic found (partition -> token -> chunk -> its value, decoded only when
        # a commit names it), while partitions wait for their starts: a retry looks there, and reads again
        # only for a token not found.
        self._found: Found | None = None

    # ----- writing -----------------------------------------------------------------------------

    def metadata(self, partition: int, offset: int, ranges: list[Range]) -> str:
        """The metadata of a commit at `offset` naming `ranges`: the ranges if they fit, else naming an entry
        written and acknowledged now; `ProgressUnavailable` if it cannot be written (the commit must wait).

        An entry that names this point already (the last one written, or the one the last commit landed
        naming, at or below `offset` with the same ranges from `offset` on) is named again, not written.
        Past `MAX_ATTEMPTS` entries written for commits that raised (commits failing while the trainer moves
        on) none is written until `reconcile` has learnt from the standing commit which of them landed.
        """
        inline, truncated = encode_ranges(offset, ranges)
        if not truncated:
            return inline
        attempts = self._attempts.setdefault(partition, [])
        for entry in (*attempts[-1:], self._landed.get(partition)):
            if entry is not None and entry[0] <= offset and from_offset(entry[1], offset) == ranges:
                return entry[2]
        if len(attempts) >= MAX_ATTEMPTS:
            raise ProgressUnavailable(f"{self._topic}[{partition}]: {len(attempts)} commits not known to have landed")
        if not self._backoff.due():
            raise NotAskedYet(f"{self.progress_topic}: waiting before writing again after a failed write")
        self._sweep(partition)
        self._seq += 1
        token = f"{self._run[:16]}.{self._seq:x}"
        now_ms = self._wall_ms()
        chunks = progress_chunks(self._group, self._topic, partition, offset, token, ranges, now_ms, self._chunk_ranges)
        # Known before it is sent: a write that fails half way leaves chunks to tombstone.
        self._live.setdefault(partition, {})[token] = set(range(len(chunks)))
        records = [Outgoing(self.progress_topic, self._key(partition, token, c.chunk), c.to_bytes()) for c in chunks]
        try:
            self._acked().send(records, timeout_s=SEND_TIMEOUT_S)
        except DeliveryError as exc:
            delay = self._backoff.failed()
            raise ProgressUnavailable(
                f"{self._topic}[{partition}]: {len(ranges)} resolved ranges past offset {offset} need"
                f" {self.progress_topic}, which did not take them ({exc}); the commit waits, next try in {delay:.0f}s"
            ) from exc
        self._backoff.succeeded()
        metadata = carried_metadata(token, len(chunks))
        attempts.append((offset, tuple(ranges), metadata))
        return metadata

    def attempts_full(self, partition: int) -> bool:
        """Whether the partition has written `MAX_ATTEMPTS` entries for commits not known to have landed."""
        return len(self._attempts.get(partition, ())) >= MAX_ATTEMPTS

    def committed(self, partition: int, metadata: str) -> None:
        """A commit with `metadata` landed: the entries it no longer needs are tombstoned."""
        attempts = self._attempts.pop(partition, [])
        named = carried(metadata)
        keep = named[0] if named is not None else None
        landed = [entry for entry in attempts if entry[2] == metadata]
        if landed:
            self._landed[partition] = landed[0]
        elif keep is None:
            self._landed.pop(partition, None)
        self._tombstone(partition, [t for t in self._live.get(partition, {}) if t != keep])

    def reconcile(self, partition: int, standing: str | None) -> tuple[int, list[Range]] | None:
        """The partition's standing commit has metadata `standing`: if it is one of the commits that raised,
        that one landed after all (its (offset, ranges) are returned) and the rest are tombstoned; if none,
        none of their entries is needed, and they are tombstoned."""
        for offset, ranges, metadata in self._attempts.get(partition, []):
            if metadata == standing:
                self.committed(partition, metadata)
                return offset, list(ranges)
        tokens = [carried(m)[0] for _, _, m in self._attempts.pop(partition, [])]
        self._tombstone(partition, tokens)
        return None

    def _tombstone(self, partition: int, tokens: list[str]) -> None:
        live = self._live.get(partition, {})
        graves = [
            Outgoing(self.progress_topic, self._key(partition, t, chunk), None)
            for t in tokens
            for chunk in sorted(live.get(t, ()))
        ]
        if not graves:
            return
        try:
            self._acked().send(graves, timeout_s=SEND_TIMEOUT_S)
        except DeliveryError as exc:  # tried again after the next commit; a successor finds them otherwise
            log.debug("%s: tombstones of %d entries not acknowledged: %s", self.progress_topic, len(graves), exc)
            return
        for t in tokens:
            live.pop(t, None)

    def drop(self, partition: int) -> None:
        """The partition was revoked: its entries are its next owner's to keep or tombstone, never this one's."""
        self._live.pop(partition, None)
        self._attempts.pop(partition, None)
        self._landed.pop(partition, None)
        self._owned.discard(partition)
        self._swept.discard(partition)

    # ----- reading -----------------------------------------------------------------------------

    def read(self, committed: Iterable) -> CommitRanges:
        """The resolved ranges the commits read on assignment name (`committed()` entries: offset < 0 is none).

        Inline metadata is decoded (malformed: logged, nothing named). Metadata naming an entry is looked up
        on the progress topic, read then (once for all of them) and not at all when no commit names one:
        what was found serves later calls, and the topic is read again only for a token not found. An entry
        missing or not the commit's (chunks lost, of another count or above the commit's offset) leaves its
        partition unreadable: it must not be read as if nothing were resolved.
        """
        ranges: dict[int, list[Range]] = {}
        unreadable: dict[int, str] = {}
        wanted: dict[int, tuple[int, str, int]] = {}
        for tp in committed:
            self._owned.add(tp.partition)
            if tp.offset < 0:
                ranges[tp.partition] = []
                continue
            try:
                named = carried(tp.metadata)
                if named is None:
                    ranges[tp.partition] = decode_ranges(tp.offset, tp.metadata)
                else:
                    wanted[tp.partition] = (tp.offset, *named)
            except ValueError as exc:
                log.warning("%s[%d]: %s; consumed groups may be handed back", self._topic, tp.partition, exc)
                ranges[tp.partition] = []
        if not wanted:  # leftovers of earlier trainers are looked for before this one writes (`_sweep`)
            return CommitRanges(ranges, unreadable)
        fresh = self._found is None
        for attempt in range(2):  # what the last read found, then (a token not found there) a read now
            if fresh or attempt:
                try:
                    self._found = self._entries()
                except Exception as exc:  # noqa: BLE001 - any failure to read leaves those partitions unknown
                    reason = f"{self.progress_topic} unreadable: {type(exc).__name__}: {exc}"
                    return CommitRanges(ranges, dict.fromkeys(wanted, reason))
            unreadable = {}
            for part, (offset, token, count) in wanted.items():
                try:
                    ranges[part] = self._join(part, offset, token, count)
                    # Live (found now, or only after the partition was first looked at): tombstoned once
                    # a later commit needs it no more.
                    self._live.setdefault(part, {})[token] = set(range(count))
                except SchemaError as exc:
                    unreadable[part] = f"the progress entry its commit names: {exc}"
            if not unreadable or fresh or attempt:
                break
        self._note_found()
        return CommitRanges(ranges, unreadable)

    def _join(self, partition: int, offset: int, token: str, count: int) -> list[Range]:
        """The ranges from `offset` on of entry `token` in `count` chunks, as last read; SchemaError if not whole."""
        chunks = {
            c: TrainerProgress.from_bytes(v) for c, v in (self._found or {}).get(partition, {}).get(token, {}).items()
        }
        base = chunks[0].offset if 0 in chunks else offset
        if base > offset:
            raise SchemaError("trainer_progress.offset", f"token {token!r} is of a commit at {base}, past {offset}")
        return from_offset(join_chunks(list(chunks.values()), base, token, count), offset)

    def forget(self) -> None:
        """No partition waits for its start: what the last read found is not needed any more."""
        self._found = None

    def _sweep(self, partition: int) -> None:
        """Before this trainer's first entry for `partition`, the entries earlier trainers left for the partitions
        it owns, so that its next landed commit tombstones them (a failed read leaves them to a successor)."""
        self._owned.add(partition)
        if partition in self._swept:
            return
        kept = self._found
        try:
            self._found = kept if kept is not None else self._entries()
        except Exception as exc:  # noqa: BLE001 - tidying only: the commit goes on without it
            log.warning("%s unreadable, entries earlier trainers left stay: %s", self.progress_topic, exc)
            self._swept |= self._owned
            return
        self._note_found()
        self._found = kept  # read for this only: not kept

    def _note_found(self) -> None:
        """The entries found for owned partitions not looked at yet are live: to be tombstoned when not needed."""
        for part in self._owned - self._swept:
            self._live.setdefault(part, {}).update({t: set(c) for t, c in (self._found or {}).get(part, {}).items()})
            self._swept.add(part)

    def _entries(self) -> Found:
        """This consumer group's live entries for the topic, as read now: partition -> token -> chunk -> value.

        Only keys are parsed here: a value is decoded when a commit names its entry, so superseded entries
        not compacted away yet cost their bytes, not their decoding."""
        out: Found = {}
        for r in self._clients.read(self.progress_topic):  # in offset order: a later record replaces an earlier
            key = _parse_key(r.key)
            if key is None or key[:2] != (self._group, self._topic):
                continue
            _, _, part, token, chunk = key
            if r.value is None:
                out.get(part, {}).get(token, {}).pop(chunk, None)
            else:
                out.setdefault(part, {}).setdefault(token, {})[chunk] = r.value
        return out

    # ----- clients -----------------------------------------------------------------------------

    def _key(self, partition: int, token: str, chunk: int) -> bytes:
        return entry_key(self._group, self._topic, partition, token, chunk)

    def _acked(self) -> Acked:
        if self._producer is None:
            self._producer = self._clients.acked_producer()
        return self._producer

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
