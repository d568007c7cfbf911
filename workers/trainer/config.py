"""Every setting of the trainer's experience consumer, defined once with its default, bounds and doc line."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from streams.errors import ConfigError
from streams.settings import Settings
from streams.tq import TRAIN
from workers.topics import TopicNames

# The consumer group a trainer joins unless told otherwise.
DEFAULT_CONSUMER_GROUP = "trainer"


def default_pad_values() -> dict[str, int]:
    return {"input_ids": 0}


class ConsumerConfig(Settings, frozen=True):
    """Topics, consumer group, TQ partition and memory bounds of the trainer's experience consumer."""

    section = "trainer"

    prefix: Annotated[str, Meta(description="topic name prefix, so several runs can share a cluster")] = ""
    consumer_group: Annotated[
        str, Meta(min_length=1, description="Kafka consumer group of the trainer; its committed offsets are its place")
    ] = DEFAULT_CONSUMER_GROUP
    input_topic: Annotated[
        str | None,
        Meta(description="read finalized groups from this topic instead of the prefix's finalized topic"),
    ] = None
    train_partition: Annotated[str, Meta(min_length=1, description="TQ partition holding the packed training rows")] = (
        TRAIN
    )
    pad_value_dict: Annotated[
        dict[str, int], Meta(description="pad value per tensor field of a batch (fields not listed pad with 0)")
    ] = msgspec.field(default_factory=default_pad_values)
    stale_replay: Annotated[
        str | None,
        Meta(description="replay topic name (under the prefix) that receives groups evicted as stale; unset: dropped"),
    ] = None
    max_poll_records: Annotated[int, Meta(ge=1, le=100_000, description="finalized records read per poll at most")] = (
        500
    )
    # The consumer's memory bound: each waiting group holds only its record, its rows stay in TQ.
    max_waiting_groups: Annotated[
        int, Meta(ge=1, le=10_000_000, description="groups held or ready at which fetching pauses")
    ] = 10_000
    max_seen_groups: Annotated[
        int,
        Meta(ge=1, le=100_000_000, description="group ids remembered to drop duplicates, oldest forgotten first"),
    ] = 1_000_000
    checkpointed: Annotated[
        bool,
        Meta(
            description="resume with the model: acked rows stay in TQ and offsets stay uncommitted until"
            " checkpoint_durable(state_dict()) says a checkpoint covering them is stored"
        ),
    ] = False
    hand_back_lost_rows: Annotated[
        bool,
        Meta(
            description="hand a group whose rows are gone from TQ back to the rollout workers (rollout.regenerate)"
            " instead of dead-lettering it as missing_rows"
        ),
    ] = True
    max_tq_failures: Annotated[
        int,
        Meta(
            ge=1,
            le=10_000,
            description="TQ failures of materialize in a row given back as 'not now' (RowsUnsettled) before"
            " the next is raised as it is",
        ),
    ] = 20
    session_timeout_ms: Annotated[
        int,
        Meta(
            ge=1000, le=300_000, description="consumer-group session timeout: how soon a dead trainer's partitions move"
        ),
    ] = 10_000
    max_poll_interval_ms: Annotated[
        int,
        Meta(
            ge=1000,
            le=86_400_000,
            description="longest trainer step between polls before the consumer leaves its group and rejoins"
            " (at least session_timeout_ms)",
        ),
    ] = 300_000

    def __post_init__(self) -> None:
        if self.max_poll_interval_ms < self.session_timeout_ms:
            raise ConfigError(
                f"max_poll_interval_ms ({self.max_poll_interval_ms}) must be at least"
                f" session_timeout_ms ({self.session_timeout_ms})"
            )

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.prefix)

    @property
    def finalized_topic(self) -> str:
        return self.input_topic or self.topics.finalized
