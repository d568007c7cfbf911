"""Where a worker gets its clocks, its sleeps and its background threads: one object it is given.

It lives in `streams` because the Kafka helpers wait too (`streams.consumer.read_topic`'s idle
timeout and retries); `workers.runtime` names the same objects for the pipeline's code.

The reassembler reads no clock, sleeps no sleep and starts no thread of its own: it asks the `Runtime`
it was built with (`ReassemblerWorker(..., runtime=...)`, handed on to its lease, staging clear,
sweeper, task manager, retries and fences; `Pool` and `run_worker` take one too). `REAL_RUNTIME`, the
default, is the process's own clocks and threads. A deterministic simulator (issue 31's explorer)
passes its own: a virtual clock, sleeps that advance it, periodic ticks it fires as virtual time
passes (or holds back, to freeze one worker while the others run on), and background jobs it runs
when its schedule says. Several workers in one process each get their own view of one simulation.
Like `Faults` and the client factory, it is a constructor argument only: no setting, flag, file or
environment variable reaches it.

Timing kept for metrics alone (`perf_counter` around a fetch or a put, reported in a finalized
record's `metrics` and to sensors) is not routed through it: no decision depends on those figures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol


class Periodic(Protocol):
    """A periodic tick started by `Runtime.periodic`."""

    def stop(self) -> None:
        """No tick after this returns begins (one under way may finish)."""
        ...


class Runtime(Protocol):
    """Time and background threads, as one worker process sees them."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: deadlines, timeouts, freezes, intervals."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the epoch: record times, the clamp of a receipt's timestamp, staging ages."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the caller for `seconds` (backoff between retries, a supervisor's poll)."""
        ...

    def periodic(self, interval_s: float, tick: Callable[[], None], *, name: str) -> Periodic:
        """Call `tick` every `interval_s` on a thread of its own (`name`) until stopped.

        A process stopped whole (SIGSTOP) misses its ticks: a gap between two is how the lease sees a
        freeze, so a simulator freezes a worker by firing none of its ticks while its clock runs on.
        """
        ...

    def executor(self, name: str) -> Executor:
        """One background thread (`name`) running submitted jobs in order (the staging clear): a
        future's `result()` waits for its job and raises what it raised; `shutdown` ends the thread."""
        ...


class _Ticker:
    def __init__(self, interval_s: float, tick: Callable[[], None], name: str):
        self._interval_s, self._tick = interval_s, tick
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._tick()

    def stop(self) -> None:
        self._stop.set()


class RealRuntime:
    """The process's own clocks (`time`) and threads (`threading`)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return int(time.time() * 1000)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def periodic(self, interval_s: float, tick: Callable[[], None], *, name: str) -> Periodic:
        return _Ticker(interval_s, tick, name)

    def executor(self, name: str) -> Executor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


REAL_RUNTIME: Runtime = RealRuntime()
