"""Where a step's staging is cleared: in the background, off the path of the next receipts.

A committed step's staged rows are no longer needed, but clearing them is one more TQ round trip;
done in line, every receipt that arrives meanwhile waits for it. The clear runs on a thread of its
own instead, overlapping the next step's poll, fetch, build and put, and the next step waits for it
before its transaction commits: that transaction records the groups' staging as cleared, which must
not become true before the rows are gone (a crash in between would leave them behind for good).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

from streams.tq import KVStore
from workers.runtime import REAL_RUNTIME, Runtime


class StagingClearer:
    """At most one clear in flight; `settle` waits for it and raises what it raised."""

    def __init__(self, store: KVStore, partition: str, *, runtime: Runtime = REAL_RUNTIME):
        self._store, self._partition = store, partition
        self._runtime = runtime
        self._pool: Executor | None = None
        self._pending: Future | None = None

    def submit(self, keys: list[str]) -> None:
        self.settle()
        if not keys:
            return
        if self._pool is None:
            self._pool = self._runtime.executor("staging-clear")
        self._pending = self._pool.submit(self._store.clear, self._partition, keys)

    def settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.settle()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
