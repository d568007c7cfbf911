"""Running reassembler workers: one in this process, or N child processes that form one consumer group.

A child process receives its whole configuration as one JSON document on stdin (`WorkerSpec`),
never as arguments: no setting, and no SASL password least of all, appears on a command line (where
`ps` shows it to every user of the host) or has to survive a round trip through flags.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
    metrics_port: int | None = None,
    log_json: bool = False,
    debug: bool = False,
    stop_grace_s: float = STOP_GRACE_S,
) -> int:
    """Run num_workers child processes (ids `<worker_id>-<i>`) until interrupted; returns the worst exit code.

    With `metrics_port`, child i serves on `metrics_port + i` (or a free port each, for 0). SIGINT and
    SIGTERM are forwarded to the children (the handlers are in place before the first one starts);
    each child's exit is logged when it happens; children still running `stop_grace_s` after a
    forwarded stop are killed; and every child gets SIGTERM if this process dies.
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    ports = [None if metrics_port is None else (metrics_port + i if metrics_port else 0) for i in range(num_workers)]
    pool = Pool(log=log, stop_grace_s=stop_grace_s)
    with pool.forwarding_signals():
        for i in range(num_workers):
            if pool.stop_at is not None:
                break
            worker = msgspec.structs.replace(config, worker_id=f"{config.worker_id}-{i}")
            proc = spawn_worker(
                kafka, worker, tq, metrics_port=ports[i], log_json=log_json, debug=debug, preexec_fn=die_with_parent
            )
            pool.add(worker.worker_id, proc)
        pids = ", ".join(str(p.pid) for p in pool.procs.values())
        log(f"started {len(pool.procs)} reassembler processes: pids {pids}")
        return pool.wait()


def exit_status(returncode: int) -> int:
    """A child's exit code as a shell reports it: death by signal n is 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


class Pool:
    """Worker child processes: stop signals forwarded to them, exits reported as they happen."""

    def __init__(self, *, log: Callable[[str], None], stop_grace_s: float, poll_s: float = 0.2) -> None:
        self.log, self.stop_grace_s, self.poll_s = log, stop_grace_s, poll_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.stop_at: float | None = None  # when the first stop signal was forwarded
        self.signum: int | None = None

    def add(self, worker_id: str, proc: subprocess.Popen) -> None:
        self.procs[worker_id] = proc
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
        """Until every child has exited; the worst exit status of a child that failed, else 0."""
        running, worst, killed = dict(self.procs), 0, False
        while running:
            for worker_id, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[worker_id]
                    worst = max(worst, self._report(worker_id, proc))
            overdue = self.stop_at is not None and time.monotonic() - self.stop_at > self.stop_grace_s
            if running and overdue and not killed:
                killed = True
                self.log(
                    f"killing {len(running)} worker process(es) still running {self.stop_grace_s:.0f}s after the stop"
                )
                for proc in running.values():
                    proc.kill()
            if running:
                time.sleep(self.poll_s)
        return worst

    def _report(self, worker_id: str, proc: subprocess.Popen) -> int:
        """Log one child's exit; its status if it counts as a failure, else 0."""
        code = exit_status(proc.returncode)
        stopped = self.signum is not None and code in (0, 128 + self.signum)
        how = "stopped" if stopped else ("exited" if code == 0 or self.stop_at is not None else "died")
        self.log(f"[{worker_id}] worker process {proc.pid} {how} with exit code {code}")
        return 0 if stopped or code == 0 else code
