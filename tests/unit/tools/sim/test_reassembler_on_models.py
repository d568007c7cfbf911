"""rlstream's reassembler and trainer run on the two models: the proof that they cover the calls both make.

The worker gets the Kafka model through its real client factory (`KafkaClients` over the model's
`SimKafka`), the trainer through `KafkaTrainerClients` likewise, and each process the TQ model
through a real `TQStore(tq=...)`. A group
published is finalized once (its train rows in TQ, its staging cleared, its receipts' offsets
committed with the transaction), then selected, materialized and acked by the trainer (its rows
cleared, its record's offset committed).
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.partitioner import partition_of
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN, TQStore
from tests.tools.sim.env import ManualEnv
from tests.tools.sim.kafka import KafkaCluster, SimKafka
from tests.tools.sim.tq import SimTQ
from workers.reassembler.clients import KafkaClients
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.runtime import RealRuntime
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import windowed


class _EnvClock(RealRuntime):
    """The process's runtime with the model environment's clock as its monotonic clock."""

    def __init__(self, env: ManualEnv):
        self._env = env

    def monotonic(self) -> float:
        return self._env.now()


TINY = SyntheticShape(group_size=2, calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))
KAFKA = KafkaConfig("sim:9092")


def test_a_group_goes_through_the_reassembler_and_the_trainer_on_the_models():
    env = ManualEnv(seed=7)
    cluster = KafkaCluster(env)
    names = TopicNames("m")
    for spec in pipeline_topics(names, partitions=2):
        cluster.create_topic(spec.name, spec.partitions, dict(spec.config))
    tq = SimTQ(env)
    publisher_store = TQStore(tq=tq.module("publisher"))
    rollouts = make_group("g1", 0, 1, shape=TINY, seed=3)
    stage_rollouts(publisher_store, rollouts)
    key, part = b"g1", partition_of(b"g1", 2)
    AckedProducer(KAFKA, api=SimKafka(cluster, "publisher")).send(
        [Outgoing(names.receipts, key, r.receipt.to_bytes(), partition=part) for r in rollouts]
    )

    config = ReassemblerConfig(prefix="m", worker_id="w0", consumer_group="reassemblers.m", poll_timeout_s=0.2)
    runtime = _EnvClock(env)
    clients = KafkaClients(KAFKA, api=SimKafka(cluster, "w0"), runtime=runtime)
    worker = ReassemblerWorker(KAFKA, TQStore(tq=tq.module("w0")), config, clients=clients, runtime=runtime)
    try:
        for _ in range(20):
            worker.step()
            if cluster.records(names.finalized, part):
                break
        worker.step()  # records the staging cleared
        worker._clearer.settle()
    finally:
        worker.close()
    (record,) = [e for p in range(2) for e in cluster.records(names.finalized, p)]
    assert FinalizedGroup.from_bytes(record.value).group_id == "g1"
    assert set(publisher_store.list(TRAIN)) == {"g1_g0", "g1_g1"}
    assert publisher_store.list(STAGING) == {}
    receipts = cluster.groups.fetch("reassemblers.m", [(names.receipts, part)], True)
    assert receipts[(names.receipts, part)][0] == len(rollouts)

    trainer = ExperienceConsumer(
        KAFKA,
        TQStore(tq=tq.module("trainer")),
        ConsumerConfig(prefix="m", session_timeout_ms=6000),
        windowed(1),
        clients=KafkaTrainerClients(KAFKA, api=SimKafka(cluster, "trainer"), runtime=runtime),
        runtime=runtime,
    )
    try:
        meta = trainer.select(0, 1, 1, timeout_s=5.0)
        assert meta is not None and [g.group_id for g in meta.groups] == ["g1"]
        rows = trainer.materialize(meta)
        assert rows.batch_size[0] == 2
        trainer.ack(meta)
    finally:
        trainer.close()
    assert publisher_store.list(TRAIN) == {}
    finalized_part = next(p for p in range(2) if cluster.records(names.finalized, p))
    (tp,) = (
        SimKafka(cluster, "check")
        .Consumer({"group.id": "trainer", "enable.auto.commit": False})
        .committed([TopicPartition(names.finalized, finalized_part)])
    )
    assert tp.offset > record.offset
