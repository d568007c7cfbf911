"""A KRaft node's data directory: its properties, and its storage, formatted once and resumed after.

    <dir>/server.properties   the node's settings (node id, listener ports), rewritten on each start
    <dir>/kraft-logs/         log.dirs: meta.properties (cluster id, node id), topics, offsets, transactions
    <dir>/security/           a secured broker's CA, certificate and credentials (`streams/security.py`)

A start on formatted storage resumes it: the same cluster id (kept in meta.properties), node id and
listener ports (read back from server.properties), so topics, committed offsets and open
transactions survive a stop. Only an empty or unformatted directory is formatted; `fresh` wipes the
storage first. A cluster keeps one such directory per node, `<dir>/node-<id>`.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from streams.config import write_private
from streams.errors import BrokerError

STORAGE_TOOL = "kafka.tools.StorageTool"
STORAGE_DIR = "kraft-logs"
META_FILE = "meta.properties"
# Ten years: committed offsets outlast any outage the records do (they are kept for good).
OFFSETS_RETENTION_MINUTES = 10 * 365 * 24 * 60
PROPERTIES_FILE = "server.properties"
SECURITY_DIR = "security"
NODE_PREFIX = "node-"  # a cluster's node directories: node-1, node-2, ...
_LISTENER = re.compile(r"(PLAINTEXT|SASL_SSL|CONTROLLER)://[^,:]+:(\d+)")


@dataclass(frozen=True)
class StoredNode:
    """Formatted storage in a node's directory, and the ids and ports it was last started with."""

    node_id: int
    cluster_id: str
    port: int
    controller_port: int
    data_dir: Path
    security: str = "plaintext"  # or "sasl_ssl": the client listener it was formatted for


def check_port_free(port: int, hint: str) -> None:
    """Fail with a one-line reason (and `hint`, what to do) when `port` on 127.0.0.1 is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the JVM binds: connections of a stopped broker lingering in TIME_WAIT do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise BrokerError(f"port {port} on 127.0.0.1 is in use ({exc.strerror}); {hint}") from None


def read_properties(path: Path) -> dict[str, str]:
    """`key=value` lines of a Java properties file (comments skipped, backslash escapes undone)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#!" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = re.sub(r"\\(.)", r"\1", value.strip())
    return out


def node_dir(data_dir: Path, node_id: int) -> Path:
    return data_dir / f"{NODE_PREFIX}{node_id}"


def is_formatted(data_dir: Path) -> bool:
    return (data_dir / STORAGE_DIR / META_FILE).is_file()


def stored_node(data_dir: Path) -> StoredNode | None:
    """The formatted storage in data_dir, None when there is none; a record that cannot be resumed fails."""
    meta_path = data_dir / STORAGE_DIR / META_FILE
    if not meta_path.is_file():
        return None
    props_path = data_dir / PROPERTIES_FILE

    def refuse(reason: str) -> BrokerError:
        return BrokerError(f"cannot resume the Kafka storage in {data_dir}: {reason}; pass --fresh to format it anew")

    try:
        meta, props = read_properties(meta_path), read_properties(props_path)
    except OSError as exc:
        raise refuse(f"{exc.filename} is unreadable ({exc.strerror})") from None
    ports = dict(_LISTENER.findall(props.get("listeners", "")))
    client = "SASL_SSL" if "SASL_SSL" in ports else "PLAINTEXT"
    if client not in ports or "CONTROLLER" not in ports:
        raise refuse(f"{props_path} names no client (PLAINTEXT or SASL_SSL) and CONTROLLER listener ports")
    if not meta.get("cluster.id") or meta.get("node.id") != props.get("node.id"):
        raise refuse(f"{meta_path} and {props_path} disagree on the node id, or the cluster id is missing")
    node_id = int(meta["node.id"])
    port, controller_port = int(ports[client]), int(ports["CONTROLLER"])
    return StoredNode(node_id, meta["cluster.id"], port, controller_port, data_dir, client.lower())


def node_dirs(data_dir: Path) -> list[Path]:
    """The cluster node directories under data_dir (node-1, node-2, ...), in node order."""
    found = [d for d in data_dir.glob(f"{NODE_PREFIX}*") if d.is_dir() and d.name[len(NODE_PREFIX) :].isdigit()]
    return sorted(found, key=lambda d: int(d.name[len(NODE_PREFIX) :]))


def wipe_node(data_dir: Path) -> None:
    """Delete one node's Kafka data (its properties and logs stay)."""
    shutil.rmtree(data_dir / STORAGE_DIR, ignore_errors=True)


def wipe_storage(data_dir: Path) -> None:
    """Delete the Kafka data under data_dir: a single broker's and every cluster node's, and their credentials."""
    for d in (data_dir, *node_dirs(data_dir)):
        wipe_node(d)
    # Credentials and the CA belong to the wiped metadata log (the SCRAM users are stored in it).
    shutil.rmtree(data_dir / SECURITY_DIR, ignore_errors=True)


def prepare_storage(data_dir: Path, brokers: int, *, fresh: bool) -> list[StoredNode]:
    """The nodes to resume for a start of `brokers` nodes from data_dir; empty: format anew.

    With `fresh`, every storage under data_dir is wiped first. Storage of another shape (a
    cluster's for one broker, one broker's or another size of cluster for a cluster) is refused.
    """
    if fresh:
        wipe_storage(data_dir)
    single = stored_node(data_dir)
    nodes = [n for n in (stored_node(d) for d in node_dirs(data_dir)) if n is not None]
    if brokers == 1 and single is not None:
        return [single]
    if brokers == 1 and nodes:
        raise BrokerError(
            f"{data_dir} holds the Kafka storage of a {len(nodes)}-broker cluster; "
            f"start it with --brokers {len(nodes)}, or pass --fresh to discard it"
        )
    if brokers > 1 and single is not None and not nodes:
        raise BrokerError(
            f"{data_dir} holds the Kafka storage of a single broker; start it without --brokers, "
            "or pass --fresh to discard it"
        )
    ids = [n.node_id for n in nodes]
    if nodes and ids != list(range(1, brokers + 1)):
        raise BrokerError(
            f"{data_dir} holds the Kafka storage of cluster nodes {ids}, not of nodes 1..{brokers}; "
            f"start it with --brokers {len(ids)}, or pass --fresh to discard it"
        )
    if len({n.cluster_id for n in nodes}) > 1:
        raise BrokerError(f"the nodes in {data_dir} belong to different clusters; pass --fresh to format them anew")
    return nodes


def server_properties(data_dir: Path, port: int, controller_port: int, extra: tuple[tuple[str, str], ...] = ()) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir / STORAGE_DIR),
        # One node: internal topics must not ask for more replicas than exist, or
        # transactions and group offsets never become available.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "8",
        "min.insync.replicas": "1",
        "auto.create.topics.enable": "false",
        "group.initial.rebalance.delay.ms": "0",
        # Lets tests and crash drills use short consumer sessions and transaction timeouts.
        "group.min.session.timeout.ms": "1000",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
        "num.partitions": "1",
        # A group's committed offsets are kept this long once it is empty (Kafka's default: 7 days). The
        # topics keep their records for good; a job down longer than a week came back with its
        # reassemblers', trainer's and rollout workers' places gone (issue 30).
        "offsets.retention.minutes": str(OFFSETS_RETENTION_MINUTES),
    }
    props.update(dict(extra))
    return "".join(f"{k}={v}\n" for k, v in props.items())


def write_node_files(data_dir: Path, properties: str) -> Path:
    """The node's properties and log4j files in data_dir (storage untouched); returns the properties file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if not is_formatted(data_dir):
        wipe_node(data_dir)  # what a failed format left, if anything
    props = data_dir / PROPERTIES_FILE
    write_private(props, properties)  # a secured node's file holds its broker login
    log4j = data_dir / "log4j2.yaml"
    log4j.write_bytes(resources.files("streams").joinpath("resources/log4j2.yaml").read_bytes())
    return props


def log4j_option(data_dir: Path) -> str:
    return f"-Dlog4j2.configurationFile={data_dir / 'log4j2.yaml'}"


def format_storage(
    jvm: list[str], props: Path, data_dir: Path, cluster_id: str, secret_args: tuple[str, ...] = ()
) -> None:
    """Format the KRaft storage named in `props` for cluster `cluster_id`; a failed format leaves none.

    `secret_args` (SCRAM credentials) reach the tool through a 0600 Java @argfile, deleted after, so
    they never show on a command line; a failure's output is printed with them masked.
    """
    tool = [STORAGE_TOOL, "format", "-t", cluster_id, "-c", str(props), *secret_args]
    argfile = data_dir / "format.args"
    if secret_args:
        write_private(argfile, "\n".join(_argfile_quote(a) for a in tool) + "\n")
        tool = [f"@{argfile}"]
    try:
        fmt = subprocess.run([*jvm, log4j_option(data_dir), *tool], capture_output=True, text=True)
    finally:
        argfile.unlink(missing_ok=True)
    if fmt.returncode != 0:
        wipe_node(data_dir)
        output = (fmt.stdout + fmt.stderr)[-2000:]
        for arg in secret_args:
            output = output.replace(arg, "***")
        raise BrokerError(f"formatting KRaft storage in {data_dir} failed:\n{output}")


def _argfile_quote(arg: str) -> str:
    # A Java @argfile token: double-quoted, with backslashes and quotes escaped.
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
