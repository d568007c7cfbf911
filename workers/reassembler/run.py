"""Running reassembler workers: one in this process, or N child processes that form one consumer group."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, init_tq
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker, WorkerStats


def rate_line(worker_id: str, stats: WorkerStats, prev: tuple[int, int, float]) -> tuple[str, tuple[int, int, float]]:
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
    metrics=None,
) -> WorkerStats:
    """Attach to TQ and run one worker in this process until `stop` is set or SIGINT/SIGTERM arrives."""
    stop = stop or threading.Event()
    init_tq(tq)
    # After init_tq: ray.init installs its own SIGTERM handler, which would skip the graceful stop.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    worker = ReassemblerWorker(kafka, TQStore(), config, metrics=metrics)
    log(
        f"[{config.worker_id}] consuming {config.receipts_topic} on {kafka.bootstrap_servers} "
        f"as group {config.consumer_group!r}"
    )
    prev = [(0, 0, time.monotonic())]

    def tick(stats: WorkerStats) -> None:
        line, prev[0] = rate_line(config.worker_id, stats, prev[0])
        log(line)

    stats = worker.run(stop, on_tick=tick, tick_s=tick_s)
    log(rate_line(config.worker_id, stats, prev[0])[0] + " (stopped)")
    return stats


def worker_command(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq_address: str | None,
    *,
    metrics_port: int | None = None,
    log_json: bool = False,
) -> list[str]:
    """The command line that runs one worker of `config` in a child process."""
    cmd = [
        sys.executable,
        "-m",
        "workers.cli.main",
        "reassemble",
        "--bootstrap-servers",
        kafka.bootstrap_servers,
        "--prefix",
        config.topics.prefix,
        "--group",
        config.consumer_group,
        "--workers",
        "1",
        "--worker-id",
        config.worker_id,
        "--group-timeout",
        str(config.group_timeout_s),
        "--max-open-groups",
        str(config.max_open_groups),
    ]
    for k, v in kafka.client_settings.items():
        cmd += ["-X", f"{k}={v}"]
    if tq_address:
        cmd += ["--ray-address", tq_address]
    if config.input_topic:
        cmd += ["--input-topic", config.input_topic]
    if config.crash_point:
        cmd += ["--crash-point", config.crash_point]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if log_json:
        cmd += ["--log-json"]
    return cmd


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
    """Run num_workers child processes (ids `<worker_id>-<i>`) until interrupted; returns the worst exit code."""
    if num_workers <= 0:
        raise ValueError(f"--workers must be > 0, got {num_workers}")
    ports = [None if metrics_port is None else (metrics_port + i if metrics_port else 0) for i in range(num_workers)]
    procs = [
        subprocess.Popen(
            worker_command(
                kafka,
                msgspec.structs.replace(config, worker_id=f"{config.worker_id}-{i}"),
                tq.address,
                metrics_port=ports[i],
                log_json=log_json,
            )
        )
        for i in range(num_workers)
    ]
    log(f"started {num_workers} reassembler processes: pids {', '.join(str(p.pid) for p in procs)}")
    return wait_all(procs)


def wait_all(procs: Sequence[subprocess.Popen]) -> int:
    stopping = threading.Event()

    def forward(signum, _frame):
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]
    return max(codes, key=abs) if not stopping.is_set() else 0
