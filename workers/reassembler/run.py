"""Running reassembler workers: one in this process, or N child processes that form one consumer group.

A child process receives its whole configuration as one JSON document on stdin (`WorkerSpec`),
never as arguments: no setting, and no SASL password least of all, appears on a command line (where
`ps` shows it to every user of the host) or has to survive a round trip through flags.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import BinaryIO

import msgspec

from streams.config import KafkaConfig
from streams.errors import ConfigError
from streams.pids import die_with_parent
from streams.tq import TQConfig, TQStore, init_tq, set_torch_threads
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.faults import NO_FAULTS, Faults
from workers.reassembler.lease import call_budget_s
from workers.reassembler.pool import STOP_GRACE_S, Pool, RestartPolicy, SpareSupply
from workers.runtime import REAL_RUNTIME, Runtime
from workers.telemetry.sensors import PoolSensor, ReassemblerSensor, ReassemblerStats, fan_out

# How a child is started; everything else it needs arrives on its stdin.
CHILD_ARGS = ("-m", "workers.cli.main", "reassemble", "--config-stdin")


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything one worker process needs: what the parent writes to a child's stdin."""

    kafka: KafkaConfig
    reassembler: ReassemblerConfig
    tq: TQConfig
    metrics_port: int | None = None
    log_json: bool = False
    debug: bool = False  # log at debug level (the parent's `rlstream --debug`)
    # A pool's warm spare: attach to Ray and TQ now, then wait on stdin for a `Promotion`. Keeps its
    # document name, so a child of this version still reads the spec an older parent writes.
    as_spare: bool = msgspec.field(default=False, name="standby")


class Promotion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a pool writes to its spare's stdin when a worker dies: become that worker."""

    worker_id: str
    metrics_port: int | None = None


def bounded_tq(tq: TQConfig, config: ReassemblerConfig) -> TQConfig:
    """`tq` with its storage-unit attempts bounded by what the lease leaves a put after its check.

    The worker gives up every TQ call at that budget anyway (`lease.call_budget_s`); bounded here
    too, TQ's own retry on a fresh connection fits in it instead of its 3 x 200 s. Only a process
    that starts its TQ client after this (a pool child, `run_worker`) gets it.
    """
    return dataclasses.replace(tq, call_budget_s=call_budget_s(config.max_poll_interval_ms / 1000))


def child_process(
    kafka: KafkaConfig,
    config: ReassemblerConfig,
    tq: TQConfig,
    *,
    metrics_port: int | None = None,
    log_json: bool = False,
    debug: bool = False,
    as_spare: bool = False,
    args: Sequence[str] | None = None,
) -> tuple[list[str], bytes]:
    """The argv that runs one worker of `config` in a child process (`args` after the interpreter,
    default CHILD_ARGS), and the document for its stdin."""
    spec = WorkerSpec(kafka, config, tq, metrics_port=metrics_port, log_json=log_json, debug=debug, as_spare=as_spare)
    return [sys.executable, *(CHILD_ARGS if args is None else args)], msgspec.json.encode(spec)


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
    as_spare: bool = False,
    args: Sequence[str] | None = None,
    **popen_kwargs,
) -> subprocess.Popen:
    """Start one worker process (`rlstream reassemble --config-stdin`, or `args`) and hand it its settings.

    A spare (`as_spare`) process keeps its stdin open, as `proc.stdin`, for its `Promotion` (see `promote`).
    """
    argv, document = child_process(
        kafka, config, tq, metrics_port=metrics_port, log_json=log_json, debug=debug, as_spare=as_spare, args=args
    )
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, **popen_kwargs)
    pipe, proc.stdin = proc.stdin, None  # written here; communicate() must not touch it
    try:
        pipe.write(document + b"\n")  # one line: a spare reads its promotion from the next one
        pipe.flush()
    except BrokenPipeError:
        pass  # the child died before reading; its exit code says why
    if as_spare and proc.poll() is None:
        proc.stdin = pipe
        return proc
    try:
        pipe.close()
    except BrokenPipeError:
        pass  # flushing the rest failed the same way; the pipe is closed all the same
    return proc


def promote(proc: subprocess.Popen, worker_id: str, metrics_port: int | None = None) -> None:
    """Make a spare process worker `worker_id` (OSError if it is gone)."""
    if proc.stdin is None:
        raise BrokenPipeError(f"process {proc.pid} is not a spare")
    try:
        proc.stdin.write(msgspec.json.encode(Promotion(worker_id, metrics_port)) + b"\n")
        proc.stdin.close()
    finally:
        proc.stdin = None


def await_promotion(spec: WorkerSpec, stdin: BinaryIO, log: Callable[[str], None] = print) -> WorkerSpec | None:
    """As a spare: attach to Ray and TQ and import the worker now, then wait for a `Promotion` on
    stdin; the spec of the worker to become, or None if stdin closes first (the pool is stopping)."""
    init_tq(bounded_tq(spec.tq, spec.reassembler))
    TQStore()  # TQ's client is ready before anyone waits on it
    from workers.reassembler.worker import ReassemblerWorker  # noqa: F401 - imported now, not after a death

    # A stop while waiting (or while becoming a worker, before the worker's own handlers) is a clean
    # exit, not Ray's exit code or a KeyboardInterrupt traceback.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    log(f"[spare] attached to Ray and TQ; waiting to take over a worker of {spec.reassembler.consumer_group!r}")
    line = stdin.readline()
    if not line.strip():
        return None
    try:
        promotion = msgspec.json.decode(line, type=Promotion)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"promotion from the parent process on stdin: {exc}") from None
    config = msgspec.structs.replace(spec.reassembler, worker_id=promotion.worker_id)
    return msgspec.structs.replace(spec, reassembler=config, metrics_port=promotion.metrics_port, as_spare=False)


def rate_line(
    worker_id: str, stats: ReassemblerStats, prev: tuple[int, int, float], *, now: float
) -> tuple[str, tuple[int, int, float]]:
    """One-line summary of a worker's progress since the previous line (`now`: its runtime's monotonic clock)."""
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
    faults: Faults = NO_FAULTS,
    runtime: Runtime = REAL_RUNTIME,
) -> ReassemblerStats:
    """Attach to TQ and run one worker in this process until `stop` is set or SIGINT/SIGTERM arrives.

    `sensor` (e.g. a Prometheus one) gets every reading as well as the totals behind the rate line;
    `faults` is for drills only (`tests/tools/drill_worker.py`); `runtime` is the worker's clocks and
    threads (`workers.runtime`), the process's own by default.
    """
    from workers.reassembler.worker import ReassemblerWorker

    stop = stop or threading.Event()
    init_tq(bounded_tq(tq, config))
    # After init_tq: ray.init installs its own SIGTERM handler, which would skip the graceful stop.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    stats = ReassemblerStats()
    worker = ReassemblerWorker(
        kafka,
        TQStore(),
        config,
        sensor=stats if sensor is None else fan_out(stats, sensor),
        faults=faults,
        runtime=runtime,
    )
    log(
        f"[{config.worker_id}] consuming {config.receipts_topic} on {kafka.bootstrap_servers} "
        f"as consumer group {config.consumer_group!r}"
    )
    prev = [(0, 0, runtime.monotonic())]

    def tick() -> None:
        line, prev[0] = rate_line(config.worker_id, stats, prev[0], now=runtime.monotonic())
        log(line)

    worker.run(stop, on_tick=tick, tick_s=tick_s)
    log(rate_line(config.worker_id, stats, prev[0], now=runtime.monotonic())[0] + " (stopped)")
    return stats


def serve_worker(
    kafka: KafkaConfig, config: ReassemblerConfig, tq: TQConfig, metrics_port: int | None, log: Callable[[str], None]
) -> int:
    """One worker in this process, with a Prometheus endpoint on `metrics_port` if one is given."""
    sensor = None
    if metrics_port is not None:
        from workers.telemetry.prometheus import PrometheusReassemblerSensor, start_metrics_server

        sensor = PrometheusReassemblerSensor(prefix=config.prefix)
        log(f"metrics: http://0.0.0.0:{start_metrics_server(metrics_port)}/metrics")
    run_worker(kafka, config, tq, log=log, sensor=sensor)
    return 0


def run_child(stdin: BinaryIO, configure_logging: Callable[[bool, bool], Callable[[str], None]]) -> int:
    """A child of `run_pool`, its whole life: spec from stdin, as a spare wait for a promotion, serve.

    Exits FENCED_EXIT when a live twin holds its id, so that the pool does not restart it (a restart
    would fence the twin back).
    """
    from workers.reassembler.errors import WorkerFenced
    from workers.reassembler.pool import FENCED_EXIT

    spec = read_spec(stdin.readline())
    log = configure_logging(spec.log_json, spec.debug)
    set_torch_threads(spec.reassembler.torch_threads)  # the whole process is this worker's
    if spec.as_spare:
        promoted = await_promotion(spec, stdin, log=log)
        if promoted is None:
            return 0
        spec = promoted
    try:
        return serve_worker(spec.kafka, spec.reassembler, spec.tq, spec.metrics_port, log)
    except WorkerFenced as exc:
        log(f"rlstream reassemble: {exc}")
        return FENCED_EXIT


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
    keep_spare: bool = False,
    sensor: PoolSensor | None = None,
) -> int:
    """Run num_workers child processes (ids `<worker_id>-<i>`) until interrupted; returns the worst exit code.

    With `metrics_port`, child i serves on `metrics_port + i` (or a free port each, for 0); `sensor` gets
    the pool's supervision (exits, restarts, the spare; `serve_pool_metrics`). SIGINT and
    SIGTERM are forwarded to the children (the handlers are in place before the first one starts);
    each child's exit is logged when it happens; a child that crashes (a non-zero exit or a signal
    the pool did not forward) is started again with the same worker id after the `restart` policy's
    delay, logged by `warn` (default: the `rlstream.reassemble` logger at WARNING); children still
    running `stop_grace_s` after a forwarded stop are killed; and every child gets SIGTERM if this
    process dies. The exit code is the worst of each child's last exit.

    With `keep_spare`, a child's crash (not within a crash loop) hands its id at once to one more child
    waiting attached to Ray; with `config.static_membership`, its partitions follow without a rebalance.
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    ports = [None if metrics_port is None else (metrics_port + i if metrics_port else 0) for i in range(num_workers)]
    workers = {
        f"{config.worker_id}-{i}": (msgspec.structs.replace(config, worker_id=f"{config.worker_id}-{i}"), ports[i])
        for i in range(num_workers)
    }
    ports_of = {w: port for w, (_, port) in workers.items()}
    spares = _spare(kafka, config, tq, ports=ports_of, log_json=log_json, debug=debug) if keep_spare else None

    def spawn(worker_id: str) -> subprocess.Popen:
        worker, port = workers[worker_id]
        return spawn_worker(
            kafka, worker, tq, metrics_port=port, log_json=log_json, debug=debug, preexec_fn=die_with_parent
        )

    warn = warn or logging.getLogger("rlstream.reassemble").warning
    restart = restart or RestartPolicy()
    pool = Pool(
        log=log, warn=warn, stop_grace_s=stop_grace_s, spawn=spawn, restart=restart, spares=spares, sensor=sensor
    )
    with pool.forwarding_signals():
        pool.keep_spare()  # before the workers: one that dies at once already finds it
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


def serve_pool_metrics(
    config: ReassemblerConfig, metrics_port: int, num_workers: int, log: Callable[[str], None]
) -> PoolSensor:
    """A pool's Prometheus sensor, served from this process on the port after its workers' (`metrics_port`
    + `num_workers`; a free one for 0)."""
    from workers.telemetry.prometheus import PrometheusPoolSensor, start_metrics_server

    sensor = PrometheusPoolSensor(prefix=config.prefix)
    served = start_metrics_server(metrics_port + num_workers if metrics_port else 0)
    log(f"metrics: http://0.0.0.0:{served}/metrics (the pool: restarts, exits, spare)")
    return sensor


def _spare(
    kafka: KafkaConfig, config: ReassemblerConfig, tq: TQConfig, *, ports: dict, log_json: bool, debug: bool
) -> SpareSupply:
    """How a pool starts its spare and makes it worker w (serving metrics on w's port)."""
    return SpareSupply(
        spawn=lambda: spawn_worker(
            kafka,
            msgspec.structs.replace(config, worker_id=f"{config.worker_id}-spare"),
            tq,
            log_json=log_json,
            debug=debug,
            as_spare=True,
            preexec_fn=die_with_parent,
        ),
        promote=lambda proc, worker_id: promote(proc, worker_id, ports[worker_id]),
    )
