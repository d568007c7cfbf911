"""The next step's staging read, started while the current step builds, puts and commits.

A step spends a TQ round trip or two reading its groups' staged rows (the ownership lookup, then one
batched get) before it can build anything. The pipelined step (`worker.py`) starts that read for
the groups ready after its own on a background thread, once its own rows are in, so it runs while
the step builds, puts its train rows and commits its transaction; the next step then finds its rows
read already and goes straight to its build.

What a prefetch may and may not be used for. It is a read, never a write: a zombie's read is
harmless, so it asks no lease (every put still does). It is a cache of rows for groups the worker
held when it was started, valid only while the worker still holds them:

- Every change of tasks (an abort's rebuild, an assignment, a revocation, a fenced member's reset)
  moves the task manager's epoch, and a prefetch of another epoch is dropped unread: the groups it
  was read for belong to tasks that are gone (the rebuild restored new ones from what was committed;
  a revoked partition may be its next owner's already). Nothing of it reaches a transaction.
- Within the epoch, a group is taken from it only while it is open in the same task object, and
  only if its receipts claim the same staging keys as when the read started (a group ready by its
  deadline can still take receipts); any other is left to be read again by a later step.
- Within the epoch no one else clears a held group's staged rows: its staging is cleared only after
  the commit that closes it, by this worker; the clears of refused receipts, the sweeper and the
  clear of a restored partition's leftovers never touch a key an open group names, and a key two
  groups claim is read only for the group its tags name (`staging_read.owned_keys`). Each row read is
  checked to be its key's as it arrives (`streams.tq.TQStore`), as in a step's own read.

Groups that closed after the read started (completed by a receipt the next step's own poll took)
are not held for the step after: the next step takes them too, while it has room, and reads their
rows itself beside the prefetched ones (`just_closed`, `rows`). A group left out of that read is one
whose receipts name a key a prefetched group of the step names: it waits for a later read, so one
step's two reads never hold the same key.

A prefetch whose read failed (a TQ call past its deadline, rows that kept vanishing) raises when the
step takes it, inside the step, which then aborts as it would have had it read the rows itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from schemas.request import RolloutReassemblerActorConfig
from streams.tq import KVStore
from workers.reassembler.groups import OpenGroup
from workers.reassembler.staging_read import Fetched, Staged, read_claims, read_staged, staging_claims
from workers.reassembler.task_manager import TaskManager
from workers.runtime import Runtime


@dataclass(frozen=True)
class _Started:
    groups: tuple[OpenGroup, ...]
    claims: dict[str, tuple[str, ...]]  # group id -> its staging keys when the read started
    epoch: int
    read: Future


class StagingPrefetch:
    """At most one staging read ahead of the step; `take` hands the step what is still its own."""

    def __init__(self, store: KVStore, config: RolloutReassemblerActorConfig, *, runtime: Runtime):
        self._store, self._config, self._runtime = store, config, runtime
        self._pool: Executor | None = None
        self._started: _Started | None = None

    @property
    def pending(self) -> bool:
        """Whether a read was started for the next step (which then need not wait for receipts)."""
        return self._started is not None

    def start(self, groups: Sequence[OpenGroup], epoch: int) -> None:
        """Read `groups`' staging in the background, for the tasks of `epoch`; replaces any earlier read."""
        self.discard()
        if not groups:
            return
        if self._pool is None:
            self._pool = self._runtime.executor("staging-prefetch")
        groups = tuple(groups)
        # The claims are taken here, on the step's thread: the read must not walk groups that the
        # next poll may add receipts to while it runs.
        claims = staging_claims(groups)
        read = self._pool.submit(read_claims, self._store, [g.group_id for g in groups], claims, self._config)
        self._started = _Started(groups, {g.group_id: tuple(g.staging_keys()) for g in groups}, epoch, read)

    def take(self, tasks: TaskManager) -> tuple[list[OpenGroup], Future] | None:
        """The prefetched groups `tasks` still hold unchanged, and the read of their rows; None if none is.

        The read's result is `Staged` (it may hold more groups than those returned); asking for it
        waits for the read and raises what it raised.
        """
        started, self._started = self._started, None
        if started is None:
            return None
        if started.epoch != tasks.epoch:
            started.read.cancel()
            return None
        groups = [g for g in started.groups if tasks.holds(g) and tuple(g.staging_keys()) == started.claims[g.group_id]]
        if not groups:
            started.read.cancel()
            return None
        return groups, started.read

    def rows(self, groups: Sequence[OpenGroup], taken: Future | None, late: Sequence[OpenGroup] = ()) -> Staged:
        """A step's staged rows: those of the read `take` handed it (waited for) with those of `late`
        read now (`just_closed`), else all of `groups` read now."""
        if taken is None:
            return read_staged(self._store, groups, self._config)
        t0 = time.perf_counter()  # metrics only: how long the step still waited for its rows
        # The late groups' read first: it runs while the prefetch may still be reading.
        try:
            fresh = read_staged(self._store, late, self._config) if late else None
        except BaseException:
            taken.cancel()  # the step aborts: its prefetched read is never used, and need not hold the thread
            raise
        staged = taken.result()
        if fresh is not None:
            staged = merged(staged, fresh, {k for g in late for k in g.staging_keys()})
        return dataclasses.replace(staged, fetch_ms=(time.perf_counter() - t0) * 1000.0)

    def discard(self) -> None:
        """Drop the read started, if any (an aborted step's): nothing of it is used. A read has nothing to undo."""
        started, self._started = self._started, None
        if started is not None:
            started.read.cancel()  # not started yet: never sent; else it ends on its own, unread

    def close(self) -> None:
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def just_closed(taken: Sequence[OpenGroup], ready: Sequence[OpenGroup], room: int) -> list[OpenGroup]:
    """The ready groups a step that took `taken` from a prefetch also finalizes: those not taken, in
    order, up to `room`, except any naming a staging key a taken group names (see the module doc).

    Left for the next prefetch instead, a group completed just after the overlapped poll would wait
    for this whole step and the next one's build: the longest part of a group's latency (bench/dataplane).
    """
    if room <= 0:
        return []
    chosen = {g.group_id for g in taken}
    held = {k for g in taken for k in g.staging_keys()}
    late: list[OpenGroup] = []
    for g in ready:
        if len(late) >= room:
            break
        keys = set(g.staging_keys())
        if g.group_id in chosen or not keys.isdisjoint(held):
            continue
        late.append(g)
        held |= keys  # a later ready group naming one of these keys waits too: one read per key per step
    return late


def merged(prefetched: Staged, fresh: Staged, looked_up: set[str]) -> Staged:
    """A prefetched read and a fresh read of other groups (of keys `looked_up`), as one: the fresh one
    wins for its own groups and keys.

    A group the prefetch also read (dropped from it since, having taken a receipt) is read again in
    `fresh`; what the prefetch saw of its keys then is stale, present or not, and is replaced.
    """
    return Staged(
        {**prefetched.owned, **fresh.owned},
        {**{k: v for k, v in prefetched.tags.items() if k not in looked_up}, **fresh.tags},
        Fetched(
            {**{k: v for k, v in prefetched.fetched.segments.items() if k not in looked_up}, **fresh.fetched.segments},
            {**{k: v for k, v in prefetched.fetched.gym_rows.items() if k not in looked_up}, **fresh.fetched.gym_rows},
            (prefetched.fetched.unread - looked_up) | fresh.fetched.unread,
        ),
        prefetched.fetch_ms + fresh.fetch_ms,
    )
