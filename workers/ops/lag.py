"""`rlstream lag`: committed versus end offsets of the reassembler and trainer consumer groups."""

from __future__ import annotations

from dataclasses import dataclass

from streams.config import KafkaConfig
from streams.consumer import committed_offsets, end_offsets
from workers.reassembler.config import DEFAULT_CONSUMER_GROUP
from workers.topics import TopicNames


@dataclass(frozen=True)
class LagRow:
    consumer_group: str
    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int

    def line(self) -> str:
        committed = "-" if self.committed is None else str(self.committed)
        return f"{self.consumer_group}\t{self.topic}\t{self.partition}\t{committed}\t{self.end}\t{self.lag}"


def consumer_group_lag(kafka: KafkaConfig, consumer_group: str, topic: str) -> list[LagRow]:
    """Per partition: the group's committed offset (None if it has none), the end offset and the lag.

    The end is the last stable offset (read_committed), what a transactional consumer can reach;
    a group without a committed offset lags by everything still retained. As in Kafka's own tools,
    a trailing transaction marker counts as 1 until the next record is consumed past it.
    """
    ends = end_offsets(kafka, topic)
    committed = committed_offsets(kafka, consumer_group, topic)
    rows = []
    for p, (low, high) in sorted(ends.items()):
        c = committed.get(p, -1001)
        rows.append(
            LagRow(consumer_group, topic, p, c if c >= 0 else None, high, max(0, high - (c if c >= 0 else low)))
        )
    return rows


def lag(
    kafka: KafkaConfig,
    names: TopicNames,
    *,
    reassembler_consumer_group: str = DEFAULT_CONSUMER_GROUP,
    trainer_consumer_group: str = "trainer",
    input_topic: str | None = None,
) -> list[LagRow]:
    """Lag of the reassembler group on receipts (or `input_topic`) and of the trainer group on finalized."""
    return consumer_group_lag(kafka, reassembler_consumer_group, input_topic or names.receipts) + consumer_group_lag(
        kafka, trainer_consumer_group, names.finalized
    )
