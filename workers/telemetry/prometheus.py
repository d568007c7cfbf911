"""Prometheus metrics an operator can watch: one registry per process, served over HTTP on request.

`ReassemblerMetrics` is what a reassembler worker updates; `TrainerMetrics` what the trainer
consumer updates. Both take a registry (default: this process's `process_registry()`), so tests
can build fresh ones and a process that runs both exposes them on one endpoint.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)

_lock = threading.Lock()
_registry: CollectorRegistry | None = None
_reassembler: ReassemblerMetrics | None = None
_trainer: TrainerMetrics | None = None


def process_registry() -> CollectorRegistry:
    """This process's registry (created on first use); what `start_metrics_server` serves by default."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = CollectorRegistry()
        return _registry


class ReassemblerMetrics:
    """Counters, gauges and histograms of one reassembler worker process."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else process_registry()
        self.registry = r
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
        self.dead_letters = Counter(
            "rlstream_dead_letters_total", "Dead letters committed, by reason", ["reason"], registry=r
        )
        self.transaction_aborts = Counter(
            "rlstream_transaction_aborts_total",
            "Steps whose transaction failed and was rebuilt from committed state",
            registry=r,
        )
        self.consumer_lag = Gauge(
            "rlstream_consumer_lag_records",
            "Input records between the worker's position and the partition end",
            ["topic", "partition"],
            registry=r,
        )

    def set_lag(self, topic: str, lags: dict[int, int]) -> None:
        """Replace the lag series of `topic` with `lags` (partition -> records), dropping revoked ones."""
        for labels in list(self._lag_labels(topic)):
            if int(labels) not in lags:
                self.consumer_lag.remove(topic, labels)
        for partition, lag in lags.items():
            self.consumer_lag.labels(topic, str(partition)).set(max(0, lag))

    def _lag_labels(self, topic: str) -> list[str]:
        return [labels[1] for labels in list(self.consumer_lag._metrics) if labels[0] == topic]


class TrainerMetrics:
    """What the trainer consumer reports: staleness of yielded groups, evictions, yields, duplicates."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else process_registry()
        self.registry = r
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

    def observe_yield(self, current_version: int, group_min_wv: int) -> None:
        self.yielded.inc()
        self.staleness.observe(max(0, current_version - group_min_wv))

    def observe_evicted(self, n: int = 1) -> None:
        self.evicted.inc(n)

    def observe_duplicate(self, n: int = 1) -> None:
        self.duplicates.inc(n)


def reassembler_metrics() -> ReassemblerMetrics:
    """The process-wide reassembler metrics (on `process_registry()`), created on first use."""
    global _reassembler
    with _lock:
        if _reassembler is None:
            _reassembler = ReassemblerMetrics(_registry_unlocked())
        return _reassembler


def trainer_metrics() -> TrainerMetrics:
    """The process-wide trainer metrics (on `process_registry()`), created on first use."""
    global _trainer
    with _lock:
        if _trainer is None:
            _trainer = TrainerMetrics(_registry_unlocked())
        return _trainer


def _registry_unlocked() -> CollectorRegistry:
    global _registry
    if _registry is None:
        _registry = CollectorRegistry()
    return _registry


def start_metrics_server(port: int = 0, *, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> int:
    """Serve GET /metrics of `registry` (default: the process registry) from a daemon thread.

    Port 0 picks a free port; returns the port actually bound.
    """
    server, _thread = start_http_server(
        port, addr=addr, registry=registry if registry is not None else process_registry()
    )
    return int(server.server_address[1])
