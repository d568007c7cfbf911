"""The Prometheus sensors: readings of a reassembler worker, the trainer or a worker pool, as metrics to scrape.

`PrometheusReassemblerSensor`, `PrometheusTrainerSensor` and `PrometheusPoolSensor` implement the
sensor interfaces of `workers.telemetry.sensors` over a `CollectorRegistry` (default: this process's
`process_registry()`), and `start_metrics_server` serves a registry's `/metrics` over HTTP.

Every series carries the run's topic prefix as label `prefix`, so one Prometheus scraping several
runs on one cluster tells them apart (the dashboard's `$prefix` variable). A run without a prefix
exports no `prefix` label at all: Prometheus treats an empty label as an absent one, and so does
this module's collector, so both read alike.

Sensors built on the same registry share its metric families, so a process running several workers
(or a worker and the trainer) exposes their sums on one endpoint instead of failing on a duplicate
name. Every series is bounded: the per-label families are dead letters by reason (a fixed set), lag
by assigned partition (its series removed when the partition is revoked), retries and fences by
what failed (a fixed set), and a pool's workers by worker id (the pool's size).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, start_http_server

from workers.telemetry.sensors import POOL_EXITS, PoolSensor, ReassemblerSensor, TrainerSensor

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
# What a worker's fence can hit (`workers/reassembler/fencing.py`).
FENCES = ("producer", "member")
# What a worker retries (`ReassemblerWorker._retrying`): a restore names its partition, which the
# label leaves to the log line, so the series are these three from the start.
RETRIES = ("producer", "committed offsets", "restore")
PREFIX = "prefix"

T = TypeVar("T")

_lock = threading.Lock()
_registry: CollectorRegistry | None = None
# Metric families already registered, per registry; weak so a test's registry is freed with it.
_families: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, object]] = weakref.WeakKeyDictionary()


def process_registry() -> CollectorRegistry:
    """This process's registry (created on first use); what sensors and `start_metrics_server` default to."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = CollectorRegistry()
        return _registry


def _family(registry: CollectorRegistry, role: str, build: Callable[[], T]) -> T:
    with _lock:
        known = _families.setdefault(registry, {})
        if role not in known:
            families = build()
            registry.register(_WithoutEmptyPrefix(families))
            known[role] = families
        return known[role]  # type: ignore[return-value]


class _WithoutEmptyPrefix:
    """A role's metrics as one collector whose samples of an empty prefix carry no `prefix` label."""

    def __init__(self, families: object) -> None:
        self._metrics = [m for m in vars(families).values() if isinstance(m, (Counter, Gauge, Histogram))]

    def describe(self):
        for m in self._metrics:
            yield from m.describe()

    def collect(self):
        for m in self._metrics:
            for family in m.collect():
                out = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    if s.labels.get(PREFIX) == "":
                        s = s._replace(labels={k: v for k, v in s.labels.items() if k != PREFIX})
                    out.samples.append(s)
                yield out


def _counter(name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, [PREFIX, *labels], registry=None)


def _gauge(name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, [PREFIX, *labels], registry=None)


class _ReassemblerFamilies:
    def __init__(self) -> None:
        self.receipts_consumed = _counter(
            "rlstream_receipts_consumed_total", "Receipt records consumed from the input topic"
        )
        self.groups_finalized = _counter(
            "rlstream_groups_finalized_total", "Groups whose finalized record was committed"
        )
        self.finalize_latency = Histogram(
            "rlstream_finalize_latency_seconds",
            "Time of one committed step that finalized groups: TQ fetch, build, put and the Kafka transaction",
            [PREFIX],
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self.open_groups = _gauge("rlstream_open_groups", "Groups with receipts but not yet finalized")
        self.fetch_paused = _gauge(
            "rlstream_fetch_paused", "1 while the worker pauses its partitions for too many open groups"
        )
        self.dead_letters = _counter("rlstream_dead_letters_total", "Dead letters committed, by reason", "reason")
        self.handed_back = _counter(
            "rlstream_groups_handed_back_total",
            "Groups whose staging rows were all gone from TQ, handed back for regeneration",
        )
        self.transaction_aborts = _counter(
            "rlstream_transaction_aborts_total", "Steps whose transaction failed and was rebuilt from committed state"
        )
        self.retries = _counter(
            "rlstream_reassembler_retries_total",
            "Kafka calls a worker needs (restore, producer, committed offsets) that failed and were retried",
            "what",
        )
        self.staging_swept = _counter(
            "rlstream_reassembler_staging_swept_total",
            "Staged rows no receipt would ever use (a failed publish, a lost clear), cleared by the sweeper",
        )
        self.fenced = _counter(
            "rlstream_reassembler_fenced_total",
            "Fences of the worker's producer or consumer-group membership (another process took its id, or a "
            "transaction outlived its timeout)",
            "what",
        )
        self.consumer_lag = _gauge(
            "rlstream_consumer_lag_records",
            "Input records between the worker's position and the partition end",
            "topic",
            "partition",
        )


class _TrainerFamilies:
    def __init__(self) -> None:
        self.staleness = Histogram(
            "rlstream_trainer_staleness_versions",
            "current weight version minus group_min_wv of each yielded group",
            [PREFIX],
            buckets=_STALENESS_BUCKETS,
            registry=None,
        )
        self.evicted = _counter(
            "rlstream_trainer_evicted_groups_total", "Groups dropped (or routed to replay) as too stale"
        )
        self.yielded = _counter("rlstream_trainer_yielded_groups_total", "Groups yielded to the trainer")
        self.duplicates = _counter(
            "rlstream_trainer_duplicate_groups_total",
            "Finalized records dropped because their group id was already yielded",
        )
        self.undecodable = _counter(
            "rlstream_trainer_undecodable_records_total",
            "Finalized records that did not decode, sent to the trainer's dead-letter topic",
        )
        self.missing_rows = _counter(
            "rlstream_trainer_missing_rows_total",
            "Groups never consumed whose rows were missing from TQ (handed back, else dead-lettered)",
        )
        self.trainer_handed_back = _counter(
            "rlstream_trainer_groups_handed_back_total",
            "Groups whose train rows were gone from TQ, handed back to the rollout workers to generate again",
        )
        self.version = _gauge("rlstream_trainer_version", "The trainer's current weight version")
        self.partitions_waiting = _gauge(
            "rlstream_trainer_partitions_waiting",
            "Partitions assigned to the trainer and not read, their start unknown (a commit unreadable, the "
            "progress entry it names missing, a seek refused)",
        )
        self.commit_reads_failed = _counter(
            "rlstream_trainer_commit_reads_failed_total",
            "Attempts to start an assigned partition that failed: its commit, its progress entry or its seek",
        )


class _PoolFamilies:
    def __init__(self) -> None:
        self.workers = _gauge("rlstream_pool_workers_running", "Worker processes of the pool running now")
        self.spare_ready = _gauge("rlstream_pool_spare_ready", "1 while a warm spare is attached and waiting")
        self.exits = _counter(
            "rlstream_pool_worker_exits_total",
            "Worker processes that ended, by how: crashed (restarted), fenced (exit 78, not restarted), stopped, "
            "failed (not restarted)",
            "worker",
            "how",
        )
        self.restarts = _counter(
            "rlstream_pool_worker_restarts_total",
            "Crashed workers running again, by the spare taking their id or by a new process",
            "worker",
            "by",
        )


class PrometheusReassemblerSensor(ReassemblerSensor):
    """A reassembler worker's readings as `rlstream_*` counters, gauges and histograms, labelled with `prefix`."""

    def __init__(self, registry: CollectorRegistry | None = None, *, prefix: str = "") -> None:
        self.registry = registry if registry is not None else process_registry()
        self.prefix = prefix
        m = self._m = _family(self.registry, "reassembler", _ReassemblerFamilies)
        # Series that exist before their first event: a rate of 0 is data, an absent series is not.
        self._receipts = m.receipts_consumed.labels(prefix)
        self._finalized = m.groups_finalized.labels(prefix)
        self._latency = m.finalize_latency.labels(prefix)
        self._open = m.open_groups.labels(prefix)
        self._paused = m.fetch_paused.labels(prefix)
        self._handed_back = m.handed_back.labels(prefix)
        self._aborts = m.transaction_aborts.labels(prefix)
        self._swept = m.staging_swept.labels(prefix)
        self._fenced = {what: m.fenced.labels(prefix, what) for what in FENCES}
        for what in RETRIES:
            m.retries.labels(prefix, what)
        # Partitions whose lag series this sensor set, per topic: what on_lag must remove when they go.
        self._lag_partitions: dict[str, set[int]] = {}

    def on_receipts(self, n: int) -> None:
        self._receipts.inc(n)

    def on_commit(self, *, seconds: float, finalized: int, dead_letters: Mapping[str, int]) -> None:
        self._finalized.inc(finalized)
        for reason, n in dead_letters.items():
            self._m.dead_letters.labels(self.prefix, reason).inc(n)
        # Idle steps commit only offsets; counting them would drown the latency of real work.
        if finalized or any(dead_letters.values()):
            self._latency.observe(seconds)

    def on_abort(self) -> None:
        self._aborts.inc()

    def on_retry(self, what: str) -> None:
        self._m.retries.labels(self.prefix, what.partition(" of partition ")[0]).inc()

    def on_open_groups(self, n: int, *, paused: bool) -> None:
        self._open.set(n)
        self._paused.set(1 if paused else 0)

    def on_swept(self, n: int) -> None:
        self._swept.inc(n)

    def on_handed_back(self, n: int) -> None:
        self._handed_back.inc(n)

    def on_fenced(self, what: str) -> None:
        self._m.fenced.labels(self.prefix, what).inc()

    def on_lag(self, topic: str, lags: Mapping[int, int]) -> None:
        """Replace this sensor's lag series of `topic` with `lags`, removing partitions no longer listed."""
        known = self._lag_partitions.setdefault(topic, set())
        for partition in known - set(lags):
            self._m.consumer_lag.remove(self.prefix, topic, str(partition))
        for partition, lag in lags.items():
            self._m.consumer_lag.labels(self.prefix, topic, str(partition)).set(max(0, lag))
        known.clear()
        known.update(lags)
        if not known:
            del self._lag_partitions[topic]


class PrometheusTrainerSensor(TrainerSensor):
    """The trainer consumer's readings: staleness of yielded groups, yields, evictions, duplicates,
    undecodable records, groups whose rows were missing, its weight version, and partitions waiting for
    their starts."""

    def __init__(self, registry: CollectorRegistry | None = None, *, prefix: str = "") -> None:
        self.registry = registry if registry is not None else process_registry()
        m = self._m = _family(self.registry, "trainer", _TrainerFamilies)
        self._staleness = m.staleness.labels(prefix)
        self._evicted = m.evicted.labels(prefix)
        self._yielded = m.yielded.labels(prefix)
        self._duplicates = m.duplicates.labels(prefix)
        self._undecodable = m.undecodable.labels(prefix)
        self._missing = m.missing_rows.labels(prefix)
        self._handed_back = m.trainer_handed_back.labels(prefix)
        self._version = m.version.labels(prefix)
        self._waiting = m.partitions_waiting.labels(prefix)
        self._commit_reads_failed = m.commit_reads_failed.labels(prefix)

    def on_yield(self, version: int, group_min_wv: int) -> None:
        self._yielded.inc()
        self._staleness.observe(max(0, version - group_min_wv))

    def on_evict(self, n: int = 1) -> None:
        self._evicted.inc(n)

    def on_duplicate(self, n: int = 1) -> None:
        self._duplicates.inc(n)

    def on_undecodable(self, n: int = 1) -> None:
        self._undecodable.inc(n)

    def on_missing_rows(self, n: int = 1) -> None:
        self._missing.inc(n)

    def on_handed_back(self, n: int = 1) -> None:
        self._handed_back.inc(n)

    def on_version(self, version: int) -> None:
        self._version.set(version)

    def on_partitions_waiting(self, n: int) -> None:
        self._waiting.set(n)

    def on_commit_reads_failed(self, n: int = 1) -> None:
        self._commit_reads_failed.inc(n)


class PrometheusPoolSensor(PoolSensor):
    """A worker pool's supervision: processes running, the spare, exits by how, restarts."""

    def __init__(self, registry: CollectorRegistry | None = None, *, prefix: str = "") -> None:
        self.registry = registry if registry is not None else process_registry()
        self.prefix = prefix
        m = self._m = _family(self.registry, "pool", _PoolFamilies)
        self._workers = m.workers.labels(prefix)
        self._spare = m.spare_ready.labels(prefix)

    def on_worker(self, worker_id: str) -> None:
        for how in POOL_EXITS:
            self._m.exits.labels(self.prefix, worker_id, how)
        for by in ("spare", "process"):
            self._m.restarts.labels(self.prefix, worker_id, by)

    def on_exit(self, worker_id: str, how: str) -> None:
        self._m.exits.labels(self.prefix, worker_id, how).inc()

    def on_restart(self, worker_id: str, *, by_spare: bool) -> None:
        self._m.restarts.labels(self.prefix, worker_id, "spare" if by_spare else "process").inc()

    def on_running(self, workers: int, *, spare_ready: bool) -> None:
        self._workers.set(workers)
        self._spare.set(1 if spare_ready else 0)


def start_metrics_server(port: int = 0, *, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> int:
    """Serve GET /metrics of `registry` (default: the process registry) from a daemon thread.

    Port 0 picks a free port; returns the port actually bound.
    """
    server, _thread = start_http_server(
        port, addr=addr, registry=registry if registry is not None else process_registry()
    )
    return int(server.server_address[1])
