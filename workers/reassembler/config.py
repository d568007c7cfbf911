"""Every setting of a reassembler worker, defined once with its default, bounds and doc line."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.request import RolloutReassemblerActorConfig
from streams.settings import Settings
from streams.tq import STAGING, TRAIN
from workers.topics import TopicNames

# The consumer group production reassemblers join unless told otherwise.
DEFAULT_CONSUMER_GROUP = "reassemblers"
CrashPoint = Literal["after_tq_put", "before_commit", "after_commit"]
CRASH_POINTS: tuple[str, ...] = CrashPoint.__args__
StopPoint = Literal["before_put"]
Assignment = Literal["cooperative-sticky", "range", "roundrobin"]


def default_actor_config() -> RolloutReassemblerActorConfig:
    return RolloutReassemblerActorConfig(
        partition_id=TRAIN,
        staging_partition=STAGING,
        pad_token_id=0,
        router_replay_enabled=False,
        defer_routed_experts_to_policy=False,
        max_seq_len=16384,
    )


class ReassemblerConfig(Settings, frozen=True):
    """Topics, consumer group, finalization settings and limits of one reassembler worker."""

    section = "reassembler"

    prefix: Annotated[str, Meta(description="topic name prefix, so several runs can share a cluster")] = ""
    worker_id: Annotated[
        str,
        Meta(
            description="stable worker id; a restarted worker with the same id fences "
            "its predecessor's transactions at once (default: random)"
        ),
    ] = ""
    consumer_group: Annotated[str, Meta(min_length=1, description="Kafka consumer group of the reassemblers")] = (
        DEFAULT_CONSUMER_GROUP
    )
    input_topic: Annotated[
        str | None,
        Meta(description="read receipts from this topic instead of the prefix's receipts topic (e.g. a replay topic)"),
    ] = None
    group_timeout_s: Annotated[
        float,
        Meta(
            gt=0, le=86_400, description="seconds from a prompt group's first receipt until it is finalized incomplete"
        ),
    ] = 30.0
    # Size it above the rate of new groups times group_timeout_s, or groups whose receipts wait
    # behind the pause time out.
    max_open_groups: Annotated[
        int, Meta(ge=1, le=10_000_000, description="open prompt groups at which the worker pauses its partitions")
    ] = 10_000
    # Sizes a receipt declares are checked against these before anything is allocated from them:
    # a hostile or buggy receipt is dead-lettered instead of exhausting memory at its deadline.
    max_group_size: Annotated[
        int, Meta(ge=1, le=1_000_000, description="largest prompt group (rollouts) a receipt may declare")
    ] = 1024
    max_calls_per_rollout: Annotated[
        int, Meta(ge=1, le=1_000_000, description="most model calls one receipt may list")
    ] = 1024
    max_tokens_per_call: Annotated[
        int, Meta(ge=1, le=1 << 31, description="most tokens one call's delta may declare")
    ] = 1 << 20
    # A receipt of a forgotten group is late only if its event time lies below the horizon: set the
    # retention above the longest delay between a group's first receipt and a retried or straggling one.
    closed_retention_s: Annotated[
        float,
        Meta(
            gt=0,
            le=30 * 86_400,
            description="seconds of event time a closed prompt group is remembered, so its late receipts are "
            "refused; older ones are refused by the horizon",
        ),
    ] = 3600.0
    max_closed_groups: Annotated[
        int,
        Meta(
            ge=1,
            le=10_000_000,
            description="closed prompt groups remembered per partition at most; past it the oldest are forgotten "
            "early and the horizon moves up",
        ),
    ] = 200_000
    max_poll_records: Annotated[int, Meta(ge=1, le=100_000, description="receipts read per step at most")] = 1000
    poll_timeout_s: Annotated[float, Meta(ge=0, le=10, description="longest wait for receipts in one step")] = 0.05
    session_timeout_ms: Annotated[
        int,
        Meta(
            ge=1000, le=300_000, description="consumer-group session timeout: how soon a dead worker's partitions move"
        ),
    ] = 6000
    transaction_timeout_ms: Annotated[
        int, Meta(ge=1000, le=900_000, description="Kafka transaction timeout of one step")
    ] = 10_000
    # Cooperative rebalancing moves only the partitions that change owner: a worker joining or dying
    # does not stop the others' partitions to restore them all again (bench/bench_failover.py).
    partition_assignment: Annotated[
        Assignment,
        Meta(description="how the consumer group spreads partitions: cooperative-sticky moves only what must move"),
    ] = "cooperative-sticky"
    static_membership: Annotated[
        bool,
        Meta(
            description="join under the worker id (group.instance.id): a worker restarted within the session "
            "timeout gets its partitions back without a rebalance"
        ),
    ] = False
    clear_staging: Annotated[
        bool,
        Meta(
            description="clear a group's staged tensors once it is committed (off "
            "for replay runs: the tensors belong to production)"
        ),
    ] = True
    crash_point: Annotated[
        CrashPoint | None, Meta(description="crash drills only: SIGKILL this process at that point of a step")
    ] = None
    stop_point: Annotated[
        StopPoint | None, Meta(description="drills only: SIGSTOP this process once, at that point of a step (a zombie)")
    ] = None
    actor: RolloutReassemblerActorConfig = msgspec.field(default_factory=default_actor_config)

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.prefix)

    @property
    def receipts_topic(self) -> str:
        return self.input_topic or self.topics.receipts

    @property
    def transactional_id(self) -> str:
        return f"{self.consumer_group}.{self.worker_id}"
