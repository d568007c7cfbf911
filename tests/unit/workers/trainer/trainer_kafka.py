"""A trainer's consumer over the in-memory Kafka (`fake_kafka.py`) and store, and finalized records to feed it."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.tq import TRAIN
from tests.unit.manual_runtime import ManualRuntime
from tests.unit.memory_store import InMemoryStore
from tests.unit.workers.trainer.fake_kafka import FakeBroker, NotingStore
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import Policy, ready_first

PREFIX = "u"
NAMES = TopicNames(PREFIX)
GROUP = "trainer-u"


def group(group_id: str, weight_version: int = 0, rows: int = 2) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=group_id,
        prompt_idx=0,
        partition_id=TRAIN,
        sample_ids=tuple(f"{group_id}_g{i}" for i in range(rows)),
        tags=tuple({} for _ in range(rows)),
        group_min_wv=weight_version,
        group_max_wv=weight_version,
        canonical_output_tokens=1,
        valid_row_count=rows,
        total_row_count=rows,
        rejection_reasons=(None,) * rows,
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
    )


class Pipeline:
    """A broker with the pipeline's topics, a store with its train rows, and consumers of one consumer group."""

    def __init__(self, partitions: int = 1):
        self.broker = FakeBroker()
        for spec in pipeline_topics(NAMES, partitions):
            self.broker.create(spec.name, spec.partitions)
        self.rows = InMemoryStore()
        self.store = NotingStore(self.rows, self.broker.events)
        self.clock = ManualRuntime(now=0.0)  # time as the test moves it

    def finalize(self, groups: list[FinalizedGroup], partition: int = 0) -> list[int]:
        """Append the groups' records to the finalized topic and put their rows; their offsets."""
        offsets = []
        for g in groups:
            ids = list(g.sample_ids)
            fields = TensorDict({"input_ids": torch.zeros(len(ids), 3, dtype=torch.long)}, batch_size=[len(ids)])
            self.rows.put(TRAIN, ids, fields, [{} for _ in ids])
            offsets.append(self.broker.append(NAMES.finalized, partition, g.group_id.encode(), g.to_bytes()))
        return offsets

    def consumer(
        self, policy: Policy | None = None, *, version: int = 10, client_settings=None, sensor=None, **config
    ) -> ExperienceConsumer:
        cfg = ConsumerConfig(prefix=PREFIX, consumer_group=GROUP, **config)
        return ExperienceConsumer(
            KafkaConfig("fake:9092"),
            self.store,
            cfg,
            policy or ready_first(),
            version=version,
            clients=self.broker.clients(**(client_settings or {})),
            runtime=self.clock,
            sensor=sensor,
        )

    def commits(self) -> list[tuple]:
        return [e for e in self.broker.events if e[0] == "commit"]

    def present(self, groups: list[FinalizedGroup]) -> set[str]:
        return self.rows.present(TRAIN, [s for g in groups for s in g.sample_ids])


def train(consumer: ExperienceConsumer, n: int, version: int = 10) -> list[str]:
    """Select, materialize and ack groups until n were trained; their ids."""
    trained: list[str] = []
    for _ in range(100):
        if len(trained) >= n:
            return trained
        consumer.poll(0)
        meta = consumer.select(version, min_groups=1, max_groups=n - len(trained), timeout_s=0.0)
        if meta is not None:
            consumer.materialize(meta)
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
    raise AssertionError(f"trained only {trained} of {n}")
