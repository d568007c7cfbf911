"""The Prometheus sensors: readings of a reassembler worker or the trainer as metrics an operator scrapes.

`PrometheusReassemblerSensor` and `PrometheusTrainerSensor` implement the sensor interfaces of
`workers.telemetry.sensors` over a `CollectorRegistry` (default: this process's
`process_registry()`), and `start_metrics_server` serves a registry's `/metrics` over HTTP.

Sensors built on the same registry share its metric families, so a process running several workers
(or a worker and the trainer) exposes their sums on one endpoint instead of failing on a duplicate
name. Every series is bounded: the only per-label families are dead letters by reason (a fixed set)
and lag by assigned partition, whose series are removed when the partition is revoked.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from workers.telemetry.sensors import ReassemblerSensor, TrainerSensor

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

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


def _family(registry: CollectorRegistry, role: str, build: Callable[[CollectorRegistry], T]) -> T:
    with _lock:
        known = _families.setdefault(registry, {})
        if role not in known:
            known[role] = build(registry)
        return known[role]  # type: ignore[return-value]


class _ReassemblerFamilies:
    def __init__(self, r: CollectorRegistry) -> None:
        self.receipts_consumed = Counter(
            "rlstream_receipts_consumed_total", "Receipt records consumed from the input topic", registry=r
        )
        self.groups_finalized = Counter(
            "rlstream_groups_finalized_total", "Groups whose finalized record was committed", registry=r
        )
        self.finalize_latency = Histogram(
            "rlstream_finalize_latency_seconds",
            "Time of one committed step that finalized groups: TQ fetch, build, put and the Kafka transaction",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.open_groups = Gauge("rlstream_open_groups", "Groups with receipts but not yet finalized", registry=r)
        self.fetch_paused = Gauge(
            "rlstream_fetch_paused", "1 while the worker pauses its partitions for too many open groups", registry=r
        )
        self.dead_letters = Counter(
            "rlstream_dead_letters_total", "Dead letters committed, by reason", ["reason"], registry=r
        )
        self.handed_back = Counter(
            "rlstream_groups_handed_back_total",
            "Groups whose staging rows were all gone from TQ, handed back for regeneration",
            registry=r,
        )
        self.transaction_aborts = Counter(
            "rlstream_transaction_aborts_total",
            "Steps whose transaction failed and was rebuilt from committed state",
            registry=r,
        )
        self.retries = Counter(
            "rlstream_reassembler_retries_total",
            "Kafka calls a worker needs (restoring a partition, a new producer) that failed and were retried",
            ["what"],
            registry=r,
        )
        self.staging_swept = Counter(
            "rlstream_reassembler_staging_swept_total",
            "Staged rows no receipt would ever use (a failed publish, a lost clear), cleared by the sweeper",
            registry=r,
        )
        self.consumer_lag = Gauge(
            "rlstream_consumer_lag_records",
            "Input records between the worker's position and the partition end",
            ["topic", "partition"],
            registry=r,
        )


class _TrainerFamilies:
    def __init__(self, r: CollectorRegistry) -> None:
        self.staleness = Histogram(
            "rlstream_trainer_staleness_versions",
            "current weight version minus group_min_wv of each yielded group",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.evicted = Counter(
            "rlstream_trainer_evicted_groups_total", "Groups dropped (or routed to replay) as too stale", registry=r
        )
        self.yielded = Counter("rlstream_trainer_yielded_groups_total", "Groups yielded to the trainer", registry=r)
        self.duplicates = Counter(
            "rlstream_trainer_duplicate_groups_total",
            "Finalized records dropped because their group id was already yielded",
            registry=r,
        )
        self.undecodable = Counter(
            "rlstream_trainer_undecodable_records_total",
            "Finalized records that did not decode, sent to the trainer's dead-letter topic",
            registry=r,
        )
        self.missing_rows = Counter(
            "rlstream_trainer_missing_rows_total",
            "Groups never consumed whose rows were missing from TQ (handed back, else dead-lettered)",
            registry=r,
        )
        self.trainer_handed_back = Counter(
            "rlstream_trainer_groups_handed_back_total",
            "Groups whose train rows were gone from TQ, handed back to the rollout workers to generate again",
            registry=r,
        )


class PrometheusReassemblerSensor(ReassemblerSensor):
    """A reassembler worker's readings as `rlstream_*` counters, gauges and histograms."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else process_registry()
        self._m = _family(self.registry, "reassembler", _ReassemblerFamilies)
        # Partitions whose lag series this sensor set, per topic: what on_lag must remove when they go.
        self._lag_partitions: dict[str, set[int]] = {}

    def on_receipts(self, n: int) -> None:
        self._m.receipts_consumed.inc(n)

    def on_commit(self, *, seconds: float, finalized: int, dead_letters: Mapping[str, int]) -> None:
        self._m.groups_finalized.inc(finalized)
        for reason, n in dead_letters.items():
            self._m.dead_letters.labels(reason).inc(n)
        # Idle steps commit only offsets; counting them would drown the latency of real work.
        if finalized or any(dead_letters.values()):
            self._m.finalize_latency.observe(seconds)

    def on_abort(self) -> None:
        self._m.transaction_aborts.inc()

    def on_retry(self, what: str) -> None:
        self._m.retries.labels(what=what).inc()

    def on_open_groups(self, n: int, *, paused: bool) -> None:
        self._m.open_groups.set(n)
        self._m.fetch_paused.set(1 if paused else 0)

    def on_swept(self, n: int) -> None:
        self._m.staging_swept.inc(n)

    def on_handed_back(self, n: int) -> None:
        self._m.handed_back.inc(n)

    def on_lag(self, topic: str, lags: Mapping[int, int]) -> None:
        """Replace this sensor's lag series of `topic` with `lags`, removing partitions no longer listed."""
        known = self._lag_partitions.setdefault(topic, set())
        for partition in known - set(lags):
            self._m.consumer_lag.remove(topic, str(partition))
        for partition, lag in lags.items():
            self._m.consumer_lag.labels(topic, str(partition)).set(max(0, lag))
        known.clear()
        known.update(lags)
        if not known:
            del self._lag_partitions[topic]


class PrometheusTrainerSensor(TrainerSensor):
    """The trainer consumer's readings: staleness of yielded groups, yields, evictions, duplicates,
    undecodable records and groups whose rows were missing."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else process_registry()
        self._m = _family(self.registry, "trainer", _TrainerFamilies)

    def on_yield(self, version: int, group_min_wv: int) -> None:
        self._m.yielded.inc()
        self._m.staleness.observe(max(0, version - group_min_wv))

    def on_evict(self, n: int = 1) -> None:
        self._m.evicted.inc(n)

    def on_duplicate(self, n: int = 1) -> None:
        self._m.duplicates.inc(n)

    def on_undecodable(self, n: int = 1) -> None:
        self._m.undecodable.inc(n)

    def on_missing_rows(self, n: int = 1) -> None:
        self._m.missing_rows.inc(n)

    def on_handed_back(self, n: int = 1) -> None:
        self._m.trainer_handed_back.inc(n)


def start_metrics_server(port: int = 0, *, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> int:
    """Serve GET /metrics of `registry` (default: the process registry) from a daemon thread.

    Port 0 picks a free port; returns the port actually bound.
    """
    server, _thread = start_http_server(
        port, addr=addr, registry=registry if registry is not None else process_registry()
    )
    return int(server.server_address[1])
