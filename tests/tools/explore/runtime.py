"""One simulated process's `streams.runtime.Runtime`: the scheduler's clock, and its threads as actors.

- `monotonic()` and `wall_ms()` read the one virtual clock (every process agrees on it).
- `sleep(s)` waits `s` of virtual time, giving the baton up.
- `periodic(interval, tick)` is an actor of the process that sleeps, ticks, and so on: frozen with its
  process (so a freeze is a gap between ticks, as the lease expects), dead with it. Ticks come at least
  `MIN_TICK_S` apart: a lease's 0.1 s watch only has to see gaps of half a session timeout, and every
  tick is one more scheduling decision.
- `executor(name)` is an actor running submitted jobs in order; a future's `result()` waits for its
  job on the baton (a real `Future.result` would block the thread holding it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from tests.tools.explore.sched import Proc, Scheduler

MIN_TICK_S = 0.5


class _Periodic:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class _Job(Future):
    def __init__(self, sched: Scheduler, fn: Callable[[], Any]):
        super().__init__()
        self._sched, self._fn = sched, fn

    def run(self) -> None:
        if not self.set_running_or_notify_cancel():
            return
        try:
            self.set_result(self._fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result, as a thread's future does
            self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            deadline = math.inf if timeout is None else self._sched.now() + timeout
            self._sched.wait_until(self.done, deadline)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            deadline = math.inf if timeout is None else self._sched.now() + timeout
            self._sched.wait_until(self.done, deadline)
        return super().exception(timeout=0)


class SimExecutor(Executor):
    """One background thread of a simulated process: an actor running jobs in the order submitted."""

    def __init__(self, sched: Scheduler, proc: Proc, name: str):
        self._sched = sched
        self._queue: list[_Job] = []
        self._shut = False
        sched.spawn(proc, name, self._serve)

    def _serve(self) -> None:
        while True:
            self._sched.wait_until(lambda: bool(self._queue) or self._shut, math.inf)
            if not self._queue:
                return
            self._queue.pop(0).run()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._shut:
            raise RuntimeError("cannot schedule new futures after shutdown")
        job = _Job(self._sched, lambda: fn(*args, **kwargs))
        self._queue.append(job)
        return job

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for job in self._queue:
                job.cancel()
        pending = list(self._queue)
        self._shut = True
        if wait:
            self._sched.wait_until(lambda: all(j.done() for j in pending), math.inf)


class SimRuntime:
    """The `Runtime` of simulated process `proc`: virtual clocks, sleeps that give the baton up, actors."""

    def __init__(self, sched: Scheduler, proc: Proc):
        self.sched, self.proc = sched, proc

    def monotonic(self) -> float:
        return self.sched.now()

    def wall_ms(self) -> int:
        return int(self.sched.now() * 1000)

    def sleep(self, seconds: float) -> None:
        self.sched.sleep(seconds)

    def periodic(self, interval_s: float, tick: Callable[[], None], *, name: str) -> _Periodic:
        p = _Periodic()
        every = max(interval_s, MIN_TICK_S)

        def run() -> None:
            while not p.stopped:
                self.sched.wait_until(lambda: p.stopped, self.sched.now() + every)
                if p.stopped:
                    return
                tick()

        self.sched.spawn(self.proc, name, run)
        return p

    def executor(self, name: str) -> Executor:
        return SimExecutor(self.sched, self.proc, name)
