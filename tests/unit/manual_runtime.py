"""A `workers.runtime.Runtime` a unit test drives by hand: its clock moves only when the test moves it.

`now` is the monotonic clock (the instance is also callable, returning it, where a bare clock is
wanted); `wall_now_ms` the wall clock, or None for this process's real one (the default, so tests
written against real wall time keep it). Sleeps advance `now` and are recorded. Periodic ticks never
run on their own: `tick()` fires each live one once, so a test decides when the lease's watch ticks
and a freeze is simply time moved on without a tick. Background jobs run on a real thread by default;
with `deferred=True` they wait until `run_background()`, or until their result is asked for, as a
simulator's scheduler would run them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor


class _Periodic:
    def __init__(self, runtime: ManualRuntime, interval_s: float, tick: Callable[[], None], name: str):
        self.runtime, self.interval_s, self.tick, self.name = runtime, interval_s, tick, name
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class _Deferred(Future):
    def __init__(self, executor: DeferredExecutor, job: Callable[[], object]):
        super().__init__()
        self._executor, self._job = executor, job

    def run(self) -> None:
        if self.done():
            return
        try:
            self.set_result(self._job())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result, as a thread's future does
            self.set_exception(exc)

    def result(self, timeout=None):
        self._executor.run_through(self)
        return super().result(timeout)


class DeferredExecutor(Executor):
    """Jobs queued in order; each runs when `run_pending` runs it, or when its result is asked for."""

    def __init__(self, name: str):
        self.name = name
        self.pending: list[_Deferred] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = _Deferred(self, lambda: fn(*args, **kwargs))
        self.pending.append(future)
        return future

    def run_through(self, future: _Deferred | None = None) -> None:
        """Run the queued jobs in order, up to `future` (all of them for None)."""
        while self.pending:
            job = self.pending.pop(0)
            job.run()
            if job is future:
                return

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.run_through()


class ManualRuntime:
    def __init__(self, now: float = 1000.0, *, wall_now_ms: int | None = None, deferred: bool = False):
        self.now = now
        self.wall_now_ms = wall_now_ms
        self.deferred = deferred
        self.slept: list[float] = []
        self.periodics: list[_Periodic] = []
        self.executors: list[Executor] = []

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def wall_ms(self) -> int:
        return int(time.time() * 1000) if self.wall_now_ms is None else self.wall_now_ms

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def periodic(self, interval_s: float, tick: Callable[[], None], *, name: str) -> _Periodic:
        p = _Periodic(self, interval_s, tick, name)
        self.periodics.append(p)
        return p

    def tick(self) -> None:
        """Every live periodic tick, once."""
        for p in self.periodics:
            if not p.stopped:
                p.tick()

    def executor(self, name: str) -> Executor:
        executor = DeferredExecutor(name) if self.deferred else ThreadPoolExecutor(1, thread_name_prefix=name)
        self.executors.append(executor)
        return executor

    def run_background(self) -> None:
        """Run every background job submitted so far (deferred executors only)."""
        for e in self.executors:
            if isinstance(e, DeferredExecutor):
                e.run_through()
