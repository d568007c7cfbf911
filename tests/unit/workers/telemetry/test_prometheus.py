"""The Prometheus sensors against a fresh registry: metric names, values, bounded lag series, /metrics."""

import urllib.request

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from workers.telemetry.prometheus import (
    PrometheusReassemblerSensor,
    PrometheusTrainerSensor,
    process_registry,
    start_metrics_server,
)
from workers.telemetry.sensors import ReassemblerSensor, TrainerSensor


def _lag_series(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.labels["topic"], s.labels["partition"]): s.value
        for fam in registry.collect()
        if fam.name == "rlstream_consumer_lag_records"
        for s in fam.samples
    }


def test_reassembler_sensor_counts_receipts_commits_dead_letters_aborts_and_open_groups():
    r = CollectorRegistry()
    s = PrometheusReassemblerSensor(r)
    assert isinstance(s, ReassemblerSensor)
    s.on_receipts(40)
    s.on_receipts(11)
    s.on_commit(seconds=0.2, finalized=6, dead_letters={"decode_error": 2})
    s.on_commit(seconds=0.4, finalized=0, dead_letters={"metadata_violation": 1})
    s.on_commit(seconds=0.01, finalized=0, dead_letters={})  # an idle step: offsets only
    s.on_abort()
    s.on_open_groups(5, paused=True)
    get = r.get_sample_value
    assert get("rlstream_receipts_consumed_total") == 51
    assert get("rlstream_groups_finalized_total") == 6
    assert get("rlstream_dead_letters_total", {"reason": "decode_error"}) == 2
    assert get("rlstream_dead_letters_total", {"reason": "metadata_violation"}) == 1
    assert get("rlstream_transaction_aborts_total") == 1
    assert get("rlstream_open_groups") == 5 and get("rlstream_fetch_paused") == 1
    assert get("rlstream_finalize_latency_seconds_count") == 2
    assert abs(get("rlstream_finalize_latency_seconds_sum") - 0.6) < 1e-9
    s.on_open_groups(0, paused=False)
    assert get("rlstream_open_groups") == 0 and get("rlstream_fetch_paused") == 0


def test_lag_series_of_revoked_partitions_are_removed():
    r = CollectorRegistry()
    s = PrometheusReassemblerSensor(r)
    s.on_lag("receipts", {0: 10, 1: 3, 2: -4})
    assert _lag_series(r) == {("receipts", "0"): 10, ("receipts", "1"): 3, ("receipts", "2"): 0}
    s.on_lag("receipts", {1: 0, 3: 7})
    assert _lag_series(r) == {("receipts", "1"): 0, ("receipts", "3"): 7}
    s.on_lag("replay", {0: 1})
    s.on_lag("receipts", {})
    assert _lag_series(r) == {("replay", "0"): 1}
    for p in range(1000):  # a long run of rebalances leaves only the current assignment
        s.on_lag("replay", {p: p})
    assert _lag_series(r) == {("replay", "999"): 999}


def test_trainer_sensor_records_staleness_evictions_yields_and_duplicates():
    r = CollectorRegistry()
    t = PrometheusTrainerSensor(r)
    assert isinstance(t, TrainerSensor)
    for min_wv in (5, 4, 4, 1, 7):
        t.on_yield(5, min_wv)
    t.on_evict(3)
    t.on_evict()
    t.on_duplicate()
    get = r.get_sample_value
    assert get("rlstream_trainer_yielded_groups_total") == 5
    assert get("rlstream_trainer_staleness_versions_count") == 5
    assert get("rlstream_trainer_staleness_versions_sum") == 0 + 1 + 1 + 4 + 0  # a newer group counts 0
    assert get("rlstream_trainer_staleness_versions_bucket", {"le": "1.0"}) == 4
    assert get("rlstream_trainer_evicted_groups_total") == 4
    assert get("rlstream_trainer_duplicate_groups_total") == 1


def test_sensors_on_one_registry_share_its_families():
    r = CollectorRegistry()
    a, b = PrometheusReassemblerSensor(r), PrometheusReassemblerSensor(r)
    PrometheusTrainerSensor(r)
    PrometheusTrainerSensor(r)
    a.on_receipts(2)
    b.on_receipts(3)
    assert r.get_sample_value("rlstream_receipts_consumed_total") == 5
    assert PrometheusReassemblerSensor().registry is process_registry()
    assert PrometheusReassemblerSensor().registry is process_registry()


def test_metrics_server_serves_the_registry():
    r = CollectorRegistry()
    PrometheusTrainerSensor(r).on_yield(3, 1)
    port = start_metrics_server(0, addr="127.0.0.1", registry=r)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert samples["rlstream_trainer_yielded_groups_total"] == 1
    assert samples["rlstream_trainer_staleness_versions_sum"] == 2
