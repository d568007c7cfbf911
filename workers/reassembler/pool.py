"""A pool of worker child processes: stop signals forwarded, exits reported as they happen, a crashed
child started again under its worker id, and optionally a warm spare that takes a crashed child's
place at once.

A restarted process takes seconds to import its libraries and attach to Ray before it can rejoin
the consumer group, and meanwhile its partitions wait for the group's session timeout to move. A
spare has done all that ahead of time: promoted under the dead child's worker id (and, with static
group membership, its `group.instance.id`), it fences the dead child's open transaction and takes
its partitions back without a rebalance (`bench/failover.py` measures the difference).
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from workers.runtime import REAL_RUNTIME, Runtime
from workers.telemetry.sensors import PoolSensor

# How long a pool's children have to stop after a forwarded SIGINT/SIGTERM before they are killed.
STOP_GRACE_S = 30.0
# A child's exit code when it stopped because a live twin holds its transactional id (sysexits'
# EX_CONFIG: two workers with one id is a configuration error). The pool does not restart it: the
# restart would fence the twin, which is what a fenced worker must never do.
FENCED_EXIT = 78
# Least time between two spares started in a row: a spare that dies at start must not spin.
SPARE_RESPAWN_S = 10.0
# A child that ran this long before it crashed hands its id to the spare even within a crash series.
SPARE_MIN_UPTIME_S = 10.0


@dataclass(frozen=True)
class SpareSupply:
    """How a pool keeps a warm spare: `spawn` starts one, `promote(proc, worker_id)` hands it an id."""

    spawn: Callable[[], subprocess.Popen]
    promote: Callable[[subprocess.Popen, str], None]


def exit_status(returncode: int) -> int:
    """A child's exit code as a shell reports it: death by signal n is 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class RestartPolicy:
    """When a crashed child starts again: after `initial_s`, doubling with each crash in a row up to
    `max_s`; a child that ran `stable_s` or longer before it crashed starts the schedule over."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, crashes_in_a_row: int) -> float:
        """The wait before restart number `crashes_in_a_row` (1 for the first crash of a series)."""
        if crashes_in_a_row < 1:
            raise ValueError(f"crashes_in_a_row must be >= 1, got {crashes_in_a_row}")
        return min(self.initial_s * 2 ** min(crashes_in_a_row - 1, 62), self.max_s)


class Pool:
    """Worker child processes: stop signals forwarded to them, exits reported as they happen, and a
    crashed child started again (with `spawn`, under the same worker id) after a growing delay, or at
    once by promoting the warm spare (from `spares`) when it is the child's first crash in a row.
    `runtime` is its clock and sleep (`workers.runtime`), the process's own by default."""

    def __init__(
        self,
        *,
        log: Callable[[str], None],
        stop_grace_s: float,
        poll_s: float = 0.2,
        warn: Callable[[str], None] | None = None,
        spawn: Callable[[str], subprocess.Popen] | None = None,
        restart: RestartPolicy = RestartPolicy(),
        spares: SpareSupply | None = None,
        runtime: Runtime = REAL_RUNTIME,
        sensor: PoolSensor | None = None,
    ) -> None:
        self.log, self.stop_grace_s, self.poll_s = log, stop_grace_s, poll_s
        self.sensor = sensor if sensor is not None else PoolSensor()
        self.warn = warn or log
        self.spawn, self.restart = spawn, restart
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # when each worker's current process started
        self.crashes: Counter[str] = Counter()  # crashes in a row, per worker
        self.restarts: Counter[str] = Counter()  # restarts so far, per worker
        self.pending: dict[str, tuple[float, int]] = {}  # worker -> (when to restart it, its exit status)
        self.stop_at: float | None = None  # when the first stop signal was forwarded
        self.signum: int | None = None
        self.spares = spares
        self.spare_proc: subprocess.Popen | None = None
        self.spare_started = -SPARE_RESPAWN_S
        self.to_spare: set[str] = set()  # crashed workers whose restart goes to the spare, until it is done
        self.runtime = runtime

    def add(self, worker_id: str, proc: subprocess.Popen) -> None:
        if worker_id not in self.started:
            self.sensor.on_worker(worker_id)
        self.procs[worker_id] = proc
        self.started[worker_id] = self.runtime.monotonic()
        if self.signum is not None:  # the stop arrived while it was starting
            proc.send_signal(self.signum)

    def forward(self, signum: int, _frame=None) -> None:
        self.stop_at = self.stop_at if self.stop_at is not None else self.runtime.monotonic()
        self.signum = signum
        for proc in [*self.procs.values(), *([self.spare_proc] if self.spare_proc else [])]:
            if proc.poll() is None:
                proc.send_signal(signum)

    @contextmanager
    def forwarding_signals(self) -> Iterator[Pool]:
        previous = {sig: signal.signal(sig, self.forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def wait(self) -> int:
        """Until every child has exited for good; the worst last exit status of a child that failed, else 0."""
        running, worst, killed = dict(self.procs), 0, False
        while running or self.pending:
            for worker_id, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[worker_id]
                    worst = max(worst, self._exited(worker_id, proc))
            if self.stop_at is not None and self.pending:  # a stop cancels the restarts not yet done
                worst = max([worst, *(code for _, code in self.pending.values())])
                self.pending.clear()
            running.update(self._restart_due())
            self.keep_spare()
            self.sensor.on_running(len(running), spare_ready=self.spare_proc is not None)
            overdue = self.stop_at is not None and self.runtime.monotonic() - self.stop_at > self.stop_grace_s
            if running and overdue and not killed:
                killed = True
                self.log(
                    f"killing {len(running)} worker process(es) still running {self.stop_grace_s:.0f}s after the stop"
                )
                for proc in running.values():
                    proc.kill()
            if running or self.pending:
                self.runtime.sleep(self.poll_s)
        self._retire_spare()
        return worst

    def keep_spare(self) -> None:
        """A spare ready unless stopping: started again (at a bounded rate) when it was used or died."""
        if self.spares is None or self.stop_at is not None:
            return
        if self.spare_proc is not None and self.spare_proc.poll() is not None:
            self.warn(
                f"spare worker process {self.spare_proc.pid} exited with code {exit_status(self.spare_proc.returncode)}"
            )
            self.spare_proc = None
        if self.spare_proc is None and self.runtime.monotonic() - self.spare_started >= SPARE_RESPAWN_S:
            self.spare_started = self.runtime.monotonic()
            try:
                self.spare_proc = self.spares.spawn()
            except OSError as exc:
                self.warn(f"starting a spare worker process failed ({exc})")
                return
            self.log(f"spare worker process started as pid {self.spare_proc.pid}")

    def _take_spare(self, worker_id: str) -> subprocess.Popen | None:
        """The spare, promoted to `worker_id`; None if there is none ready."""
        proc, self.spare_proc = self.spare_proc, None
        if proc is None or proc.poll() is not None or self.spares is None:
            return None
        self.spare_started = -SPARE_RESPAWN_S  # used, not crashed: its successor may start at once
        try:
            self.spares.promote(proc, worker_id)
        except OSError:  # it died between the check and the write: restart the usual way
            return None
        return proc

    def _retire_spare(self) -> None:
        proc, self.spare_proc = self.spare_proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # end of its input: a waiting spare exits 0
            except OSError:
                pass
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _exited(self, worker_id: str, proc: subprocess.Popen) -> int:
        """Report one child's exit and schedule its restart if it crashed; its status if it counts as final."""
        code = exit_status(proc.returncode)
        stopped = self.signum is not None and code in (0, 128 + self.signum)
        crashed = code not in (0, FENCED_EXIT) and self.stop_at is None and self.spawn is not None
        if not crashed:
            how = "stopped" if stopped else ("exited" if code == 0 or self.stop_at is not None else "died")
            fenced = " (fenced: a live twin holds its id; not restarted)" if code == FENCED_EXIT else ""
            self.log(f"[{worker_id}] worker process {proc.pid} {how} with exit code {code}{fenced}")
            final = "fenced" if code == FENCED_EXIT else ("stopped" if stopped or code == 0 else "failed")
            self.sensor.on_exit(worker_id, final)
            return 0 if stopped or code == 0 else code
        self.sensor.on_exit(worker_id, "crashed")
        uptime = self.runtime.monotonic() - self.started[worker_id]
        if uptime >= self.restart.stable_s:
            self.crashes[worker_id] = 0
        self.crashes[worker_id] += 1
        # The spare takes over at once unless the child is crash-looping (it died again soon after a
        # start): a loop waits out the growing delays instead of burning a spare per crash.
        self.to_spare.discard(worker_id)
        spare = (
            (self.crashes[worker_id] == 1 or uptime >= SPARE_MIN_UPTIME_S)
            and not self.to_spare  # one spare: a second worker dying with the first restarts the usual way
            and self.spare_proc is not None
            and self.spare_proc.poll() is None
        )
        if spare:
            self.to_spare.add(worker_id)
        delay = 0.0 if spare else self.restart.delay(self.crashes[worker_id])
        self.pending[worker_id] = (self.runtime.monotonic() + delay, code)
        how = "handing its id to the spare" if spare else f"restarting it in {delay:g}s"
        self.warn(
            f"[{worker_id}] worker process {proc.pid} died with exit code {code} after {uptime:.1f}s; "
            f"{how} (restart {self.restarts[worker_id] + 1})"
        )
        return 0

    def _restart_due(self) -> dict[str, subprocess.Popen]:
        """Start again the crashed children whose delay has passed (not after a stop)."""
        started: dict[str, subprocess.Popen] = {}
        now = self.runtime.monotonic()
        for worker_id, (due, code) in list(self.pending.items()):
            if due > now or self.stop_at is not None:
                continue
            del self.pending[worker_id]
            # Claimed or not, the spare is this worker's no longer: the next death may claim the new one.
            promoted = self._take_spare(worker_id) if worker_id in self.to_spare else None
            self.to_spare.discard(worker_id)
            try:
                proc = promoted or self.spawn(worker_id)
            except OSError as exc:  # no process to run it (fork or exec failed): counts as one more crash
                self.crashes[worker_id] += 1
                delay = self.restart.delay(self.crashes[worker_id])
                self.pending[worker_id] = (self.runtime.monotonic() + delay, code)
                self.warn(f"[{worker_id}] restarting the worker process failed ({exc}); next try in {delay:g}s")
                continue
            self.restarts[worker_id] += 1
            self.sensor.on_restart(worker_id, by_spare=promoted is not None)
            self.add(worker_id, proc)
            how = f"spare pid {proc.pid} took over" if promoted else f"worker process restarted as pid {proc.pid}"
            self.log(f"[{worker_id}] {how} (restart {self.restarts[worker_id]})")
            started[worker_id] = proc
        return started
