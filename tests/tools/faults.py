"""The drills' faults: a reassembler that kills, freezes or stalls itself at a point of its step.

Test tools, not runtime: a worker gets them only when a test or drill builds it with them
(`ReassemblerWorker(..., faults=...)`, or a child started by `tests/tools/drill_worker.py`).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Literal

from workers.reassembler.faults import Faults

CrashPoint = Literal["after_tq_put", "before_commit", "after_commit"]
CRASH_POINTS: tuple[str, ...] = CrashPoint.__args__


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CrashAt(Faults):
    """SIGKILL this process at `point` of its first step that gets there, as a real crash would end it."""

    def __init__(self, point: str):
        if point not in CRASH_POINTS:
            raise ValueError(f"crash point must be one of {', '.join(CRASH_POINTS)}, got {point!r}")
        self.point = point

    def after_put(self) -> None:
        if self.point == "after_tq_put":
            _kill_self()

    def before_commit(self) -> None:
        if self.point == "before_commit":
            _kill_self()

    def after_commit(self) -> None:
        if self.point == "after_commit":
            _kill_self()


class FreezeBeforePut(Faults):
    """SIGSTOP this process once, before its first put (a zombie until someone sends SIGCONT); once
    woken, keep building for `then_build_s` more seconds before the put is asked for, as a worker
    frozen in the middle of a long build would."""

    def __init__(self, then_build_s: float = 0.0):
        self.then_build_s = then_build_s
        self._done = False

    def before_put(self, put: int, sample_ids) -> None:
        if self._done:
            return
        self._done = True
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(self.then_build_s)


# What a worker holding its transaction open prints first (its stdout is its log): a drill waits for it.
HOLDING = "holding the open transaction"


class SlowCommit(Faults):
    """Hold the open transaction of the first `times` steps for `seconds` before committing: a commit
    stalled by an outage past the transaction timeout, which the coordinator then aborts. The process
    runs on meanwhile (no freeze: its lease watch ticks)."""

    def __init__(self, seconds: float, times: int = 1):
        self.seconds, self.times = seconds, times

    def before_commit(self) -> None:
        if self.times > 0:
            self.times -= 1
            print(f"[drill] {HOLDING} {self.seconds:.0f}s before its commit", flush=True)
            time.sleep(self.seconds)


class HoldWhenArmed(Faults):
    """Once `armed` exists, hold the next step's open transaction for good (its records flushed to the
    broker, its offsets sent): the job-restart drill arms it just before it kills the job, so the broker
    keeps a dead reassembler's transaction open across the restart. Prints HOLDING when it holds."""

    def __init__(self, armed: str):
        self.armed = armed

    def before_commit(self) -> None:
        if os.path.exists(self.armed):
            print(f"[drill] {HOLDING} until the job is killed", flush=True)
            while True:
                time.sleep(3600)
