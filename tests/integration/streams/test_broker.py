"""Broker lifecycle: start, status, stop with nothing left behind, a port already in use, and a restart
that resumes the data directory (or, with --fresh, wipes it)."""

import socket
import subprocess
import sys

import pytest
from confluent_kafka import Consumer, TopicPartition

from streams.admin import TopicSpec, create_topics, list_topics
from streams.broker import BrokerConfig, BrokerError, broker_status, start_broker, stop_broker
from streams.config import KafkaConfig
from streams.consumer import committed_offsets, end_offsets, read_topic, wait_until
from streams.producer import Outgoing, TransactionalProducer


def _java_pids_for(data_dir) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"{data_dir}/server.properties"], capture_output=True, text=True)
    return out.stdout.split()


def test_start_status_stop_leaves_no_java_process(tmp_path):
    handle = start_broker(BrokerConfig(data_dir=tmp_path))
    try:
        status = broker_status(tmp_path)
        assert status.running and status.ready
        assert status.bootstrap_servers == handle.bootstrap_servers
        assert _java_pids_for(tmp_path) == [str(handle.pid)]
    finally:
        assert stop_broker(tmp_path) is True
    assert _java_pids_for(tmp_path) == []
    assert broker_status(tmp_path).running is False
    assert stop_broker(tmp_path) is False


def test_port_in_use_fails_with_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} on 127.0.0.1 is in use"):
            start_broker(BrokerConfig(data_dir=tmp_path, port=port))
    assert _java_pids_for(tmp_path) == []


# Opens a transaction, writes one record in it and waits to be killed: the transaction stays open.
_DANGLING = """
import sys, time
from streams.config import KafkaConfig
from streams.producer import Outgoing, TransactionalProducer
p = TransactionalProducer(KafkaConfig(sys.argv[1]), "dangling", transaction_timeout_ms=600000)
p.begin()
p.produce(Outgoing("kept", b"open", b"open"))
p.flush()
print("open", flush=True)
time.sleep(600)
"""


def _open_a_transaction_and_die(bootstrap: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _DANGLING, bootstrap], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
    finally:
        proc.kill()
        proc.wait()


def _write(kafka: KafkaConfig, n: int) -> None:
    create_topics(kafka, [TopicSpec("kept", 1, {})])
    producer = TransactionalProducer(kafka, "committer")
    consumer = Consumer(kafka.consumer("readers"))
    try:
        with producer.transaction():  # the records and the consumer group "readers" at offset 3
            for i in range(n):
                producer.produce(Outgoing("kept", str(i).encode(), str(i).encode()))
            producer.send_offsets([TopicPartition("kept", 0, 3)], consumer.consumer_group_metadata())
    finally:
        consumer.close()
    _open_a_transaction_and_die(kafka.bootstrap_servers)


def test_a_restart_on_the_same_directory_resumes_its_data_and_fresh_wipes_it(tmp_path):
    n = 25
    first = start_broker(BrokerConfig(data_dir=tmp_path))
    try:
        kafka = KafkaConfig(first.bootstrap_servers)
        _write(kafka, n)
    finally:
        assert stop_broker(tmp_path) is True

    again = start_broker(BrokerConfig(data_dir=tmp_path))
    try:
        # Same ports, so clients keep their address; same topics, records, offsets, open transaction.
        assert again.bootstrap_servers == first.bootstrap_servers
        assert "kept" in list_topics(kafka)
        assert sorted(int(r.value) for r in read_topic(kafka, "kept")) == list(range(n))
        assert committed_offsets(kafka, "readers", "kept") == {0: 3}
        # The open transaction still holds the last stable offset at its first record (after the
        # committed records and their commit marker) ...
        assert end_offsets(kafka, "kept")[0][1] == n + 1
        # ... until its producer's successor fences it: the coordinator knew of it and aborts it.
        TransactionalProducer(kafka, "dangling")
        wait_until(lambda: end_offsets(kafka, "kept")[0][1] > n + 1, timeout_s=30, what="the open transaction's abort")
        assert len(list(read_topic(kafka, "kept"))) == n
    finally:
        assert stop_broker(tmp_path) is True

    out = subprocess.run(
        [sys.executable, "-m", "workers.cli.main", "broker", "start", "--data-dir", str(tmp_path), "--fresh"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert out.returncode == 0, out.stderr
        fresh = KafkaConfig(out.stdout.strip().removeprefix("bootstrap.servers="))
        assert "kept" not in list_topics(fresh)
    finally:
        stop_broker(tmp_path)
