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
from collections.abc import Callable, Sequence

import msgspec

from streams.config import KafkaConfig
from streams.settings import ConfigError
from streams.tq import TQConfig, TQStore, init_tq
from workers.reassembler.config import ReassemblerConfig
from workers.telemetry.sensors import ReassemblerSensor, ReassemblerStats, fan_out

# How a child is started; everything else it needs arrives on its stdin.
CHILD_ARGS = ("-m", "workers.cli.main", "reassemble", "--config-stdin")


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything one worker process needs: what the parent writes to a child's stdin."""

    kafka: KafkaConfig
    reassembler: ReassemblerConfig
    tq: TQConfig
    metrics_port: int | None = None
    log_json: bool = False


def child_process(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    *,
    metrics_port: int | None = None,
    log_json: bool = False,
) -> tuple[list[str], bytes]:
    """The argv that runs one worker of `config` in a child process, and the document for its stdin."""
    spec = WorkerSpec(kafka, config, tq, metrics_port=metrics_port, log_json=log_json)
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
    **popen_kwargs,
) -> subprocess.Popen:
    """Start one worker process (`rlstream reassemble --config-stdin`) and hand it its settings."""
    argv, document = child_process(kafka, config, tq, metrics_port=metrics_port, log_json=log_json)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, **popen_kwargs)
    pipe, proc.stdin = proc.stdin, None  # written and closed here; communicate() must not touch it
    try:
        pipe.write(document)
        pipe.close()
    except BrokenPipeError:
        pass  # the child died before reading; its exit code says why
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
) -> int:
    """Run num_workers child processes (ids `<worker_id>-<i>`) until interrupted; returns the worst exit code.

    With `metrics_port`, child i serves on `metrics_port + i` (or a free port each, for 0).
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    ports = [None if metrics_port is None else (metrics_port + i if metrics_port else 0) for i in range(num_workers)]
    procs = [
        spawn_worker(
            kafka,
            msgspec.structs.replace(config, worker_id=f"{config.worker_id}-{i}"),
            tq,
            metrics_port=ports[i],
            log_json=log_json,
        )
        for i in range(num_workers)
    ]
    log(f"started {num_workers} reassembler processes: pids {', '.join(str(p.pid) for p in procs)}")
    return wait_all(procs)


def wait_all(procs: Sequence[subprocess.Popen]) -> int:
    """Wait for every child, forwarding SIGINT/SIGTERM to them; 0 if stopped by a signal."""
    stopping = threading.Event()

    def forward(signum, _frame):
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return max(codes, key=abs) if not stopping.is_set() else 0
