"""A one-broker Kafka cluster in memory: topics and their logs, the coordinators, a broker that can go down.

Clients reach it only through `send(request)`: while the broker is down requests wait (as
librdkafka keeps retrying) and are delivered when it is back; a client's own timeouts decide what
its caller sees meanwhile. Processes: every client belongs to one (`process=` of `SimKafka`);
`freeze` stops its heartbeats and background sends (a SIGSTOP, a paused VM), `thaw` resumes them,
`kill` ends them for good (its requests not yet delivered are lost with it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.tools.sim.env import Environment, Request
from tests.tools.sim.kafka.group import GroupCoordinator
from tests.tools.sim.kafka.log import Entry, PartitionLog
from tests.tools.sim.kafka.txn import TxnCoordinator


@dataclass(frozen=True)
class ClusterConfig:
    """Broker settings that change what clients see; the defaults are rlstream's local broker's."""

    # transaction.abort.timed.out.transaction.cleanup.interval.ms (streams/kraft_dir.py sets 1000).
    txn_cleanup_interval_ms: int = 1000
    # Kafka's retention.ms default for topics that set none (7 days).
    default_retention_ms: int = 7 * 24 * 3600 * 1000


@dataclass
class Topic:
    name: str
    config: dict[str, str]
    logs: list[PartitionLog]

    @property
    def compacted(self) -> bool:
        return "compact" in self.config.get("cleanup.policy", "delete")

    def retention_ms(self, default: int) -> int:
        return int(self.config.get("retention.ms", default))


@dataclass
class Process:
    name: str
    clients: list[Any] = field(default_factory=list)
    frozen: bool = False
    killed: bool = False


class KafkaCluster:
    def __init__(self, env: Environment, config: ClusterConfig | None = None):
        self.env = env
        self.config = config or ClusterConfig()
        self.lock = threading.RLock()
        self.started_at = env.now()
        self.topics: dict[str, Topic] = {}
        self.broker_up = True
        self._waiting: list[Request] = []
        self._after_up: list[Callable[[], None]] = []
        self._pids = itertools.count(1000)
        self._client_ids = itertools.count()
        self.processes: dict[str, Process] = {}
        self.txn = TxnCoordinator(self)
        self.groups = GroupCoordinator(self)

    def now_ms(self) -> int:
        return int(self.env.now() * 1000)

    def next_producer_id(self) -> int:
        return next(self._pids)

    def client_name(self, kind: str) -> str:
        """A name for a client that gave none (`client.id`), the same in every replay."""
        return f"{kind}-{next(self._client_ids)}"

    # ----- topics ----------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1, config: dict[str, str] | None = None) -> None:
        with self.lock:
            if name in self.topics:
                raise ValueError(f"topic {name} exists already")
            self.topics[name] = Topic(name, dict(config or {}), [PartitionLog(name, p) for p in range(partitions)])
            # Subscribers learn of the topic at their next metadata refresh and rebalance onto it.
            for g in self.groups.groups.values():
                if any(name in m.topics for m in g.members.values()):
                    self.groups._rebalance(g)

    def log(self, topic: str, partition: int) -> PartitionLog:
        return self.topics[topic].logs[partition]

    def has_partition(self, topic: str, partition: int) -> bool:
        t = self.topics.get(topic)
        return t is not None and 0 <= partition < len(t.logs)

    def partition_counts(self) -> dict[str, int]:
        return {name: len(t.logs) for name, t in self.topics.items()}

    def records(self, topic: str, partition: int, *, read_committed: bool = True) -> list[Entry]:
        """What a reader from the log start would see (a test's view)."""
        with self.lock:
            log = self.log(topic, partition)
            return log.read(log.log_start, read_committed, len(log.entries) + 1)[0]

    def compact(self, topic: str, partition: int | None = None, *, upto: int | None = None, drop_tombstones=False):
        """Run the log cleaner on a compacted topic, up to `upto` (default: all but the last record,
        the active segment's)."""
        with self.lock:
            t = self.topics[topic]
            if not t.compacted:
                raise ValueError(f"topic {topic} is not compacted (cleanup.policy={t.config.get('cleanup.policy')})")
            for log in t.logs if partition is None else [t.logs[partition]]:
                log.compact(log.end_offset - 1 if upto is None else upto, drop_tombstones=drop_tombstones)

    def expire(self, topic: str | None = None) -> None:
        """Apply time retention now (the broker's periodic check): records older than retention.ms go."""
        with self.lock:
            for t in self.topics.values() if topic is None else [self.topics[topic]]:
                if "delete" not in t.config.get("cleanup.policy", "delete"):
                    continue
                retention = t.retention_ms(self.config.default_retention_ms)
                if retention < 0:
                    continue
                for log in t.logs:
                    log.expire(self.now_ms(), retention)

    # ----- the broker --------------------------------------------------------------------------------

    def send(self, request: Request) -> None:
        """A client's request to the broker: delivered now, or when the broker is back."""
        with self.lock:
            if not self.broker_up:
                self._waiting.append(request)
                return
        self.env.deliver(request)

    def down(self) -> None:
        with self.lock:
            self.broker_up = False

    def up(self) -> None:
        with self.lock:
            self.broker_up = True
            waiting, self._waiting = self._waiting, []
            after, self._after_up = self._after_up, []
            self.groups.coordinator_restarted()
        for request in waiting:
            if not self._dead(request):
                self.env.deliver(request)
        for fn in after:
            fn()
        for proc in list(self.processes.values()):
            for client in list(proc.clients):
                getattr(client, "_sim_broker_up", lambda: None)()

    def after_up(self, fn: Callable[[], None]) -> None:
        self._after_up.append(fn)

    # ----- processes ---------------------------------------------------------------------------------

    def process(self, name: str) -> Process:
        return self.processes.setdefault(name, Process(name))

    def freeze(self, name: str) -> None:
        proc = self.process(name)
        proc.frozen = True
        for client in list(proc.clients):
            client._sim_frozen()

    def thaw(self, name: str) -> None:
        proc = self.process(name)
        proc.frozen = False
        for client in list(proc.clients):
            client._sim_thawed()

    def kill(self, name: str) -> None:
        proc = self.process(name)
        proc.killed = True
        proc.frozen = True
        with self.lock:
            self._waiting = [r for r in self._waiting if r.details.get("process") != name]
        for client in list(proc.clients):
            client._sim_frozen()

    def _dead(self, request: Request) -> bool:
        proc = self.processes.get(request.details.get("process", ""))
        return proc is not None and proc.killed
