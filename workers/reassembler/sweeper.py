"""Staged rows that no receipt will ever use, found and cleared: the leak no commit cycle can close.

Two kinds of staged rows outlive their use with nothing left to clear them: those of a publish
that failed after staging (a `DeliveryError`, a cancelled task, a producer that died between the
two), which no receipt names; and those of a refused receipt whose clear a crash lost after the
commit that moved the offset past it, so no restart reads it again. Every staged row's tags name
its prompt group, and the group names its receipts partition (`streams.partitioner`), so the worker
that owns that partition can judge the row. It clears a row only when all of these hold:

- it was staged more than `staging_sweep_age_s` ago (tag `staged_at_ms`; a row staged without
  one is timed from when this worker first saw it), which is above `group_timeout_s`;
- its partition is read to its end, so any receipt naming it that was published has been read;
- no open group of that partition names it, and its group is not open there.

A receipt published later than that age after its rows were staged finds them gone, and its row
is rejected as a missing staging row: a bounded age, as the horizon's retention is.

The same sweep clears train rows no record will name: keys of the train partition that TQ maps with
no tags at all, seen so for that age. A put registers its keys at its first request (the index
lookup) and tags them only at its end, and a put given up in between (its deadline passed while
the process was frozen inside it, past its lease check: DESIGN, "Zombies") leaves them so. A put
that completed tags every row, and resume puts a spilled train row back tagged even if the spill
caught it untagged (`spill_read.RESTORED_TAG`), so no committed record's row is untagged; the keys are the
group's sample ids (`{group_id}_g{i}`), which name the partition whose owner judges them, and none
of a group open there is cleared (its owner's own put will tag them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from schemas.staged_rows import GROUP_ID_TAG, STAGED_AT_TAG
from streams.partitioner import partition_of
from streams.tq import KVStore
from workers.reassembler.config import ReassemblerConfig
from workers.runtime import REAL_RUNTIME, Runtime

log = logging.getLogger("rlstream.reassembler")


class StagingSweeper:
    """One worker's periodic sweep of the staging partition, for the receipts partitions it owns."""

    def __init__(self, store: KVStore, config: ReassemblerConfig, *, runtime: Runtime = REAL_RUNTIME):
        self._store = store
        self._partition = config.actor.staging_partition
        self._train = config.actor.partition_id
        self._age_ms = int(config.staging_sweep_age_s * 1000)
        self._interval_s = config.staging_sweep_interval_s
        self._enabled = config.clear_staging
        self._clock, self._wall_ms = runtime.monotonic, runtime.wall_ms
        self._next = self._clock() + self._interval_s
        # Rows listed without a staging time, and when this sweeper first saw each (bounded by
        # what the partition holds: keys no longer listed are dropped at each sweep).
        self._first_seen: dict[str, int] = {}
        # Untagged train keys, and when this sweeper first saw each untagged (the same bound).
        self._untagged_since: dict[str, int] = {}

    def due(self) -> bool:
        return self._enabled and self._clock() >= self._next

    def sweep(self, tasks: Mapping[int, Any], *, caught_up: Mapping[int, bool], partitions: int) -> int:
        """Clear the rows of `tasks`' partitions that no receipt will use, and their train rows no record
        will name; returns how many.

        `tasks` maps each owned receipts partition to its `PartitionTask`; `partitions` is the
        receipts topic's partition count, which places a row's group.
        """
        self._next = self._clock() + self._interval_s
        now = self._wall_ms()
        listed = self._store.list(self._partition)
        self._first_seen = {k: t for k, t in self._first_seen.items() if k in listed}
        in_use = {p: _open_keys(task) for p, task in tasks.items()}
        stale = []
        for key, tags in listed.items():
            group_id = tags.get(GROUP_ID_TAG)
            if not isinstance(group_id, str) or not group_id:
                continue  # not a row rlstream's publisher staged: not ours to judge
            part = partition_of(group_id.encode(), partitions)
            task = tasks.get(part)
            if task is None or not caught_up.get(part, False):
                continue
            staged_at = tags.get(STAGED_AT_TAG)
            if not isinstance(staged_at, int):
                staged_at = self._first_seen.setdefault(key, now)
            if now - staged_at < self._age_ms:
                continue
            open_groups, open_keys = in_use[part]
            if group_id in open_groups or key in open_keys:
                continue
            stale.append(key)
        if stale:
            self._store.clear(self._partition, stale)
            for key in stale:
                self._first_seen.pop(key, None)
            log.warning(
                "swept %d staged row(s) from %r that no receipt will use (staged over %.0fs ago, e.g. %s)",
                len(stale),
                self._partition,
                self._age_ms / 1000,
                ", ".join(stale[:3]),
            )
        return len(stale) + self._sweep_untagged_train(tasks, in_use, partitions, now)

    def _sweep_untagged_train(
        self, tasks: Mapping[int, Any], in_use: Mapping[int, tuple[set[str], set[str]]], partitions: int, now: int
    ) -> int:
        listed = self._store.list(self._train)
        untagged = [key for key, tags in listed.items() if not tags]
        self._untagged_since = {k: self._untagged_since.get(k, now) for k in untagged}
        stale = []
        for key in untagged:
            group_id = _group_of_sample(key)
            if group_id is None:
                continue  # not a sample id of rlstream's: not ours to judge
            part = partition_of(group_id.encode(), partitions)
            if part not in tasks or group_id in in_use[part][0]:
                continue
            if now - self._untagged_since[key] >= self._age_ms:
                stale.append(key)
        if stale:
            self._store.clear(self._train, stale)
            for key in stale:
                self._untagged_since.pop(key, None)
            log.warning(
                "swept %d untagged train row(s) from %r that no record will name (a put given up after its"
                " index lookup, untagged for over %.0fs, e.g. %s)",
                len(stale),
                self._train,
                self._age_ms / 1000,
                ", ".join(stale[:3]),
            )
        return len(stale)


def _group_of_sample(key: str) -> str | None:
    """The group id of a train row's sample id (`schemas.payload.group_sample_ids`), else None."""
    group_id, sep, index = key.rpartition("_g")
    return group_id if sep and group_id and index.isdigit() else None


def _open_keys(task: Any) -> tuple[set[str], set[str]]:
    groups = task.groups.open
    return set(groups), {k for g in groups.values() for k in g.staging_keys()}
