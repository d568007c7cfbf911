"""Metrics and structured logs: the /metrics endpoint answers with the run's numbers (real broker and TQ)."""

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import msgpack
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from schemas.deadletter import DECODE_ERROR, METADATA_VIOLATION
from streams.producer import AckedProducer, Outgoing
from streams.tq import TRAIN, ray_address
from tests.integration.helpers import dead_letters, drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.telemetry.prometheus import PrometheusReassemblerSensor, start_metrics_server
from workers.telemetry.sensors import ReassemblerStats, fan_out


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }


def test_metrics_endpoint_counts_match_the_run(kafka, tq_store, unique):
    names = setup_topics(kafka, f"met-{unique}", partitions=2)
    groups = publish_groups(kafka, tq_store, names, 6, prefix=f"{unique}-m")
    body = msgpack.unpackb(next(iter(groups.values()))[0].receipt.to_bytes())
    AckedProducer(kafka).send(
        [
            Outgoing(names.receipts, b"x", b"\xc1garbage"),
            Outgoing(names.receipts, b"y", b"\xc1again"),
            Outgoing(names.receipts, b"z", msgpack.packb(dict(body, token_ids=[1, 2]))),
        ]
    )
    registry = CollectorRegistry()
    stats = ReassemblerStats()
    port = start_metrics_server(0, addr="127.0.0.1", registry=registry)
    assert port > 0
    worker = ReassemblerWorker(
        kafka,
        tq_store,
        ReassemblerConfig(prefix=names.prefix, worker_id="m0", consumer_group=f"reassemblers.{names.prefix}"),
        sensor=fan_out(PrometheusReassemblerSensor(registry), stats),
    )
    try:
        drive(
            [worker],
            lambda: len(finalized_records(kafka, names)) >= 6 and len(dead_letters(kafka, names)) >= 3,
            timeout_s=120,
        )
        for _ in range(5):  # a few idle steps: gauges settle after the last commit
            worker.step()
    finally:
        worker.close()
    m = _scrape(port)
    assert m[("rlstream_receipts_consumed_total", ())] == 6 * 8 + 3 == stats.receipts
    assert m[("rlstream_groups_finalized_total", ())] == 6
    assert m[("rlstream_dead_letters_total", (("reason", DECODE_ERROR),))] == 2
    assert m[("rlstream_dead_letters_total", (("reason", METADATA_VIOLATION),))] == 1
    assert m[("rlstream_transaction_aborts_total", ())] == 0
    assert m[("rlstream_open_groups", ())] == 0
    assert 1 <= m[("rlstream_finalize_latency_seconds_count", ())] <= stats.transactions
    assert m[("rlstream_finalize_latency_seconds_sum", ())] > 0
    lags = {k: v for k, v in m.items() if k[0] == "rlstream_consumer_lag_records"}
    assert {dict(k[1])["partition"] for k in lags} == {"0", "1"} and set(lags.values()) == {0.0}
    tq_store.clear(TRAIN, [s for r in finalized_records(kafka, names) for s in r.sample_ids])


def test_reassemble_cli_serves_metrics_and_logs_json(kafka, tq_store, unique, tmp_path):
    names = setup_topics(kafka, f"metcli-{unique}", partitions=1)
    publish_groups(kafka, tq_store, names, 3, prefix=f"{unique}-c")
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli.main",
                "reassemble",
                "--bootstrap-servers",
                kafka.bootstrap_servers,
                "--prefix",
                names.prefix,
                "--consumer-group",
                f"g.{unique}",
                "--ray-address",
                ray_address(),
                "--metrics-port",
                "0",
                "--log-json",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        port = None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"metrics: http://0\.0\.0\.0:(\d+)/metrics", log_path.read_text())
            port = int(found.group(1)) if found else None
            time.sleep(0.5)
        assert port, log_path.read_text()
        drive([], lambda: len(finalized_records(kafka, names)) >= 3, timeout_s=120)
        # The worker labels its series with its run's prefix: one Prometheus tells runs apart.
        run = (("prefix", names.prefix),)
        deadline = time.monotonic() + 30
        while _scrape(port).get(("rlstream_groups_finalized_total", run)) != 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        m = _scrape(port)
        assert m[("rlstream_groups_finalized_total", run)] == 3
        assert m[("rlstream_receipts_consumed_total", run)] == 24
        assert not [k for k in m if k[0].startswith("rlstream_") and dict(k[1]).get("prefix") != names.prefix]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    parsed = [json.loads(line) for line in lines]
    assert any(p["msg"].startswith("reassemble: 1 worker(s)") for p in parsed)
    assert any(p["logger"] == "rlstream.reassembler" and "assigned [0]" in p["msg"] for p in parsed)
    tq_store.clear(TRAIN, [s for r in finalized_records(kafka, names) for s in r.sample_ids])
