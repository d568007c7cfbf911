"""`rlstream broker start --brokers 3`: a real KRaft cluster on loopback, handled whole by status and stop,
and started again on its data."""

import subprocess
import sys

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from streams.cluster import cluster_nodes
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing


def _rlstream(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli.main", *args], capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _config(admin, kind, name, keys):
    (future,) = admin.describe_configs([ConfigResource(kind, name)]).values()
    got = future.result()
    return {k: got[k].value for k in keys}


# Minutes of cluster starts and restarts: run by `make drills`. The suite keeps the short version,
# a 3-broker cluster losing a broker mid-run (tests/integration/reassembler/test_broker_loss.py).
@pytest.mark.drill
def test_a_three_broker_cluster_starts_replicates_and_stops_whole(tmp_path):
    data = tmp_path / "cluster"
    out = _rlstream("broker", "start", "--brokers", "3", "--data-dir", str(data)).stdout
    try:
        servers = out.strip().removeprefix("bootstrap.servers=")
        assert len(servers.split(",")) == 3 and len(cluster_nodes(data)) == 3
        status = _rlstream("broker", "status", "--data-dir", str(data)).stdout.splitlines()
        assert [line.split(":")[0] for line in status] == ["broker 1", "broker 2", "broker 3"]
        assert all(": ready " in line for line in status)

        _rlstream("topics", "create", "--bootstrap-servers", servers, "--prefix", "c", "--partitions", "2")
        admin = AdminClient({"bootstrap.servers": servers})
        md = admin.list_topics(timeout=10)
        assert sorted(md.brokers) == [1, 2, 3]
        assert {len(p.replicas) for p in md.topics["c.rollout.receipts"].partitions.values()} == {3}
        topic = _config(admin, ConfigResource.Type.TOPIC, "c.reassembler.state", ["min.insync.replicas"])
        assert topic == {"min.insync.replicas": "2"}
        broker = _config(
            admin, ConfigResource.Type.BROKER, "2",
            ["transaction.state.log.replication.factor", "transaction.state.log.min.isr"],
        )  # fmt: skip
        assert broker == {"transaction.state.log.replication.factor": "3", "transaction.state.log.min.isr": "2"}
        producer = AckedProducer(KafkaConfig(servers))
        producer.send([Outgoing("c.rollout.receipts", str(i).encode(), str(i).encode()) for i in range(20)])
        producer.close()
    finally:
        stopped = _rlstream("broker", "stop", "--data-dir", str(data)).stdout
    assert stopped.count(" stopped") == 3
    after = _rlstream("broker", "status", "--data-dir", str(data), check=False)
    # Stopped whole: the cluster's record is gone with it, and nothing answers from the directory.
    assert after.returncode == 1 and "stopped" in after.stdout and cluster_nodes(data) == []

    # Started again on the same directory: every node resumes its storage on its old ports.
    single = _rlstream("broker", "start", "--data-dir", str(data), check=False)
    assert single.returncode == 1 and "holds the Kafka storage of a 3-broker cluster" in single.stderr
    again = _rlstream("broker", "start", "--brokers", "3", "--data-dir", str(data)).stdout
    try:
        assert again == out
        records = read_topic(KafkaConfig(servers), "c.rollout.receipts")
        assert sorted(int(r.value) for r in records) == list(range(20))
    finally:
        _rlstream("broker", "stop", "--data-dir", str(data))
