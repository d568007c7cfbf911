"""Two Ray nodes on this machine (`ray start --head` and `ray start --address`), the demo attached to them.

The cluster is this module's own, not the session's Ray: its own ports, temp dir and auth token, so
it never attaches to another Ray on the machine. Each node is a `ray start --block` process; SIGTERM
to it stops that node's daemons and workers (Ray fate-shares them with it), and the fixture checks,
by pid, that nothing it started is left running. The demo runs as a subprocess (this pytest process
may hold the session's Ray) and the placement is read back from Ray's state API in another one.

Drills (`make drills`): two nodes take 25-60 s to start on a small machine, before the demo runs.
The placement logic itself is checked in the default suite by tests/unit/streams/test_tq_placement.py.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from streams.pids import die_with_parent, forget_pid, record_pid

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
# Each node: TQ's controller (head, usually) and one storage unit take a CPU each, one reassembler
# actor another; logical CPUs, not cores.
NODE_CPUS = 3
DATA = "rlstream_data"  # the custom resource both nodes offer: where storage units and reassemblers may run
NODES = ({"rlstream_head": 1, DATA: 1}, {"rlstream_node2": 1, DATA: 1})
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


@dataclass
class RayCluster:
    address: str
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run_python(self, code: str, timeout: float = 120) -> str:
        """Run `code` in a fresh interpreter attached to this cluster; its stdout."""
        proc = subprocess.run(
            [sys.executable, "-c", code, self.address],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_ports(ports: list[int]) -> list[str]:
    # Every port a node listens on, chosen free, so a second node on this host (and other people's
    # Ray instances) never collides with the defaults (agent 52365, client server 10001, ...).
    names = (
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    )
    return [a for name, port in zip(names, ports) for a in (name, str(port))]


def _start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen | None:
    """Start one node and wait until it is up; None (and nothing left running) if it did not come up."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [RAY, "start", *args, "--disable-usage-stats", "--block"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    record_pid("ray", proc.pid)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "block forever" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop([proc])
            return None
        time.sleep(0.3)
    return proc


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    """SIGTERM each node (last started first) and wait; pids of its processes still running after."""
    tree = {p.pid: _descendants(p.pid) for p in procs}
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        forget_pid("ray", p.pid)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    left = [pid for pids in tree.values() for pid in pids]
    while left and time.monotonic() < deadline:
        left = [pid for pid in left if _running(pid)]
        time.sleep(0.2)
    for pid in left:  # ours by pid: a node's daemon or worker that outlived its node
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    return left


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _node_args(i: int, cluster: RayCluster, tmp: Path) -> list[str]:
    gcs, client, dashboard, *ports = _free_ports(9)
    if i == 0:
        cluster.address = f"127.0.0.1:{gcs}"
        where = ["--head", "--port", str(gcs), "--ray-client-server-port", str(client), "--temp-dir", str(tmp / "ray")]
        # Ray's state API (where each actor ran) is served by the dashboard.
        where += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard)]
    else:
        where = ["--address", cluster.address]
    resources = ["--num-cpus", str(NODE_CPUS), "--resources", json.dumps(NODES[i])]
    return [*where, *resources, "--object-store-memory", str(100 * 2**20), *_node_ports(ports)]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    # A short temp dir: Ray's unix socket paths must stay under ~107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="rlmn-", dir="/tmp"))
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        **os.environ,
        # Ray >= 2.5x turns token auth on for `ray start --head`: every node and driver needs the token.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(REPO),
    }
    env.pop("RAY_ADDRESS", None)
    cluster = RayCluster("", env)
    try:
        for i in range(len(NODES)):
            # A node that does not come up on a loaded machine (its GCS or raylet RPCs time out) is
            # started once more, on fresh ports.
            for attempt in range(2):
                log = tmp / f"node{i}-{attempt}.log"
                proc = _start_node(_node_args(i, cluster, tmp), env, log)
                if proc is not None:
                    break
            else:
                pytest.fail(f"Ray node {i} did not come up:\n{log.read_text(errors='replace')[-3000:]}")
            cluster.procs.append(proc)
        # Drivers attach to this cluster, never "auto": other Ray instances run on this machine.
        env["RAY_ADDRESS"] = cluster.address
        yield cluster
    finally:
        left = _stop(cluster.procs)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes still running after their nodes stopped: {left}"


# Run attached to the cluster: its nodes, which offer which resource, and every actor with its node.
PLACEMENT = """
import json, sys
import ray
from ray.util.state import list_actors
from streams.tq import nodes_offering
from streams.errors import TQError

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
try:
    nodes_offering("rlstream_nowhere")
    nowhere = "no error"
except TQError as exc:
    nowhere = str(exc)
print(json.dumps({
    "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
    "data_nodes": nodes_offering("rlstream_data"),
    "node2": nodes_offering("rlstream_node2"),
    "nowhere": nowhere,
    "actors": [{"class": a.class_name, "node": a.node_id} for a in list_actors(address=sys.argv[1], limit=10000)],
}))
"""


def _demo(cluster: RayCluster, bootstrap: str, out: Path) -> subprocess.CompletedProcess:
    args = ["--bootstrap-servers", bootstrap, "--ray-address", cluster.address, "--placement-resource", DATA]
    args += ["--groups", "12", "--producers", "2", "--reassemblers", "2", "--partitions", "2", "--timeout", "240"]
    return subprocess.run(
        [sys.executable, "-m", "workers.cli.main", "demo", *args, "--json", str(out)],
        env=cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.drill
def test_two_nodes_each_offer_the_data_resource(ray_cluster):
    placed = json.loads(ray_cluster.run_python(PLACEMENT))
    assert len(placed["nodes"]) == 2
    assert placed["data_nodes"] == placed["nodes"]
    assert len(placed["node2"]) == 1 and placed["node2"][0] in placed["nodes"]
    assert "no alive Ray node offers custom resource 'rlstream_nowhere'" in placed["nowhere"]


@pytest.mark.drill
def test_demo_attached_to_two_nodes_spreads_tq_and_reassemblers_and_accounts_for_every_group(
    ray_cluster, broker, tmp_path
):
    out = tmp_path / "demo.json"
    proc = _demo(ray_cluster, broker.bootstrap_servers, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reassemblers: 2 Ray actors on 2 of 2 Ray node(s)" in proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert report["accounted"] is True and report["problems"] == []
    assert report["groups_produced"] == 12
    outcomes = report["groups_consumed"] + report["groups_evicted_stale"] + report["groups_dead_lettered"]
    assert outcomes == report["groups_produced"]
    # Where everything ran, from Ray's state API (the demo's actors are dead by now; Ray keeps their node).
    placed = json.loads(ray_cluster.run_python(PLACEMENT))
    nodes_of = {}
    for a in placed["actors"]:
        nodes_of.setdefault(a["class"], []).append(a["node"])
    assert len(nodes_of["SimpleStorageUnit"]) == 2 and set(nodes_of["SimpleStorageUnit"]) == set(placed["nodes"])
    assert len(nodes_of["RolloutReassemblerActor"]) == 2
    assert set(nodes_of["RolloutReassemblerActor"]) == set(placed["nodes"])
    assert sorted(r["node_id"] for r in report["reassemblers"]) == sorted(nodes_of["RolloutReassemblerActor"])
    assert sum(r["finalized"] for r in report["reassemblers"]) >= report["groups_finalized"] > 0
