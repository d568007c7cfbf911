"""The Prometheus sensors against a fresh registry: metric names, values, bounded lag series, /metrics."""

import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workers.telemetry.prometheus import (
    PrometheusPoolSensor,
    PrometheusReassemblerSensor,
    PrometheusTrainerSensor,
    process_registry,
    start_metrics_server,
)
from workers.telemetry.sensors import POOL_EXITS, ReassemblerSensor, TrainerSensor


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


def test_every_series_carries_its_run_prefix_and_a_run_without_one_has_no_prefix_label():
    r = CollectorRegistry()
    run1, run2, bare = (PrometheusReassemblerSensor(r, prefix=p) for p in ("run1", "run2", ""))
    run1.on_receipts(5)
    run2.on_receipts(7)
    bare.on_receipts(1)
    run1.on_commit(seconds=0.1, finalized=1, dead_letters={"decode_error": 2})
    run1.on_lag("run1.rollout.receipts", {0: 4})
    get = r.get_sample_value
    assert get("rlstream_receipts_consumed_total", {"prefix": "run1"}) == 5
    assert get("rlstream_receipts_consumed_total", {"prefix": "run2"}) == 7
    assert get("rlstream_receipts_consumed_total") == 1, "an empty prefix is no label, as Prometheus reads it"
    assert get("rlstream_dead_letters_total", {"prefix": "run1", "reason": "decode_error"}) == 2
    assert get("rlstream_consumer_lag_records", {"prefix": "run1", "topic": "run1.rollout.receipts", "partition": "0"})
    labelled = {s.labels.get("prefix") for fam in r.collect() for s in fam.samples if fam.name.startswith("rlstream_")}
    assert labelled == {"run1", "run2", None}, 'no sample exports prefix=""'
    body = generate_latest(r).decode()
    assert 'prefix=""' not in body and 'rlstream_receipts_consumed_total{prefix="run2"} 7.0' in body


def test_series_exist_at_zero_before_their_first_event():
    """A rate of 0 is data; an absent series is not (the dashboard and the alerts need the former)."""
    r = CollectorRegistry()
    PrometheusReassemblerSensor(r, prefix="p")
    PrometheusTrainerSensor(r, prefix="p")
    get = r.get_sample_value
    for name in (
        "rlstream_receipts_consumed_total",
        "rlstream_groups_finalized_total",
        "rlstream_open_groups",
        "rlstream_fetch_paused",
        "rlstream_groups_handed_back_total",
        "rlstream_transaction_aborts_total",
        "rlstream_reassembler_staging_swept_total",
        "rlstream_finalize_latency_seconds_count",
        "rlstream_trainer_evicted_groups_total",
        "rlstream_trainer_yielded_groups_total",
        "rlstream_trainer_duplicate_groups_total",
        "rlstream_trainer_undecodable_records_total",
        "rlstream_trainer_missing_rows_total",
        "rlstream_trainer_groups_handed_back_total",
        "rlstream_trainer_staleness_versions_count",
    ):
        assert get(name, {"prefix": "p"}) == 0, name
    for what in ("producer", "member"):
        assert get("rlstream_reassembler_fenced_total", {"prefix": "p", "what": what}) == 0
    for what in ("producer", "committed offsets", "restore"):
        assert get("rlstream_reassembler_retries_total", {"prefix": "p", "what": what}) == 0


def test_retries_are_counted_by_what_without_the_partition_a_restore_names():
    r = CollectorRegistry()
    s = PrometheusReassemblerSensor(r, prefix="p")
    for what in ("restore of partition 3", "restore of partition 11", "producer", "committed offsets"):
        s.on_retry(what)
    get = r.get_sample_value
    assert get("rlstream_reassembler_retries_total", {"prefix": "p", "what": "restore"}) == 2
    assert get("rlstream_reassembler_retries_total", {"prefix": "p", "what": "producer"}) == 1
    assert get("rlstream_reassembler_retries_total", {"prefix": "p", "what": "committed offsets"}) == 1
    whats = {s.labels["what"] for fam in r.collect() if fam.name == "rlstream_reassembler_retries" for s in fam.samples}
    assert whats == {"restore", "producer", "committed offsets"}, "one series per kind, whatever the partition"


def test_fences_and_the_trainer_version_are_reported():
    r = CollectorRegistry()
    s = PrometheusReassemblerSensor(r, prefix="p")
    s.on_fenced("producer")
    s.on_fenced("producer")
    s.on_fenced("member")
    t = PrometheusTrainerSensor(r, prefix="p")
    t.on_version(0)
    t.on_version(7)
    get = r.get_sample_value
    assert get("rlstream_reassembler_fenced_total", {"prefix": "p", "what": "producer"}) == 2
    assert get("rlstream_reassembler_fenced_total", {"prefix": "p", "what": "member"}) == 1
    assert get("rlstream_trainer_version", {"prefix": "p"}) == 7


def test_pool_sensor_counts_exits_by_how_and_restarts_by_spare_or_process():
    r = CollectorRegistry()
    p = PrometheusPoolSensor(r, prefix="p")
    p.on_worker("w-0")
    p.on_worker("w-1")
    p.on_exit("w-0", "crashed")
    p.on_restart("w-0", by_spare=True)
    p.on_exit("w-0", "crashed")
    p.on_restart("w-0", by_spare=False)
    p.on_exit("w-1", "fenced")
    p.on_running(1, spare_ready=False)
    get = r.get_sample_value
    exits = {(w, how): get("rlstream_pool_worker_exits_total", {"prefix": "p", "worker": w, "how": how})
             for w in ("w-0", "w-1") for how in POOL_EXITS}  # fmt: skip
    assert exits == {
        ("w-0", "crashed"): 2, ("w-0", "fenced"): 0, ("w-0", "stopped"): 0, ("w-0", "failed"): 0,
        ("w-1", "crashed"): 0, ("w-1", "fenced"): 1, ("w-1", "stopped"): 0, ("w-1", "failed"): 0,
    }  # fmt: skip
    assert get("rlstream_pool_worker_restarts_total", {"prefix": "p", "worker": "w-0", "by": "spare"}) == 1
    assert get("rlstream_pool_worker_restarts_total", {"prefix": "p", "worker": "w-0", "by": "process"}) == 1
    assert get("rlstream_pool_worker_restarts_total", {"prefix": "p", "worker": "w-1", "by": "spare"}) == 0
    assert get("rlstream_pool_workers_running", {"prefix": "p"}) == 1
    assert get("rlstream_pool_spare_ready", {"prefix": "p"}) == 0
    p.on_running(2, spare_ready=True)
    assert get("rlstream_pool_spare_ready", {"prefix": "p"}) == 1


def test_the_trainer_s_partitions_waiting_for_their_commits_and_the_failed_reads_are_reported():
    r = CollectorRegistry()
    t = PrometheusTrainerSensor(r, prefix="p")
    get = r.get_sample_value
    # There from the start: a rate of 0 and a gauge at 0 are data, an absent series is not.
    assert get("rlstream_trainer_partitions_waiting", {"prefix": "p"}) == 0
    assert get("rlstream_trainer_commit_reads_failed_total", {"prefix": "p"}) == 0
    t.on_partitions_waiting(3)
    t.on_commit_reads_failed(2)
    t.on_commit_reads_failed()
    t.on_partitions_waiting(1)
    assert get("rlstream_trainer_partitions_waiting", {"prefix": "p"}) == 1
    assert get("rlstream_trainer_commit_reads_failed_total", {"prefix": "p"}) == 3
