"""The explorer's scheduler: real components as threads under one baton, on one virtual clock, by one seed.

`Scheduler` is an `Environment` of the models (tests/tools/sim/env.py). Every component of a run
(a reassembler's loop, its background clear, its lease's tick, the trainer, a rollout worker) is an
`Actor`: an OS thread that runs only while it holds the baton. An actor gives the baton back at every
`point` the models pass (with the seed's probability, so interleavings vary) and at every `wait_until`
(a consume with a timeout, a flush, a TQ reply); the scheduler then picks the next actor, by the seed,
among those that may run: not done, not frozen, not dead, and not waiting, or waiting for something
that now holds or a deadline now reached. When none may run, virtual time jumps to the next timer,
deadline or thaw. Nothing else decides: a run is a pure function of its seed, its fault plan and its
workload (given PYTHONHASHSEED, since sets of strings iterate by hash).

Actors belong to a `Proc` (one simulated OS process: its threads, its Kafka clients, its TQ client):

- `freeze(proc, seconds)`: none of its actors runs (its ticks neither) and its Kafka clients stop
  (`KafkaCluster.freeze`: no heartbeats); at the thaw they go on where they stopped, mid-call.
- `kill(proc)`: it never runs again (a SIGKILL: no `finally` of its code runs, its Kafka clients stop
  and its requests not sent are lost). Its threads stay parked until the run ends, then unwind with
  every model call refused.

Faults come in through `hooks` (called at every point of an actor, in order: they may raise, freeze,
kill, or slow the caller) and `deliver_hooks` (may hold a request and land it later). Time-driven ones
(a broker down, a whole-job kill) are `call_at` timers.
"""

from __future__ import annotations

import _thread
import hashlib
import heapq
import itertools
import math
import random
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.tools.sim.env import Request

START = 1_700_000_000.0
# Real seconds an actor may hold the baton before the run is declared stuck (a real block, not a wait).
HOLD_S = 120.0


class Killed(BaseException):
    """The actor's process was killed, or the run is over: it must not run on (a BaseException, so that
    no `except Exception` of the code under test takes it for a failure it can handle)."""


# Resumes of actors at one virtual instant before a run counts as a busy loop (a whole run is a few
# thousand points; a component retrying a failing call at once, with no clock moving, never ends).
LIVELOCK_RESUMES = 50_000


class Stuck(RuntimeError):
    """The run cannot go on: every actor waits forever, or one holds the baton without giving it back."""


@dataclass
class Proc:
    """One simulated process: its actors, and whether it is frozen (until when) or dead."""

    name: str
    role: str
    actors: list[Actor] = field(default_factory=list)
    frozen_until: float | None = None
    dead: bool = False
    exited: bool = False  # its main actor ended (returned or raised): the harness has been told


class Actor:
    """One thread of a simulated process, run only while it holds the baton."""

    def __init__(self, sched: Scheduler, name: str, proc: Proc, target: Callable[[], Any], main: bool):
        self.sched, self.name, self.proc, self.target, self.main = sched, name, proc, target, main
        self.turn = _thread.allocate_lock()
        self.turn.acquire()
        self.waiting: tuple[Callable[[], bool], float] | None = None
        self.started = False
        self.done = False
        self.doom: BaseException | None = None
        self.error: BaseException | None = None
        self.trace = ""
        self.result: Any = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        self.turn.acquire()
        try:
            if self.doom is not None:
                raise self.doom
            self.result = self.target()
        except Killed:
            pass
        except BaseException as exc:  # noqa: BLE001 - what ended a component, for the harness to judge
            self.error = exc
            self.trace = traceback.format_exc()
        finally:
            self.done = True
            if not self.sched.over:
                self.sched._back.release()
            else:
                self.sched._unwound.release()

    def __repr__(self) -> str:
        return f"Actor({self.name})"


class Scheduler:
    """The `Environment` of one run: virtual time, the baton, timers, faults' hooks, and a trace."""

    def __init__(self, seed: int, *, switch: float = 0.2, trace_keep: int = 400):
        self.seed = seed
        self._now = START
        self._sched_rng = random.Random(f"sched/{seed}")
        self._model_rng = random.Random(f"model/{seed}")
        self.switch = switch
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.actors: list[Actor] = []
        self.procs: dict[str, Proc] = {}
        self._by_thread: dict[int, Actor] = {}
        self._back = _thread.allocate_lock()
        self._back.acquire()
        self._unwound = _thread.allocate_lock()
        self._unwound.acquire()
        self.current: Actor | None = None
        self.over = False
        self.hooks: list[Callable[[Actor, str, dict], None]] = []
        self.deliver_hooks: list[Callable[[Request], float | None]] = []
        self.on_exit: Callable[[Actor], None] = lambda actor: None
        self.trace: deque[str] = deque(maxlen=trace_keep)
        self._digest = hashlib.blake2b(digest_size=16)
        self.points = 0
        self.switches = 0
        self.timer_errors: list[str] = []

    # ----- the Environment interface -------------------------------------------------------------

    def now(self) -> float:
        return self._now

    @property
    def rng(self) -> random.Random:
        return self._model_rng

    def point(self, name: str, **details: Any) -> None:
        actor = self._by_thread.get(threading.get_ident())
        if actor is None:  # a timer, or the harness between runs: nothing to schedule
            return
        if self.over:
            raise Killed()
        self.points += 1
        self._note(actor, name, details)
        for hook in self.hooks:
            hook(actor, name, details)
        if actor.proc.dead or actor.proc.frozen_until is not None or self._sched_rng.random() < self.switch:
            self._pause(actor)

    def wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        actor = self._by_thread.get(threading.get_ident())
        if actor is None:
            raise Stuck("wait_until outside an actor: every model call of a run belongs to an actor")
        if self.over:
            raise Killed()
        if predicate():
            if self._sched_rng.random() < self.switch:
                self._pause(actor)
            return True
        if self._now >= deadline:
            return False
        actor.waiting = (predicate, deadline)
        try:
            self._pause(actor)
        finally:
            actor.waiting = None
        return bool(predicate())

    def call_at(self, when: float, action: Callable[[], None]) -> None:
        if not self.over:
            heapq.heappush(self._timers, (when, next(self._seq), action))

    def deliver(self, request: Request) -> None:
        for hook in self.deliver_hooks:
            delay = hook(request)
            if delay is not None:
                self._note(None, f"held {request.name}", {"for_s": delay})
                if math.isfinite(delay):
                    self.call_at(self._now + delay, request.land)
                return
        request.land()

    # ----- what actors call besides the models -------------------------------------------------

    def sleep(self, seconds: float) -> None:
        """The calling actor waits `seconds` of virtual time."""
        self.wait_until(lambda: False, self._now + max(0.0, seconds))

    def slow(self, actor: Actor, seconds: float) -> None:
        """Hold `actor` (the caller, from a hook) for `seconds`: a slow call, its process still alive."""
        until = self._now + seconds
        actor.waiting = (lambda: False, until)
        try:
            self._pause(actor)
        finally:
            actor.waiting = None

    # ----- processes and actors --------------------------------------------------------------------

    def process(self, name: str, role: str) -> Proc:
        if name in self.procs:
            raise ValueError(f"process {name} exists already")
        proc = self.procs[name] = Proc(name, role)
        return proc

    def spawn(self, proc: Proc, name: str, target: Callable[[], Any], *, main: bool = False) -> Actor:
        """A new actor of `proc`; it first runs when the scheduler picks it."""
        actor = Actor(self, f"{proc.name}/{name}", proc, target, main)
        proc.actors.append(actor)
        self.actors.append(actor)
        actor.thread.start()
        self._by_thread[actor.thread.ident] = actor
        return actor

    def current_proc(self) -> Proc | None:
        actor = self._by_thread.get(threading.get_ident())
        return actor.proc if actor is not None else None

    def freeze(self, proc: Proc, seconds: float, thaw: Callable[[], None]) -> None:
        until = self._now + seconds
        proc.frozen_until = until

        def done() -> None:
            if proc.frozen_until == until:
                proc.frozen_until = None
                thaw()

        self.call_at(until, done)

    def kill(self, proc: Proc) -> None:
        proc.dead = True

    # ----- the loop --------------------------------------------------------------------------------

    def run(self, done: Callable[[], bool], deadline: float, *, wall_s: float = 600.0) -> str:
        """Run actors and timers until `done()` ("done"), virtual time passes `deadline` ("deadline"),
        nothing can run any more ("stuck"), or actors keep running without virtual time moving ("livelock")."""
        import time as _time

        wall_end = _time.monotonic() + wall_s
        idle = 0
        spins, at = 0, self._now
        while True:
            if done():
                return "done"
            ready = [a for a in self.actors if self._ready(a)]
            if ready:
                actor = ready[0] if len(ready) == 1 else self._sched_rng.choice(ready)
                self._resume(actor)
                idle += 1
                spins = spins + 1 if self._now == at else 0
                at = self._now
                if spins > LIVELOCK_RESUMES:
                    return "livelock"  # actors run on and on while no virtual time passes: a busy loop
                if idle % 4096 == 0 and _time.monotonic() > wall_end:
                    raise Stuck(f"the run took more than {wall_s:.0f} s of real time (virtual {self.elapsed:.1f} s)")
                if actor.done:
                    self._exited(actor)
                continue
            when = self._next_event()
            if when is None:
                return "stuck"
            if when > deadline:
                self._now = max(self._now, deadline)
                return "deadline"
            self._now = max(self._now, when)
            self._run_timers()

    @property
    def elapsed(self) -> float:
        return self._now - START

    def _ready(self, a: Actor) -> bool:
        if a.done or a.proc.dead or a.proc.frozen_until is not None:
            return False
        if a.waiting is None:
            return True
        predicate, deadline = a.waiting
        if self._now >= deadline:
            return True
        try:
            return bool(predicate())
        except Exception:  # noqa: BLE001 - the actor evaluates it again and meets the error itself
            return True

    def _next_event(self) -> float | None:
        times = [self._timers[0][0]] if self._timers else []
        for a in self.actors:
            if a.done or a.proc.dead:
                continue
            if a.proc.frozen_until is not None:
                continue  # its thaw is a timer
            if a.waiting is not None and math.isfinite(a.waiting[1]):
                times.append(a.waiting[1])
        return min(times) if times else None

    def _run_timers(self) -> None:
        while self._timers and self._timers[0][0] <= self._now:
            _, _, action = heapq.heappop(self._timers)
            try:
                action()
            except Exception:  # noqa: BLE001 - a model's timer failing is the explorer's bug, kept for the report
                self.timer_errors.append(traceback.format_exc())

    def _resume(self, actor: Actor) -> None:
        self.current = actor
        self.switches += 1
        actor.started = True
        actor.turn.release()
        if not self._back.acquire(timeout=HOLD_S):
            frame = sys._current_frames().get(actor.thread.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
            held = f"{actor.name} held the baton for {HOLD_S:.0f} s of real time (blocked outside the models)"
            raise Stuck(f"{held}:\n{where}")
        self.current = None
        if actor.done:
            self._by_thread.pop(actor.thread.ident, None)

    def _pause(self, actor: Actor) -> None:
        self._back.release()
        actor.turn.acquire()
        if self.over or actor.proc.dead:
            raise Killed()
        if actor.doom is not None:
            doom, actor.doom = actor.doom, None
            raise doom

    def _exited(self, actor: Actor) -> None:
        if actor.main and not actor.proc.exited:
            actor.proc.exited = True
            self.on_exit(actor)

    def _note(self, actor: Actor | None, name: str, details: dict) -> None:
        who = actor.name if actor is not None else "-"
        line = f"{self.elapsed:9.3f} {who} {name}"
        if details:
            line += " " + " ".join(f"{k}={_short(v)}" for k, v in sorted(details.items()))
        self.trace.append(line)
        self._digest.update(line.encode())

    def digest(self) -> str:
        """A digest of every point passed so far, in order: equal in two runs of one seed and plan."""
        return self._digest.hexdigest()

    def close(self) -> None:
        """End the run: every parked thread unwinds (each model call it makes refused), one at a time."""
        self.over = True
        self._timers.clear()
        for actor in self.actors:
            if actor.done:
                continue
            actor.doom = Killed()
            actor.turn.release()
            # One at a time: an unwinding thread still runs code of the models. A thread blocked for
            # real (not on the baton) is left to die with the process.
            self._unwound.acquire(timeout=2.0)


def _short(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."
