"""`ExperienceConsumer`: what a trainer calls to get finalized prompt groups by weight version.

Metadata first, as the async-RL frameworks do it: `select(version, min, max)` hands out a
`BatchMeta` of groups usable at that version (no tensor), `materialize` fetches their rows from TQ
padded or jagged, `ack` settles them (or `dead_letter` resolves those the trainer cannot use). `next_batch`/`release`
are the same in one call each. With
`ConsumerConfig.checkpointed`, `state_dict`/`load_state_dict`/`checkpoint_durable` let a trainer
resume with its model checkpoint, every group trained once across the restart (`checkpoint.py`).
The Kafka side (reading, policy decisions, dead letters, commits) is `intake.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from schemas.errors import InvalidArgument
from schemas.finalized import FinalizedGroup
from streams.errors import MissingKeysError, RowsUnsettled, TQError
from workers.trainer.batch import BatchMeta, Layout, TrainBatch, materialize, padded
from workers.trainer.checkpoint import STATE_VERSION, ConsumerState, PartitionMark, decode_state, encode_state
from workers.trainer.config import ConsumerConfig
from workers.trainer.deadletters import UNUSABLE_GROUP, make_letter
from workers.trainer.intake import ConsumerCounts, FinalizedIntake
from workers.trainer.outbox import Notice
from workers.trainer.pending import READY, YIELDED, Pending
from workers.trainer.policies import Decision

log = logging.getLogger("rlstream.trainer")

__all__ = ["WITHDRAWN", "BatchMeta", "ConsumerConfig", "ConsumerCounts", "ExperienceConsumer", "TrainBatch"]

# What `materialize` raises for a batch it withdrew (rows gone, or not settled in TQ now): select again.
WITHDRAWN = (MissingKeysError, RowsUnsettled)


class ExperienceConsumer(FinalizedIntake):
    """Finalized groups for the trainer by weight version: select, materialize, ack (or next_batch, release)."""

    _tq_failing = 0  # materializes TQ failed in a row (`ConsumerConfig.max_tq_failures`)

    def set_version(self, version: int) -> None:
        """The trainer's current weight version: every waiting group is decided again at it.

        Held groups may become usable; ready ones may now be past the policy's bound (windowed
        evicts them, in_order never goes back to an older version), so none is yielded on the
        strength of a decision taken at an older version.
        """
        if version < self.version:
            raise InvalidArgument(f"weight version went backwards: {self.version} -> {version}")
        if version == self.version:
            return
        self.version = version
        self.sensor.on_version(version)
        for p in self._pending.all_pending():
            if p.state.waiting:
                self._decide(p)
        self._apply_backpressure()

    def _ready(self) -> list[Pending]:
        ready = sorted((p for p in self._pending.all_pending() if p.state is READY), key=lambda p: p.arrival)
        by_id = {p.group.group_id: p for p in ready}
        return [by_id[g.group_id] for g in self.policy.order([p.group for p in ready])]

    def ready_groups(self) -> list[FinalizedGroup]:
        """The groups usable now at the trainer's version, in the order `select` would take them."""
        return [p.group for p in self._ready()]

    def usable_at(self, version: int) -> int:
        """How many waiting groups the policy would yield at `version`, deciding nothing.

        verl's trainer asks for the count at the next step before it moves there; `set_version`
        would evict on the strength of that question, so this only asks the policy.
        """
        return sum(
            1
            for p in self._pending.all_pending()
            if p.state.waiting and self.policy.decide(p.group, version) is Decision.YIELD
        )

    def _wait_ready(self, want: int, at_deadline: int, deadline: float) -> list[Pending] | None:
        """Groups ready at the current version once `want` are (or `at_deadline` by the deadline); else None."""
        while True:
            ready = self._ready()
            if len(ready) >= want or (len(ready) >= at_deadline and self._runtime.monotonic() >= deadline):
                return ready
            if self._runtime.monotonic() >= deadline:
                self._update_waiting()
                return None
            self.poll(min(0.1, max(0.0, deadline - self._runtime.monotonic())))

    def select(
        self, version: int, min_groups: int = 1, max_groups: int | None = None, timeout_s: float = 10.0
    ) -> BatchMeta | None:
        """Metadata of `min_groups` to `max_groups` groups usable at `version`, or None after `timeout_s`.

        The trainer's version becomes `version` first (it never goes backwards), so every group
        handed out satisfies the policy at it. No tensor moves: `materialize` fetches the rows,
        `ack` settles the groups. Groups whose rows are gone from TQ are dead-lettered here, never
        handed out.
        """
        most = min_groups if max_groups is None else max_groups
        if min_groups < 1 or most < min_groups:
            raise InvalidArgument(f"need 1 <= min_groups <= max_groups, got {min_groups} and {max_groups}")
        if min_groups > self.config.max_waiting_groups:
            # Fetching pauses at that many waiting groups: more could never be ready at once.
            raise InvalidArgument(
                f"min_groups ({min_groups}) is above max_waiting_groups ({self.config.max_waiting_groups})"
            )
        self.set_version(version)
        deadline = self._runtime.monotonic() + timeout_s
        while (ready := self._wait_ready(min_groups, min_groups, deadline)) is not None:
            chosen = self._with_rows(ready[:most])
            if chosen is None:  # TQ could not say now which rows are there: the groups wait
                self.poll(min(0.1, max(0.0, deadline - self._runtime.monotonic())))
                continue
            if len(chosen) >= min_groups:
                return self._hand_out(chosen)
        return None

    def _with_rows(self, chosen: list[Pending]) -> list[Pending] | None:
        """The chosen groups whose rows are all in TQ (one metadata call); the others are dead-lettered.
        None if TQ cannot say now (`RowsUnsettled`): nothing is decided, the groups wait.

        The store keeps where it found the rows, so `materialize` of the batch sends its own check
        alongside the data rather than a second lookup before it (`TQStore`).
        """
        ids = [s for p in chosen for s in p.group.sample_ids]
        try:
            present = self._store.tags(self.config.train_partition, ids)
        except RowsUnsettled as exc:
            log.info("which rows of %d group(s) are in TQ is not known now, asked again: %s", len(chosen), exc)
            return None
        missing = {s for s in ids if s not in present}
        if not missing:
            return chosen
        self._missing_rows(chosen, missing)
        return [p for p in chosen if not missing.intersection(p.group.sample_ids)]

    def _hand_out(self, chosen: list[Pending]) -> BatchMeta:
        for p in chosen:
            p.move(YIELDED)
            self.sensor.on_yield(self.version, p.group.group_min_wv)
            if self._on_yield is not None:
                self._on_yield(p.group, self.version)
        self.counts.yielded += len(chosen)
        self._update_waiting()
        return BatchMeta(
            self.version,
            tuple(p.group for p in chosen),
            tuple((p.partition, p.offset) for p in chosen),
            self.config.train_partition,
        )

    def materialize(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, layout: Layout = "padded"
    ) -> TensorDict:
        """The rows of a selected batch from TQ, padded (pad values from the config) or jagged as packed.

        Rows gone since `select` (cleared by someone else, a TQ fault) withdraw the batch: groups
        missing rows are dead-lettered, the others wait to be selected again, and `MissingKeysError`
        tells the trainer to select again instead of acking. Rows TQ cannot settle now
        (`RowsUnsettled`: moving under their keys, a TQ failure) give the batch back whole: its
        groups wait to be selected again; select again (`WITHDRAWN` names both). Any other TQ failure
        (`TQTimeout`) is counted (`counts.tq_failures`), logged and given back as `RowsUnsettled` too,
        up to `max_tq_failures` in a row; past it, raised as it is (an outage that lasts ends the caller).
        """
        try:
            batch = materialize(
                self._store, meta, fields=fields, layout=layout, pad_value_dict=self.config.pad_value_dict
            )
        except MissingKeysError as exc:
            self._withdraw(meta, set(exc.missing))
            raise
        except RowsUnsettled:
            self._withdraw(meta, set())
            raise
        except TQError as exc:
            self._withdraw(meta, set())
            self.counts.tq_failures += 1
            self._tq_failing += 1
            bound = self.config.max_tq_failures
            if self._tq_failing > bound:
                log.error("TQ failed %d materialize(s) in a row (bound %d): raised: %s", self._tq_failing, bound, exc)
                raise
            log.warning(
                "TQ failed a materialize (%d in a row, bound %d): batch given back: %s", self._tq_failing, bound, exc
            )
            raise RowsUnsettled(f"TQ failed reading {len(meta.groups)} group(s), given back: {exc}") from exc
        self._tq_failing = 0
        return batch

    def _withdraw(self, meta: BatchMeta, missing: set[str]) -> None:
        handed = [self._pending.by_partition.get(part, {}).get(offset) for part, offset in meta.positions]
        handed = [p for p in handed if p is not None and p.state is YIELDED]
        self._missing_rows(handed, missing)
        # Decided again, not just marked ready: the version may have moved since `select` (set_version
        # leaves yielded groups alone), and the bound holds at the version a group is handed out at.
        for p in handed:
            if not missing.intersection(p.group.sample_ids):
                self._decide(p)
        self._apply_backpressure()

    def give_back(self, meta: BatchMeta) -> None:
        """The trainer returns a handed-out batch untrained: its groups wait to be selected again.

        For a caller that gives up on a batch before training it (it could not complete it, say).
        Each group is decided again at the current version, as a withdrawn one is.
        """
        self._withdraw(meta, set())

    def next_batch(self, num_groups: int, timeout_s: float) -> TrainBatch | None:
        """Up to num_groups usable groups with their padded tensors, waiting at most timeout_s for any."""
        if num_groups < 1:
            raise InvalidArgument(f"num_groups must be >= 1, got {num_groups}")
        deadline = self._runtime.monotonic() + timeout_s
        while (ready := self._wait_ready(num_groups, 1, deadline)) is not None:
            chosen = ready[:num_groups]
            # One fetch, no metadata call first: rows found missing are dead-lettered, then retried.
            meta = BatchMeta(self.version, tuple(p.group for p in chosen), (), self.config.train_partition)
            try:
                tensors = padded(self._store, meta, pad_value_dict=self.config.pad_value_dict)
            except MissingKeysError as exc:
                self._missing_rows(chosen, set(exc.missing))
                continue
            except RowsUnsettled as exc:  # not now: the groups wait, read again after a poll
                log.info("rows of %d group(s) not settled in TQ, read again: %s", len(chosen), exc)
                self.poll(min(0.1, max(0.0, deadline - self._runtime.monotonic())))
                continue
            meta = self._hand_out(chosen)
            return TrainBatch(
                meta.version,
                meta.groups,
                meta.sample_ids,
                meta.tags,
                tensors,
                meta.positions,
                meta.train_partition,
            )
        return None

    def ack(self, meta: BatchMeta) -> None:
        """The trainer is done with these groups: their records resolve and, unless checkpointed, the
        offsets are committed and then their rows cleared (with checkpoints both wait for
        `checkpoint_durable`). Rows go only once a commit names their records as consumed, so a trainer
        that dies in between never leaves a successor thinking a trained group was lost (`clears.py`)."""
        for group, (part, offset) in zip(meta.groups, meta.positions, strict=True):
            self._pending.release(group, part, offset)
            self._clears.clear(list(group.sample_ids), part, offset)
        self._commit_resolved()

    def dead_letter(self, meta: BatchMeta, reasons: Mapping[str, str]) -> None:
        """Groups of a handed-out batch the trainer cannot train (`reasons`: group id -> why), resolved as lost.

        A group whose rows a framework cannot take (another group size than it samples, rows that
        contradict their record) would come back after every restart if the trainer just crashed on
        it. Each goes to the trainer's dead-letter topic with the reason, its rows are cleared (as an
        ack's are), it counts as lost (admission gates give its capacity back), and its record resolves
        once the letter is acknowledged. The batch's other groups are untouched: ack them as usual.
        """
        topic = self.config.finalized_topic
        for group, (part, offset) in zip(meta.groups, meta.positions, strict=True):
            why = reasons.get(group.group_id)
            if why is None:
                continue
            p = self._pending.by_partition.get(part, {}).get(offset)
            where = f"{topic}[{part}]@{offset}"
            if p is None or p.state is not YIELDED:
                # Revoked since it was handed out: its next reader hands it out again, and meets the fault.
                log.warning(
                    "group %s at %s is no longer handed out here; not dead-lettered: %s", group.group_id, where, why
                )
                continue
            message = f"group {group.group_id} at {where} was handed out but the trainer cannot use it: {why}"
            letter = make_letter(
                topic,
                part,
                offset,
                group.group_id.encode(),
                group.to_bytes(),
                UNUSABLE_GROUP,
                message,
                worker_id=self._outbox.worker_id,
                time_ms=self._runtime.wall_ms(),
            )
            notice = Notice(
                self.config.topics.trainer_deadletter, letter.source_key, letter.to_bytes(), UNUSABLE_GROUP, where
            )
            log.error("%s; dropped and sent to %s", message, notice.topic)
            self.counts.unusable += 1
            self.counts.lost += 1
            self._clears.clear(list(group.sample_ids), part, offset)
            # Unresolved until its letter is acknowledged: the outbox holds the commit back meanwhile.
            self._pending.set_aside(p)
            self._outbox.add(part, offset, notice)
            self._pending.group_resolved(group)
        self._resolve_letters()

    def release(self, batch: TrainBatch) -> None:
        """`ack` of a batch from `next_batch`."""
        self.ack(batch.meta)

    def state_dict(self) -> dict[str, Any]:
        """Where the trainer stands, to save inside its model checkpoint: per partition the first
        record not yet trained and the trained ones past it, the version, and the cut of acks it covers.

        Groups held, ready or handed out and not acked are not trained: a restore reads them again.
        """
        if not self._clears.deferred:
            raise InvalidArgument(
                "state_dict needs ConsumerConfig(checkpointed=True): without it acked rows are cleared at once"
                " and a trainer restored from this state would find them gone"
            )
        # Partitions of a restored state not assigned yet, or assigned and waiting for their commits
        # (`starts.py`), keep their marks: cut without them, a restore would read from the lagging commit.
        marks = {**self._restored, **self._starts.marks()}
        for part in marks:
            self._restored_cut[part] = self._clears.cut
        for part, (offset, ranges) in self._pending.snapshot(self._outbox.offsets).items():
            marks[part] = PartitionMark(offset, [tuple(r) for r in ranges])
        state = ConsumerState(
            STATE_VERSION,
            self.config.finalized_topic,
            self.config.consumer_group,
            self.version,
            self._clears.cut,
            marks,
            self._run,
        )
        return encode_state(state)

    def checkpoint_durable(self, state: dict[str, Any]) -> None:
        """The checkpoint holding `state` is safely stored: clear the rows it covers, commit its offsets."""
        st = decode_state(state, topic=self.config.finalized_topic, consumer_group=self.config.consumer_group)
        release = None
        if st.run == self._run:  # a predecessor's cut numbers other acks
            if st.cut < self._durable_cut:
                log.warning("a checkpoint older than the last durable one was declared durable: ignored")
                return
            release = st.cut
            self._durable_cut = st.cut
        marks, naming = [], []
        for part, mark in st.partitions.items():
            if part in self._starts or part in self._restored:
                # Still waiting for its commit, or a restored partition not assigned yet: it starts at the
                # lower of the mark and the commit, so rows a predecessor left of records before the mark
                # are cleared when they are read again. Committed now, the mark would be that start and
                # those records never read again (seed 1169: the broker went down as the trainer joined).
                continue
            committed = self._pending.committed_offset(part)
            if release is not None and committed is not None and committed < mark.offset:
                # Named first, from where the commit stands: a trainer started without this checkpoint
                # after a crash between the clear and the marks' commit reads them again as trained.
                naming.append((part, committed, [(committed, mark.offset - 1), *mark.trained]))
            if release is None or st.cut <= self._restored_cut.get(part, -1):
                # A mark this consumer did not reach itself: a predecessor's state's, or the restored one in a
                # state cut before the partition started and declared durable since (a checkpoint saved in
                # the background). It says the records before it were trained, not that their rows are gone:
                # those are cleared by re-reads acked past this cut, so committed now, a successor would
                # start at the mark and never read those records again. A later state's mark moves the commit.
                continue
            marks.append((part, mark.offset, list(mark.trained)))
        due = release is not None and self._clears.due_through(release)
        self._commits.durable(marks, naming, release if due else None)

    def remember_resolved(self, records: Sequence[tuple[str, int, int]]) -> None:
        """Groups resolved before the restored checkpoint, as (group id, partition, offset) of their records.

        A restored consumer starts each partition at its checkpoint's mark and never reads those records
        again; a later duplicate of one would be taken for a new group, and with its rows gone handed
        back to be trained twice. `resume` lists the ones with such a duplicate (`resolved_originals`).
        """
        for group_id, partition, offset in records:
            self._pending.remember_resolved(group_id, partition, offset)

    def resolved_groups(self) -> list[tuple[str, int, int]]:
        """(group id, partition, offset) of the resolved groups this consumer remembers to drop duplicates
        against (up to `max_seen_groups`), oldest first; `checkpoint_dir` keeps them in a checkpoint."""
        return self._pending.resolved_seen()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's state, before the first poll: each partition it names is read
        from its offset, knowing which later records were trained; the version is restored, and the
        groups it names resolved (`checkpoint_dir.load_state` reads them from the checkpoint) are
        remembered, so their duplicates past the cut are dropped, not handed back to train again."""
        st = decode_state(state, topic=self.config.finalized_topic, consumer_group=self.config.consumer_group)
        if not self._clears.deferred:
            raise InvalidArgument("load_state_dict needs ConsumerConfig(checkpointed=True)")
        if self._pending.positions or len(self._starts):  # assigned: their marks were taken (or not) then
            raise InvalidArgument("load_state_dict must come before the first select, next_batch or poll")
        self._restored = dict(st.partitions)
        self.version = max(self.version, st.version)
        self.sensor.on_version(self.version)
        self.remember_resolved(st.resolved)
