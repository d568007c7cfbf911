"""Every setting of a reassembler worker, defined once with its default, bounds and doc line."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.request import RolloutReassemblerActorConfig
from streams.errors import ConfigError
from streams.settings import Settings
from streams.tq import STAGING, TRAIN
from workers.topics import TopicNames

# The consumer group production reassemblers join unless told otherwise.
DEFAULT_CONSUMER_GROUP = "reassemblers"
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
    # The longest a step may take between two polls before the consumer leaves its group; puts stop
    # at 3/4 of it (lease.py), and a step that runs out of time is retried with fewer groups.
    max_poll_interval_ms: Annotated[
        int,
        Meta(
            ge=1000,
            le=3_600_000,
            description="longest step between polls before the worker leaves its consumer group "
            "(at least session_timeout_ms); a slower step is retried with fewer groups",
        ),
    ] = 60_000
    transaction_timeout_ms: Annotated[
        int, Meta(ge=1000, le=900_000, description="Kafka transaction timeout of one step")
    ] = 10_000
    # Cooperative rebalancing moves only the partitions that change owner: a worker joining or dying
    # does not stop the others' partitions to restore them all again (bench/failover.py).
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
    # Staged rows no receipt will use (a publish that failed after staging, a refused receipt whose
    # clear a crash lost) are swept once this old, and only while their partition is read to its end
    # and none of its open groups names them (sweeper.py).
    staging_sweep_age_s: Annotated[
        float,
        Meta(
            gt=0,
            le=30 * 86_400,
            description="seconds after staging that a staged row no open prompt group uses is swept "
            "(above group_timeout_s; 0 < age)",
        ),
    ] = 3600.0
    staging_sweep_interval_s: Annotated[
        float, Meta(gt=0, le=86_400, description="seconds between two sweeps of the staging partition")
    ] = 60.0
    # NeMo RL publishes every group, N placeholder rows (sample_mask 0) when none of its rollouts is
    # valid; rlstream dead-letters such a group by default, so it is visible, redrivable and counted
    # as a loss by the admission gate, instead of taking a training batch's slot for nothing.
    placeholder_groups: Annotated[
        bool,
        Meta(
            description="publish a prompt group with no valid rollout as group_size masked placeholder rows "
            "(NeMo RL's behaviour) instead of dead-lettering it"
        ),
    ] = False
    actor: RolloutReassemblerActorConfig = msgspec.field(default_factory=default_actor_config)

    def __post_init__(self) -> None:
        if self.max_poll_interval_ms < self.session_timeout_ms:
            raise ConfigError(
                f"[reassembler] max_poll_interval_ms ({self.max_poll_interval_ms}) must be at least "
                f"session_timeout_ms ({self.session_timeout_ms})"
            )
        # A group open longer than closed groups are remembered could outlive the memory of a group
        # that closed while it was open, and a restart re-reading from its first receipt would then
        # find that group forgotten and unprotected by the horizon.
        if self.group_timeout_s >= self.closed_retention_s:
            raise ConfigError(
                f"[reassembler] group_timeout_s ({self.group_timeout_s:g}) must be below closed_retention_s "
                f"({self.closed_retention_s:g})"
            )
        if self.staging_sweep_age_s <= self.group_timeout_s:
            raise ConfigError(
                f"[reassembler] staging_sweep_age_s ({self.staging_sweep_age_s:g}) must be above group_timeout_s "
                f"({self.group_timeout_s:g}): a group's own rows must never be swept while it may still be open"
            )

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.prefix)

    @property
    def receipts_topic(self) -> str:
        return self.input_topic or self.topics.receipts

    @property
    def transactional_id(self) -> str:
        return f"{self.consumer_group}.{self.worker_id}"
