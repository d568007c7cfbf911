"""Running reassembler workers: one in this process, or N child processes that form one consumer group.

A child process receives its whole configuration as one JSON document on stdin (`WorkerSpec`),
never as arguments: no setting, and no SASL password least of all, appears on a command line (where
`ps` shows it to every user of the host) or has to survive a round trip through flags.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec

from streams.config import KafkaConfig
from streams.pids import die_with_parent
from streams.settings import ConfigError
from streams.tq import TQConfig, TQStore, init_tq
from workers.reassembler.config import ReassemblerConfig
from workers.telemetry.sensors import ReassemblerSensor, ReassemblerStats, fan_out

# How a child is started; everything else it needs arrives on its stdin.
CHILD_ARGS = ("-m", "workers.cli.main", "reassemble", "--config-stdin")
# How long a pool's children have to stop after a forwarded SIGINT/SIGTERM before they are killed.
STOP_GRACE_S = 30.0
# A child's exit code when it stopped because a live twin holds its transactional id (sysexits'
# EX_CONFIG: two workers with one id is a configuration error). The pool does not restart it: the
# restart would fence the twin, which is what a fenced worker must never do.
FENCED_EXIT = 78


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything one worker process needs: what the parent writes to a child's stdin."""

    kafka: KafkaConfig
    reassembler: ReassemblerConfig
    tq: TQConfig
    metrics_port: int | None = None
    log_json: bool = False
    debug: bool = False  # log at debug level (the parent's `rlstream --debug`)


def child_process(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    *,
    metrics_port: int | None = None,
    log_json: bool = False,
    debug: bool = False,
) -> tuple[list[str], bytes]:
    """The argv that runs one worker of `config` in a child process, and the document for its stdin."""
    spec = WorkerSpec(kafka, config, tq, metrics_port=metrics_port, log_json=log_json, debug=debug)
    return [sys.executable, *CHILD_ARGS], msgspec.json.encode(spec)


def read_spec(data: bytes) -> WorkerSpec:
    """The parent's document, validated like any other settings."""
    try:
        return msgspec.json.decode(data, type=WorkerSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"worker settings from the parent process on stdin: {exc}") from None


def spawn_worker(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    *,
    metrics_port: int | None = None,
    log_json: bool = False,
    debug: bool = False,
    **popen_kwargs,
) -> subprocess.Popen:
    """Start one worker process (`rlstream reassemble --config-stdin`) and hand it its settings."""
    argv, document = child_process(kafka, config, tq, metrics_port=metrics_port, log_json=log_json, debug=debug)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, **popen_kwargs)
    pipe, proc.stdin = proc.stdin, None  # written and closed here; communicate() must not touch it
    try:
        pipe.write(document)
    except BrokenPipeError:
        pass  # the child died before reading; its exit code says why
    finally:
        try:
            pipe.close()
        except BrokenPipeError:
            pass  # flushing the rest failed the same way; the pipe is closed all the same
    return proc


def rate_line(
    worker_id: str, stats: ReassemblerStats, prev: tuple[int, int, float]
) -> tuple[str, tuple[int, int, float]]:
    """One-line summary of a worker's progress since the previous line."""
    now = time.monotonic()
    dt = max(now - prev[2], 1e-9)
    dead = sum(stats.dead_letters.values())
    line = (
        f"[{worker_id}] receipts {stats.receipts} ({(stats.receipts - prev[0]) / dt:.0f}/s), "
        f"groups finalized {stats.finalized} ({(stats.finalized - prev[1]) / dt:.1f}/s), "
        f"dead letters {dead}, open {stats.open_groups}{' (paused)' if stats.paused else ''}, "
        f"transactions {stats.transactions}, aborts {stats.aborts}"
    )
    return line, (stats.receipts, stats.finalized, now)


def run_worker(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    *,
    stop: threading.Event | None = None,
    log: Callable[[str], None] = print,
    tick_s: float = 5.0,
    sensor: ReassemblerSensor | None = None,
) -> ReassemblerStats:
    """Attach to TQ and run one worker in this process until `stop` is set or SIGINT/SIGTERM arrives.

    `sensor` (e.g. a Prometheus one) gets every reading as well as the totals behind the rate line.
    """
    from workers.reassembler.worker import ReassemblerWorker

    stop = stop or threading.Event()
    init_tq(tq)
    # After init_tq: ray.init installs its own SIGTERM handler, which would skip the graceful stop.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    stats = ReassemblerStats()
    worker = ReassemblerWorker(kafka, TQStore(), config, sensor=stats if sensor is None else fan_out(stats, sensor))
    log(
        f"[{config.worker_id}] consuming {config.receipts_topic} on {kafka.bootstrap_servers} "
        f"as consumer group {config.consumer_group!r}"
    )
    prev = [(0, 0, time.monotonic())]

    def tick() -> None:
        line, prev[0] = rate_line(config.worker_id, stats, prev[0])
        log(line)

    worker.run(stop, on_tick=tick, tick_s=tick_s)
    log(rate_line(config.worker_id, stats, prev[0])[0] + " (stopped)")
    return stats


def run_pool(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    num_workers: int,
    *,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
    metrics_port: int | None = None,
    log_json: bool = False,
    debug: bool = False,
    stop_grace_s: float = STOP_GRACE_S,
    restart: RestartPolicy | None = None,
) -> int:
    """Run num_workers child processes (ids `<worker_id>-<i>`) until interrupted; returns the worst exit code.

    With `metrics_port`, child i serves on `metrics_port + i` (or a free port each, for 0). SIGINT and
    SIGTERM are forwarded to the children (the handlers are in place before the first one starts);
    each child's exit is logged when it happens; a child that crashes (a non-zero exit or a signal
    the pool did not forward) is started again with the same worker id after the `restart` policy's
    delay, logged by `warn` (default: the `rlstream.reassemble` logger at WARNING); children still
    running `stop_grace_s` after a forwarded stop are killed; and every child gets SIGTERM if this
    process dies. The exit code is the worst of each child's last exit.
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    ports = [None if metrics_port is None else (metrics_port + i if metrics_port else 0) for i in range(num_workers)]
    workers = {
        f"{config.worker_id}-{i}": (msgspec.structs.replace(config, worker_id=f"{config.worker_id}-{i}"), ports[i])
        for i in range(num_workers)
    }

    def spawn(worker_id: str) -> subprocess.Popen:
        worker, port = workers[worker_id]
        return spawn_worker(
            kafka, worker, tq, metrics_port=port, log_json=log_json, debug=debug, preexec_fn=die_with_parent
        )

    warn = warn or logging.getLogger("rlstream.reassemble").warning
    pool = Pool(log=log, warn=warn, stop_grace_s=stop_grace_s, spawn=spawn, restart=restart or RestartPolicy())
    with pool.forwarding_signals():
        for worker_id in workers:
            if pool.stop_at is not None:
                break
            pool.add(worker_id, spawn(worker_id))
        pids = ", ".join(str(p.pid) for p in pool.procs.values())
        log(f"started {len(pool.procs)} reassembler processes: pids {pids}")
        code = pool.wait()
    if pool.restarts:
        counts = ", ".join(f"{w} {n}" for w, n in sorted(pool.restarts.items()))
        log(f"worker processes restarted {pool.restarts.total()} time(s): {counts}")
    return code


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
    crashed child started again (with `spawn`, under the same worker id) after a growing delay."""

    def __init__(
        self,
        *,
        log: Callable[[str], None],
        stop_grace_s: float,
        poll_s: float = 0.2,
        warn: Callable[[str], None] | None = None,
        spawn: Callable[[str], subprocess.Popen] | None = None,
        restart: RestartPolicy = RestartPolicy(),
    ) -> None:
        self.log, self.stop_grace_s, self.poll_s = log, stop_grace_s, poll_s
        self.warn = warn or log
        self.spawn, self.restart = spawn, restart
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}  # when each worker's current process started
        self.crashes: Counter[str] = Counter()  # crashes in a row, per worker
        self.restarts: Counter[str] = Counter()  # restarts so far, per worker
        self.pending: dict[str, tuple[float, int]] = {}  # worker -> (when to restart it, its exit status)
        self.stop_at: float | None = None  # when the first stop signal was forwarded
        self.signum: int | None = None

    def add(self, worker_id: str, proc: subprocess.Popen) -> None:
        self.procs[worker_id] = proc
        self.started[worker_id] = time.monotonic()
        if self.signum is not None:  # the stop arrived while it was starting
            proc.send_signal(self.signum)

    def forward(self, signum: int, _frame=None) -> None:
        self.stop_at = self.stop_at if self.stop_at is not None else time.monotonic()
        self.signum = signum
        for proc in self.procs.values():
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
            overdue = self.stop_at is not None and time.monotonic() - self.stop_at > self.stop_grace_s
            if running and overdue and not killed:
                killed = True
                self.log(
                    f"killing {len(running)} worker process(es) still running {self.stop_grace_s:.0f}s after the stop"
                )
                for proc in running.values():
                    proc.kill()
            if running or self.pending:
                time.sleep(self.poll_s)
        return worst

    def _exited(self, worker_id: str, proc: subprocess.Popen) -> int:
        """Report one child's exit and schedule its restart if it crashed; its status if it counts as final."""
        code = exit_status(proc.returncode)
        stopped = self.signum is not None and code in (0, 128 + self.signum)
        crashed = code not in (0, FENCED_EXIT) and self.stop_at is None and self.spawn is not None
        if not crashed:
            how = "stopped" if stopped else ("exited" if code == 0 or self.stop_at is not None else "died")
            fenced = " (fenced: a live twin holds its id; not restarted)" if code == FENCED_EXIT else ""
            self.log(f"[{worker_id}] worker process {proc.pid} {how} with exit code {code}{fenced}")
            return 0 if stopped or code == 0 else code
        uptime = time.monotonic() - self.started[worker_id]
        if uptime >= self.restart.stable_s:
            self.crashes[worker_id] = 0
        self.crashes[worker_id] += 1
        delay = self.restart.delay(self.crashes[worker_id])
        self.pending[worker_id] = (time.monotonic() + delay, code)
        self.warn(
            f"[{worker_id}] worker process {proc.pid} died with exit code {code} after {uptime:.1f}s; "
            f"restarting it in {delay:g}s (restart {self.restarts[worker_id] + 1})"
        )
        return 0

    def _restart_due(self) -> dict[str, subprocess.Popen]:
        """Start again the crashed children whose delay has passed (not after a stop)."""
        started: dict[str, subprocess.Popen] = {}
        now = time.monotonic()
        for worker_id, (due, code) in list(self.pending.items()):
            if due > now or self.stop_at is not None:
                continue
            del self.pending[worker_id]
            try:
                proc = self.spawn(worker_id)
            except OSError as exc:  # no process to run it (fork or exec failed): counts as one more crash
                self.crashes[worker_id] += 1
                delay = self.restart.delay(self.crashes[worker_id])
                self.pending[worker_id] = (time.monotonic() + delay, code)
                self.warn(f"[{worker_id}] restarting the worker process failed ({exc}); next try in {delay:g}s")
                continue
            self.restarts[worker_id] += 1
            self.add(worker_id, proc)
            self.log(f"[{worker_id}] worker process restarted as pid {proc.pid} (restart {self.restarts[worker_id]})")
            started[worker_id] = proc
        return started
