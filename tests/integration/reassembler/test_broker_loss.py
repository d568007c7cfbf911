"""Exactly once across the loss of a broker: a 3-broker cluster, one broker SIGKILLed mid-run and restarted."""

import pytest

from streams.admin import create_topics
from streams.cluster import ClusterConfig, LocalCluster
from streams.config import KafkaConfig
from tests.integration.helpers import drive, finalized_records, publish_groups
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.topics import TopicNames, pipeline_topics


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(ClusterConfig(data_dir=tmp_path_factory.mktemp("cluster"), brokers=3)) as c:
        yield c


def _finalized(kafka, names) -> list[str]:
    return [r.group_id for r in finalized_records(kafka, names)]


def test_a_broker_killed_mid_run_loses_nothing_duplicates_nothing_and_finalizing_goes_on(cluster, tq_store, unique):
    kafka = KafkaConfig(cluster.bootstrap_servers)
    names = TopicNames(f"loss-{unique}")
    create_topics(kafka, pipeline_topics(names, 4, replication_factor=3))
    config = ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=f"reassemblers.{names.prefix}")
    worker = ReassemblerWorker(kafka, tq_store, config)
    try:
        groups = publish_groups(kafka, tq_store, names, 20, prefix="before-")
        drive([worker], lambda: len(_finalized(kafka, names)) >= 10, timeout_s=180)
        cluster.kill(2)
        at_kill = len(set(_finalized(kafka, names)))
        # Producing and finalizing go on with two of three brokers (min.insync.replicas=2).
        groups.update(publish_groups(kafka, tq_store, names, 20, prefix="during-"))
        drive([worker], lambda: any(g.startswith("during-") for g in _finalized(kafka, names)), timeout_s=240)
        during = len(set(_finalized(kafka, names)))
        cluster.restart(2)
        groups.update(publish_groups(kafka, tq_store, names, 10, prefix="after-"))
        drive([worker], lambda: len(set(_finalized(kafka, names))) >= len(groups), timeout_s=240)
    finally:
        worker.close()
    assert during > at_kill, "nothing was finalized while the broker was down"
    # A fresh read_committed read of the finalized topic: every group once, none twice, none unknown.
    seen = _finalized(kafka, names)
    assert sorted(seen) == sorted(groups)
