"""The environment the models run in: virtual time, scheduling points, waits, and when requests land.

The models never read a real clock, start a thread or draw a random number of their own: all of it
comes from the `Environment` they are given. An explorer implements it with a seeded scheduler (one
logical thread at a time, faults injected at points); `ManualEnv` is the default for tests.

Conventions the models follow, which an environment may rely on:

- `point(name, **details)` is called before and after every operation a client makes
  (`<system>.<client>.<operation>.begin` / `.end`) and around every internal step of a multi-step
  operation (`tq.kv_batch_put.allocate`, ...). The model's state is consistent at every point: an
  environment may run other threads' operations and due timers inside a point, block it, or raise
  from it. A raise at `.begin` is a call that had no effect; at `.end`, one whose effect happened but
  whose caller sees the error (a reply lost).
- Every request a client sends to a server (a broker, TQ's controller, a storage unit) is a `Request`
  handed to `deliver`: it takes effect when `Request.land` is called, now or later or never, which
  the environment decides. A caller that gave up waiting (a deadline) leaves it in flight: it still
  lands whenever the environment lands it.
- A call that waits (a consume with a timeout, a flush, a commit waiting for its markers, a TQ call
  waiting for its reply) waits through `wait_until(predicate, deadline)`.
- Time-driven work (a transaction timed out, a session expired, a delivery timeout) is scheduled
  with `call_at`; the action checks that it is still due, so a stale one does nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol


class Deadlock(RuntimeError):
    """A wait with no deadline and nothing scheduled that could ever end it."""


class Request:
    """One request a client sent to a server; `land` applies it there (once) and records its reply."""

    def __init__(self, name: str, apply: Callable[[], Any], **details: Any):
        self.name = name
        self.details = details
        self._apply = apply
        self.landed = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[Request], None]] = []

    def land(self) -> None:
        """Apply the request at its server (a second call does nothing): its reply is `result` or `error`."""
        if self.landed:
            return
        self.landed = True
        try:
            self.result = self._apply()
        except Exception as exc:  # noqa: BLE001 - the server's error is the reply the client reads
            self.error = exc
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def on_landed(self, cb: Callable[[Request], None]) -> None:
        if self.landed:
            cb(self)
        else:
            self._callbacks.append(cb)

    def reply(self) -> Any:
        """The reply of a landed request: its result, or its error raised."""
        if not self.landed:
            raise RuntimeError(f"request {self.name} has not landed")
        if self.error is not None:
            raise self.error
        return self.result

    def __repr__(self) -> str:
        state = "landed" if self.landed else "in flight"
        return f"Request({self.name}, {state}, {self.details})"


class Environment(Protocol):
    """What the models call. All times are virtual seconds (the epoch's, so record timestamps look real)."""

    def now(self) -> float: ...

    def point(self, name: str, **details: Any) -> None:
        """A scheduling and fault point: may return at once, run others first, block, or raise."""
        ...

    def wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Block until `predicate()` holds (True) or the clock reaches `deadline` (False; `now() >= deadline`)."""
        ...

    def call_at(self, when: float, action: Callable[[], None]) -> None:
        """Run `action` once the clock reaches `when`, before any wait past `when` returns."""
        ...

    def deliver(self, request: Request) -> None:
        """A request reached its server: land it now, later, or never."""
        ...

    @property
    def rng(self) -> random.Random:
        """The only randomness a model uses (a keyless record's partition), seeded by the environment."""
        ...


class ManualEnv:
    """The default environment for tests: a manual clock, no-op points, waits that move the clock.

    `wait_until` moves the clock to the next timer or the deadline, whichever comes first, until the
    predicate holds; one with no deadline and nothing scheduled raises `Deadlock`. Requests land at
    once, except those a `hold` matches, which wait in `held` until `release` (or a timer) lands them.
    `on_point(prefix, fn)` calls `fn(name, details)` at every point whose name starts with `prefix`
    (a test's fault: it may raise). The last points passed are kept in `history`.
    """

    def __init__(self, *, seed: int = 0, start: float = 1_700_000_000.0, history: int = 10_000):
        self._now = start
        self._rng = random.Random(seed)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._holds: list[Callable[[Request], bool]] = []
        self._hooks: list[tuple[str, Callable[[str, dict], None]]] = []
        self.held: list[Request] = []
        self.history: deque[tuple[float, str, dict]] = deque(maxlen=history)

    # ----- the Environment interface -----------------------------------------------------------

    def now(self) -> float:
        return self._now

    @property
    def rng(self) -> random.Random:
        return self._rng

    def point(self, name: str, **details: Any) -> None:
        self.history.append((self._now, name, details))
        for prefix, fn in list(self._hooks):
            if name.startswith(prefix):
                fn(name, details)

    def wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        while True:
            if predicate():
                return True
            with self._lock:
                if self._now >= deadline:
                    return False
                nxt = self._timers[0][0] if self._timers else math.inf
                target = min(deadline, nxt)
                if math.isinf(target):
                    raise Deadlock("a wait with no deadline and nothing scheduled that could end it")
                self._now = max(self._now, target)
            self._run_due()

    def call_at(self, when: float, action: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._timers, (when, next(self._seq), action))

    def deliver(self, request: Request) -> None:
        if any(match(request) for match in self._holds):
            self.held.append(request)
        else:
            request.land()

    # ----- what a test drives --------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds`, running the timers that fall due, in time order."""
        if seconds < 0:
            raise ValueError(f"time only moves forward, not by {seconds}")
        target = self._now + seconds
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > target:
                    self._now = target
                    return
                self._now = max(self._now, self._timers[0][0])
            self._run_due()

    def hold(self, match: Callable[[Request], bool]) -> Callable[[], None]:
        """Keep requests `match` selects in flight (in `held`); returns a function that stops holding."""
        self._holds.append(match)
        return lambda: self._holds.remove(match)

    def release(self, request: Request | None = None) -> None:
        """Land one held request, or all of them in the order they were sent."""
        todo = [request] if request is not None else list(self.held)
        for r in todo:
            self.held.remove(r)
            r.land()

    def on_point(self, prefix: str, fn: Callable[[str, dict], None]) -> Callable[[], None]:
        entry = (prefix, fn)
        self._hooks.append(entry)
        return lambda: self._hooks.remove(entry)

    def _run_due(self) -> None:
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > self._now:
                    return
                _, _, action = heapq.heappop(self._timers)
            action()
