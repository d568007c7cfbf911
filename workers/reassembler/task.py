"""One assigned receipts partition of a reassembler worker, in the manner of a Kafka Streams task.

A task owns everything the worker knows about its partition: the prompt groups, the read position,
the event-time clock, redrive counts, and what its next commit owes. A step feeds it records
(`intake`), asks for its `ready` groups, hands back their finalization outcomes to `prepare` (which
closes them and returns an immutable `PartitionCommit`), and after the transaction commits calls
`post_commit`. Revoking the partition drops the task; a failed transaction rebuilds every task from
the committed state, so nothing here needs undoing.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas import deadletter as dl
from schemas.deadletter import DeadLetter, bounded_key, bounded_message, bounded_original
from schemas.receipt import Receipt
from schemas.regenerate import STAGING_LOST, Regenerate, regenerated_group_id
from schemas.staged_rows import owned_by
from schemas.state import CLOSED, DEAD_LETTERED, FINALIZED, HANDED_BACK, OPEN, GroupState, PartitionProgress
from streams.consumer import Record
from streams.tq import KVStore
from workers.reassembler.commit import PartitionCommit, StateWrites
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.decode import Limits, Refused, decode_receipt, redrive_count, source_timestamp
from workers.reassembler.finalize import GroupOutcome
from workers.reassembler.groups import Intake, OpenGroup, PromptGroups
from workers.reassembler.restore import Restored
from workers.runtime import REAL_RUNTIME

_REFUSED = {
    Intake.DUPLICATE: dl.DUPLICATE_RECEIPT,
    Intake.INCONSISTENT: dl.INCONSISTENT_GROUP,
    Intake.LATE: dl.LATE_RECEIPT,
}


class PartitionTask:
    """The prompt groups and commit bookkeeping of one receipts partition."""

    def __init__(
        self,
        restored: Restored,
        store: KVStore,
        config: ReassemblerConfig,
        *,
        committed_offset: int | None = None,
        state_end: int = 0,
    ):
        self.groups: PromptGroups = restored.groups
        self.partition = restored.groups.partition
        self.store = store
        self.config = config
        # Next offset to read; None until a record was read since the task was (re)built.
        self.position: int | None = None
        # The input offset last committed for this partition (None: never). Sent again with a step that
        # writes state but moves no offset, so that a worker no longer in the group is fenced.
        self.committed_offset = committed_offset
        # Newest receipt timestamp read: the deadline clock while the partition is behind.
        self.max_ts = 0
        # Every state record of this partition written from here on lies at or after this offset.
        self.state_end = state_end
        # The furthest an uncommitted step before this task was built could have read: the one in
        # flight when the last owner stopped (or this worker's aborted step), max_poll_records past
        # what was read at the last commit. Until a commit reads past it, a group decided here may
        # have had rows put by that step (`abandoned.py`); None after.
        self._earlier_reach: int | None = restored.groups.emitted_through + config.max_poll_records
        # offset -> redrive count of buffered receipts that arrived redriven, for their dead letters.
        self._redriven: dict[int, int] = {}
        # Records were read or groups fell due since the last commit: progress and offset must move.
        self._dirty = False
        # Closed groups the restore forgot for capacity: tombstoned with the first commit.
        self._forgotten = list(restored.forgotten)
        self._staging_to_clear = restored.staging_to_clear
        # Closed entries again with staging_cleared, to record in the next commit once their keys are gone.
        self._cleared_to_record: list[GroupState] = []
        self._limits = Limits(config.max_group_size, config.max_calls_per_rollout, config.max_tokens_per_call)
        # This step's intake, until `prepare` hands it over.
        self._dead: list[DeadLetter] = []
        self._opened: list[GroupState] = []
        self._completed: dict[str, OpenGroup] = {}
        # Staging keys of refused receipts (late, duplicate, inconsistent): cleared once their dead
        # letters are committed, or their tensors would stay in TQ forever. (key, group, rollout).
        self._refused_staging: list[tuple[str, str, str]] = []

    @classmethod
    def resume(
        cls,
        restored: Restored,
        store: KVStore,
        config: ReassemblerConfig,
        *,
        committed_offset: int | None = None,
        state_end: int = 0,
        now_ms: int | None = None,
    ) -> PartitionTask:
        """A task for a restored partition; the staging its predecessor closed but left behind is
        `restored_staging`, for the worker to clear once it may write to TQ (see there). `now_ms` is
        the worker's wall clock (its runtime's; None: this process's)."""
        task = cls(restored, store, config, committed_offset=committed_offset, state_end=state_end)
        # A first-seen time written by a worker whose clock ran ahead would hold its group open (and
        # the committed offset back) until this clock caught up.
        now_ms = REAL_RUNTIME.wall_ms() if now_ms is None else now_ms
        opened = task.groups.restored_open_ms
        for gid, first_seen in opened.items():
            opened[gid] = min(first_seen, now_ms)
        if not config.clear_staging:  # the rows are not ours to clear (a replay run): recorded as they are
            task.restored_staging_cleared()
        return task

    @property
    def restored_staging(self) -> list[str]:
        """Staging keys of groups a predecessor closed and did not record cleared.

        Not cleared by the restore itself: a restore also follows a step aborted because the worker
        may be a zombie (its lease refused), and a zombie must not write to TQ at all. The worker
        clears them in its next step, once its lease allows, then calls `restored_staging_cleared`.
        """
        return [k for entry in self._staging_to_clear for k in entry.staging_keys]

    def restored_staging_cleared(self) -> None:
        """The `restored_staging` keys are gone: the next commit records their groups as cleared."""
        self._cleared_to_record.extend(_cleared(entry) for entry in self._staging_to_clear)
        self._staging_to_clear = ()

    @property
    def may_hold_earlier_attempt(self) -> bool:
        """Whether a group this task decides now may have had train rows put by an uncommitted earlier step."""
        return self._earlier_reach is not None

    @property
    def has_work(self) -> bool:
        """Whether the next step must commit for this partition even when no group is ready."""
        return bool(
            self._dirty
            or self._staging_to_clear
            or self._cleared_to_record
            or self._dead
            or self._opened
            or self._forgotten
            or self._completed
        )

    # ----- intake ----------------------------------------------------------------------------

    def intake(self, rec: Record, now_ms: int) -> None:
        """Take one receipts record of this partition, in offset order."""
        self.position = rec.offset + 1
        # Producer CreateTime is input: clamped to this worker's clock, so a far-future stamp can
        # neither cut every open group short nor keep its own group from ever falling due.
        timestamp = now_ms if rec.timestamp_ms < 0 else min(rec.timestamp_ms, now_ms)
        self.max_ts = max(self.max_ts, timestamp)
        self._dirty = True
        # A record at or below the recorded progress is read again after a restart: its dead
        # letters and OPEN entry are already committed and must not appear twice.
        reread = self.groups.rereading(rec.offset)
        decoded = decode_receipt(rec.value, self._limits, key=rec.key if rec.key is not None else b"")
        if isinstance(decoded, Refused):
            if not reread:
                self._dead.append(self._refused(rec, decoded.kind, decoded.message, now_ms))
            return
        redriven = redrive_count(rec.headers)
        # A redriven receipt's age is its original record's: redriving never makes a late one new.
        # A redrive that did not carry it (letters written before it was recorded) counts as old.
        event_ms = min(source_timestamp(rec.headers), timestamp) if redriven else timestamp
        # The operator fixed the cause of a dead-lettered group and redrove its receipts: nothing of
        # it reached the trainer, so it may open afresh, whatever the horizon says.
        reopened = bool(redriven) and not reread and self.groups.reopen_dead_lettered(decoded.group_id)
        outcome, group = self.groups.add(
            decoded, rec.offset, timestamp, (rec.key, rec.value or b""), event_ms=event_ms, reopened=reopened
        )
        if outcome in (Intake.ADDED, Intake.COMPLETED):
            if redriven:
                self._redriven[rec.offset] = redriven
            if group.first_offset == rec.offset and not reread:
                self._opened.append(_open_entry(group))
            if outcome is Intake.COMPLETED:
                self._completed[group.group_id] = group
        elif outcome is not Intake.REREAD_CLOSED:
            # Also when reread: a crash after the commit may have left the clear undone.
            self._refused_staging.extend(
                (c.staging_key, decoded.group_id, decoded.rollout_id) for c in decoded.manifest
            )
            if not reread:
                letter = self._refused(rec, _REFUSED[outcome], _refusal(decoded, outcome), now_ms)
                self._dead.append(msgspec.structs.replace(letter, source_timestamp_ms=event_ms))

    def _refused(self, rec: Record, kind: str, message: str, now_ms: int) -> DeadLetter:
        return DeadLetter(
            source_topic=rec.topic,
            source_partition=rec.partition,
            source_offset=rec.offset,
            source_key=bounded_key(rec.key),
            **bounded_original(rec.value or b""),
            error_kind=kind,
            message=bounded_message(message),
            worker_id=self.config.worker_id,
            time_ms=now_ms,
            redrive_count=redrive_count(rec.headers),
            source_timestamp_ms=max(0, min(rec.timestamp_ms, now_ms)),
        )

    # ----- deadlines -------------------------------------------------------------------------

    def clock(self, now_ms: int, *, caught_up: bool, paused: bool) -> int:
        """Deadline clock: wall time once the partition is read to its end, else the newest receipt's timestamp.

        A worker that restarts behind a backlog would otherwise find every group past its deadline
        although the missing receipts are already in Kafka, just not read yet. While paused for
        backpressure nothing new is read, so wall time runs: deadlines are what frees memory then.
        """
        if paused:
            return now_ms
        if self.position is None:
            return self.max_ts
        return now_ms if caught_up else self.max_ts

    def ready(self, clock_ms: int, timeout_ms: int) -> list[OpenGroup]:
        """Groups to finalize this step: those completed by this step's intake and those past their deadline."""
        ready = dict(self._completed)
        due = self.groups.due(clock_ms, timeout_ms)
        for g in due:
            ready.setdefault(g.group_id, g)
        if due:
            self._dirty = True
        return list(ready.values())

    # ----- commit cycle ----------------------------------------------------------------------

    def prepare(self, outcomes: Sequence[GroupOutcome], now_ms: int) -> PartitionCommit:
        """Close the finalized groups and hand over everything this partition owes the step's transaction."""
        forgotten = [*self._forgotten, *self.groups.forget(self.max_ts, int(self.config.closed_retention_s * 1000))]
        # Before this step's closings: every entry still needed lies at or after it.
        restore_from = self.groups.restore_from(self.state_end)
        finalized, dead, closed, handed = [], list(self._dead), [], []
        for o in outcomes:
            entry, letters = self._close(o, now_ms)
            closed.append(entry)
            dead.extend(letters)
            if o.finalized is not None:
                finalized.append(o.finalized)
            if o.handed_back:
                handed.append(self._hand_back(o.group, entry, now_ms))
        # Also when only closings moved it: a group read by one step (the pipelined step's overlapped poll)
        # and closed by the next, with no receipt between, must take the offset past it.
        moved = self._dirty or bool(outcomes)
        offset = self.groups.safe_offset(self.position) if moved and self.position is not None else None
        # Cleared-closed entries first: a redriven receipt may reopen the same group in this step,
        # and its OPEN entry must be the one compaction keeps. A group opened and closed in the same
        # step needs no OPEN entry: its closing entry supersedes it in the same transaction.
        closing = {e.group_id for e in closed}
        state = (*self._cleared_to_record, *(e for e in self._opened if e.group_id not in closing), *closed)
        progress = None
        if self._dirty or state or dead or finalized or handed or forgotten:
            # With every state write, so a restore finds the latest near the partition's end.
            # Never below what was already recorded: compaction keeps only the latest entry.
            read = self.position - 1 if self.position is not None else -1
            progress = PartitionProgress(
                partition=self.partition,
                emitted_through=max(read, self.groups.emitted_through),
                time_ms=now_ms,
                horizon_ms=self.groups.horizon_ms or 0,
                restore_from=restore_from,
            )
        if offset is None and (state or dead or finalized or handed or forgotten):
            offset = self.committed_offset
        refused_staging = tuple(self._refused_staging)
        # Complete groups this step had no room for stay ready for the next one.
        completed = {gid: g for gid, g in self._completed.items() if gid not in closing}
        self._dead, self._opened, self._completed, self._refused_staging, self._forgotten = [], [], completed, [], []
        return PartitionCommit(
            partition=self.partition,
            finalized=tuple(finalized),
            dead_letters=tuple(dead),
            regenerate=tuple(handed),
            state=state,
            progress=progress,
            commit_offset=offset,
            staging_to_clear=tuple(e for e in closed if e.staging_keys),
            forgotten=tuple(forgotten),
            refused_staging=refused_staging,
        )

    def _hand_back(self, g: OpenGroup, entry: GroupState, now_ms: int) -> Regenerate:
        versions = [c.weight_version for r in g.receipts.values() for c in r.manifest]
        return Regenerate(
            prompt_idx=g.prompt_idx,
            group_id=g.group_id,
            new_group_id=regenerated_group_id(g.group_id),
            group_size=g.group_size,
            weight_version=max(versions, default=0),
            reason=STAGING_LOST,
            source=f"{self.config.receipts_topic}[{entry.partition}]@{entry.first_offset}-{entry.last_offset}",
            worker_id=self.config.worker_id,
            time_ms=now_ms,
        )

    def _close(self, o: GroupOutcome, now_ms: int) -> tuple[GroupState, list[DeadLetter]]:
        failed = o.finalized is None
        # A handed-back group is not a dead letter: a redrive must not reopen it (it is regenerated).
        g = self.groups.close(o.group.group_id, dead_lettered=failed and not o.handed_back, closed_ms=self.max_ts)
        letters = []
        if o.dead_letter_kind is not None:
            # The group's receipts go to the dead-letter topic intact, so a redrive can publish them again.
            letters = [
                DeadLetter(
                    source_topic=self.config.receipts_topic,
                    source_partition=g.partition,
                    source_offset=g.offsets[idx],
                    source_key=key,
                    **bounded_original(value),
                    error_kind=o.dead_letter_kind,
                    message=bounded_message(o.dead_letter_message or ""),
                    worker_id=self.config.worker_id,
                    time_ms=now_ms,
                    redrive_count=self._redriven.get(g.offsets[idx], 0),
                    source_timestamp_ms=g.event_ms.get(idx, 0),
                )
                for idx, (key, value) in sorted(g.raw.items())
            ]
        for offset in g.offsets.values():
            self._redriven.pop(offset, None)
        entry = GroupState(
            group_id=g.group_id,
            status=CLOSED,
            partition=g.partition,
            first_offset=g.first_offset,
            last_offset=g.last_offset,
            first_seen_ms=g.first_seen_ms,
            outcome=HANDED_BACK if o.handed_back else DEAD_LETTERED if failed else FINALIZED,
            finalized_at_ms=now_ms,
            staging_keys=o.staging_keys if self.config.clear_staging else (),
            closed_event_ms=self.groups.closed[g.group_id].closed_ms,
        )
        return entry, letters

    def post_commit(
        self, commit: PartitionCommit, written: StateWrites | None = None, *, staging_to_clear: list[str] | None = None
    ) -> None:
        """After the transaction committed: clear the closed groups' staging, record them cleared next step.

        `written` says where the step's state records landed; a group whose delivery report is
        missing is placed at the partition's previous end, which is never after its entry. With
        `staging_to_clear`, the staging keys are added to it instead, for the caller to clear in one call
        with other partitions' keys (TQ's cost is per call).
        """
        # Only now: a crash before the commit re-finalizes these groups from the same staged tensors.
        keys = [k for entry in commit.staging_to_clear for k in entry.staging_keys]
        if staging_to_clear is not None:
            staging_to_clear.extend(keys)
        elif keys:
            self.store.clear(self.config.actor.staging_partition, keys)
        if commit.refused_staging and self.config.clear_staging:
            self._clear_refused_staging(commit.refused_staging)
        self._cleared_to_record = [_cleared(entry) for entry in commit.staging_to_clear]
        if commit.commit_offset is not None:
            self.committed_offset = commit.commit_offset
        self._dirty = False
        if commit.progress is not None:
            self.groups.emitted_through = commit.progress.emitted_through
        if self._earlier_reach is not None and self.groups.emitted_through > self._earlier_reach:
            self._earlier_reach = None  # committed past anything an earlier step could have read
        written = written or StateWrites()
        offsets = {e.group_id: written.first_offsets.get(e.group_id, self.state_end) for e in commit.state}
        self.groups.entries_written(offsets, {e.group_id for e in commit.state if e.status == OPEN})
        self.state_end = max(self.state_end, written.end_offset)

    def _clear_refused_staging(self, refused_staging: Sequence[tuple[str, str, str]]) -> None:
        """Clear refused receipts' staged rows: only rows they own, and none an open group still uses."""
        in_use = {k for g in self.groups.open.values() for k in g.staging_keys()}
        owners = {key: (gid, rid) for key, gid, rid in refused_staging if key not in in_use}
        if not owners:
            return
        partition = self.config.actor.staging_partition
        tags = self.store.tags(partition, list(owners))
        owned = [k for k, (gid, rid) in owners.items() if owned_by(tags.get(k), gid, rid)]
        if owned:
            self.store.clear(partition, owned)


def _cleared(entry: GroupState) -> GroupState:
    """The closed entry once its staging is gone; without keys, so the compacted log stays small."""
    return msgspec.structs.replace(entry, staging_cleared=True, staging_keys=())


def _open_entry(group: OpenGroup) -> GroupState:
    return GroupState(
        group_id=group.group_id,
        status=OPEN,
        partition=group.partition,
        first_offset=group.first_offset,
        last_offset=group.first_offset,
        first_seen_ms=group.first_seen_ms,
    )


def _refusal(receipt: Receipt, outcome: Intake) -> str:
    return f"receipt {receipt.rollout_id} of group {receipt.group_id}: {outcome.value}"
