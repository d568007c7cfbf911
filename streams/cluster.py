"""A local multi-broker KRaft cluster on loopback: N combined broker+controller nodes from the same jars.

Each node lives in `<data_dir>/node-<id>` with the same pid, address and log files as a single
broker, so `stop_broker`/`read_handle` work per node; `<data_dir>/cluster.json` names the nodes.
Internal topics are replicated (RF min(3, N), min ISR min(2, N)), as on a production cluster, so
losing one broker of three loses nothing. A node can be killed and restarted on its data, which is
what the broker-loss tests and drills do. Like a single broker, a cluster started again from the same
directory resumes every node's storage on the ports it had (`streams/kraft_dir.py`); `fresh` wipes it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException

from streams.broker import (
    PID_NAME,
    BrokerHandle,
    broker_answers,
    default_cache_dir,
    free_port,
    jvm_command,
    launch_node,
    read_handle,
    stop_broker,
)
from streams.config import KafkaConfig
from streams.errors import BrokerError
from streams.jars import ensure_kafka_jars
from streams.java import find_java
from streams.kraft_dir import (
    StoredNode,
    check_port_free,
    format_storage,
    node_dir,
    prepare_storage,
    server_properties,
    wipe_node,
    write_node_files,
)
from streams.pids import forget_pid, pid_alive, reap

CLUSTER_FILE = "cluster.json"


def replication_settings(brokers: int) -> dict[str, str]:
    """Replication of internal topics and the default for new topics on a cluster of `brokers`."""
    rf, isr = str(min(3, brokers)), str(min(2, brokers))
    return {
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
    }


@dataclass(frozen=True)
class ClusterConfig:
    data_dir: Path
    brokers: int = 3
    cache_dir: Path = field(default_factory=default_cache_dir)
    heap: str = "384m"
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0
    detached: bool = False
    java: str | None = None
    # Wipe every node's Kafka storage and format anew; False resumes formatted storage.
    fresh: bool = False


@dataclass(frozen=True)
class Node:
    node_id: int
    port: int
    controller_port: int
    data_dir: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _nodes(data_dir: Path, brokers: int, stored: list[StoredNode]) -> list[Node]:
    """The nodes on the ports their storage was started with, else on free ports."""
    if stored:
        hint = f"the Kafka storage in {data_dir} was started on it; free it, or pass --fresh to discard the data"
        for s in stored:
            check_port_free(s.port, hint)
            check_port_free(s.controller_port, hint)
        return [Node(s.node_id, s.port, s.controller_port, s.data_dir) for s in stored]
    nodes = []
    for i in range(1, brokers + 1):
        port, cport = free_port(), free_port()
        check_port_free(port, "picked free a moment ago; start again")
        check_port_free(cport, "picked free a moment ago; start again")
        nodes.append(Node(i, port, cport, node_dir(data_dir, i)))
    return nodes


def _properties(node: Node, nodes: list[Node]) -> str:
    voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in nodes)
    extra = {
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        **replication_settings(len(nodes)),
        # A killed broker is fenced within seconds, not the default 9 s, so its partitions move fast.
        "broker.session.timeout.ms": "3000",
        "broker.heartbeat.interval.ms": "500",
    }
    return server_properties(node.data_dir, node.port, node.controller_port, tuple(extra.items()))


class LocalCluster:
    """N brokers owned by this process (or detached): start, kill and restart one, stop all."""

    def __init__(self, config: ClusterConfig, *, log: Callable[[str], None] = print):
        if config.brokers < 1:
            raise BrokerError(f"a cluster needs at least one broker, got {config.brokers}")
        self.config = config
        self._log = log
        self.nodes: list[Node] = []
        self._jvm: list[str] = []
        self._java = ""

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def start(self) -> LocalCluster:
        data_dir = Path(self.config.data_dir).resolve()
        if read_handle(data_dir) or any(read_handle(d) for d in data_dir.glob("node-*")):
            raise BrokerError(f"a broker or cluster is already running from {data_dir}; stop it first")
        runtime = find_java(self.config.java)
        libs = ensure_kafka_jars(self.config.cache_dir, log=self._log)
        stored = prepare_storage(data_dir, self.config.brokers, fresh=self.config.fresh)
        self.nodes = _nodes(data_dir, self.config.brokers, stored)
        self._jvm, self._java = jvm_command(runtime, self.config.heap, libs), runtime.describe()
        self._write_nodes(stored[0].cluster_id if stored else None)
        rows = [{**n.__dict__, "data_dir": str(n.data_dir)} for n in self.nodes]
        (data_dir / CLUSTER_FILE).write_text(json.dumps(rows))
        if not self.config.detached:
            atexit.register(self.stop)
        try:
            for node in self.nodes:
                self._launch(node)
            self.wait_ready()
        except BaseException:
            # Detached JVMs outlive this process: a start that fails (or is interrupted) stops them.
            self.stop()
            raise
        return self

    def _write_nodes(self, resumed_cluster_id: str | None) -> None:
        """Every node's files; new storage is formatted all or none, resumed storage is left as it is."""
        props = [write_node_files(n.data_dir, _properties(n, self.nodes)) for n in self.nodes]
        if resumed_cluster_id is not None:
            self._log(f"resuming the Kafka storage of {len(self.nodes)} brokers (cluster id {resumed_cluster_id})")
            return
        cluster_id = str(uuid.uuid4())
        try:
            for node, path in zip(self.nodes, props, strict=True):
                format_storage(self._jvm, path, node.data_dir, cluster_id)
        except BaseException:
            for node in self.nodes:
                wipe_node(node.data_dir)
            raise

    def _launch(self, node: Node) -> BrokerHandle:
        return launch_node(self._jvm, node.data_dir / "server.properties", node.data_dir, node.address, self._java,
                           detached=self.config.detached)  # fmt: skip

    def wait_ready(self, *, nodes: list[Node] | None = None) -> None:
        """Until every node (or `nodes`) answers and the cluster metadata lists them all as brokers."""
        from confluent_kafka.admin import AdminClient

        want = nodes or self.nodes
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            dead = [n for n in want if read_handle(n.data_dir) is None]
            if dead:
                raise BrokerError(f"broker {dead[0].node_id} exited during start; see {dead[0].data_dir}/broker.log")
            if all(broker_answers(n.address, timeout_s=1.0) for n in want):
                admin = AdminClient(KafkaConfig(want[0].address).admin())
                try:
                    brokers = set(admin.list_topics(timeout=5).brokers)
                except KafkaException:
                    brokers = set()
                finally:
                    admin.poll(0)
                if {n.node_id for n in want} <= brokers:
                    return
            time.sleep(0.3)
        raise BrokerError(f"the cluster in {self.config.data_dir} was not ready within {self.config.start_timeout_s}s")

    def kill(self, node_id: int) -> None:
        """SIGKILL one broker, as a crash would; its data stays for `restart`."""
        handle = read_handle(self._node(node_id).data_dir)
        if handle is None:
            raise BrokerError(f"broker {node_id} is not running")
        os.kill(handle.pid, signal.SIGKILL)
        while pid_alive(handle.pid):
            reap(handle.pid)
            time.sleep(0.05)
        forget_pid(PID_NAME, handle.pid)

    def freeze(self, node_id: int) -> None:
        """SIGSTOP one broker: alive to the operating system, silent to everyone else (until `thaw`)."""
        handle = read_handle(self._node(node_id).data_dir)
        if handle is None:
            raise BrokerError(f"broker {node_id} is not running")
        os.kill(handle.pid, signal.SIGSTOP)

    def thaw(self, node_id: int) -> None:
        """SIGCONT a broker `freeze` stopped."""
        handle = read_handle(self._node(node_id).data_dir)
        if handle is not None:
            os.kill(handle.pid, signal.SIGCONT)

    def restart(self, node_id: int) -> None:
        """Start a stopped or killed broker again on its own data (no reformat)."""
        node = self._node(node_id)
        if read_handle(node.data_dir) is not None:
            raise BrokerError(f"broker {node_id} is still running; kill or stop it before a restart")
        if not self._jvm:
            raise BrokerError("restart needs the cluster started by this object")
        self._launch(node)
        self.wait_ready(nodes=[node])

    def _node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise BrokerError(f"no broker {node_id} in this cluster (1..{len(self.nodes)})")

    def stop(self) -> None:
        for node in self.nodes:
            stop_broker(node.data_dir, timeout_s=self.config.stop_timeout_s)
        (Path(self.config.data_dir).resolve() / CLUSTER_FILE).unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def cluster_nodes(data_dir: Path) -> list[Node]:
    """The nodes recorded for a cluster started from `data_dir` (empty when there is none)."""
    try:
        rows = json.loads((Path(data_dir) / CLUSTER_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [Node(r["node_id"], r["port"], r["controller_port"], Path(r["data_dir"])) for r in rows]
