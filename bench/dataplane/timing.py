"""Per-call accounting for `python -m bench.dataplane`: a KVStore wrapper and a reassembler sensor that time.

`TimedStore` wraps any KVStore and sums, per operation and partition, the calls, rows and seconds;
`CommitTimer` sums the seconds of the reassembler's commit steps (finalize plus Kafka transaction).
Both are read and reset by `snapshot`, so a run can leave its warm-up out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

from streams.tq import KVStore
from workers.telemetry.sensors import ReassemblerSensor

Stats = dict[str, list[float]]  # "op partition" -> [calls, rows, seconds]


class TimedStore:
    """A KVStore that times every call of the store it wraps (thread-safe; one lock per update)."""

    def __init__(self, inner: KVStore) -> None:
        self._inner = inner
        self._stats: Stats = {}
        self._lock = threading.Lock()

    def _record(self, op: str, partition: str, rows: int, t0: float) -> None:
        seconds = time.perf_counter() - t0
        with self._lock:
            s = self._stats.setdefault(f"{op} {partition}", [0, 0, 0.0])
            s[0] += 1
            s[1] += rows
            s[2] += seconds

    def snapshot(self, reset: bool = True) -> Stats:
        with self._lock:
            out = {k: list(v) for k, v in self._stats.items()}
            if reset:
                self._stats = {}
        return out

    def put(self, partition: str, keys: Sequence[str], fields: TensorDict, tags: Sequence[Mapping[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            self._inner.put(partition, keys, fields, tags)
        finally:
            self._record("put", partition, len(keys), t0)

    def get(self, partition: str, keys: Sequence[str], select: Sequence[str] | None = None) -> TensorDict:
        t0 = time.perf_counter()
        try:
            return self._inner.get(partition, keys, select)
        finally:
            self._record("get", partition, len(keys), t0)

    def present(self, partition: str, keys: Sequence[str]) -> set[str]:
        t0 = time.perf_counter()
        try:
            return self._inner.present(partition, keys)
        finally:
            self._record("present", partition, len(keys), t0)

    def list(self, partition: str) -> dict[str, dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            return self._inner.list(partition)
        finally:
            self._record("list", partition, 0, t0)

    def tags(self, partition: str, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            return self._inner.tags(partition, keys)
        finally:
            self._record("tags", partition, len(keys), t0)

    def row_bytes(self, partition: str, keys: Sequence[str]) -> dict[str, int]:
        t0 = time.perf_counter()
        try:
            return self._inner.row_bytes(partition, keys)
        finally:
            self._record("row_bytes", partition, len(keys), t0)

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        t0 = time.perf_counter()
        try:
            self._inner.clear(partition, keys)
        finally:
            self._record("clear", partition, len(keys), t0)


class CommitTimer(ReassemblerSensor):
    """Sums the reassembler's commit steps: seconds from the TQ fetch to the Kafka commit, and groups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = [0, 0, 0.0]  # steps, groups finalized, seconds
        self._ends: list[float] = []  # wall clock at the end of each commit that finalized groups

    def on_commit(self, *, seconds: float, finalized: int, dead_letters: Mapping[str, int]) -> None:
        with self._lock:
            self._steps[0] += 1
            self._steps[1] += finalized
            self._steps[2] += seconds
            if finalized and len(self._ends) < 100_000:
                self._ends.append(time.time())

    def snapshot(self, reset: bool = True) -> list[float]:
        with self._lock:
            out = list(self._steps)
            if reset:
                self._steps = [0, 0, 0.0]
        return out

    def commit_ends(self, reset: bool = True) -> list[float]:
        """Wall-clock ends of the commits that finalized groups, since the previous call."""
        with self._lock:
            out = list(self._ends)
            if reset:
                self._ends = []
        return out


def merge(*stats: Stats) -> Stats:
    """Several snapshots summed key by key."""
    out: Stats = {}
    for st in stats:
        for k, v in st.items():
            acc = out.setdefault(k, [0, 0, 0.0])
            for i in range(3):
                acc[i] += v[i]
    return out
