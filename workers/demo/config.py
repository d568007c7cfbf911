"""Every setting of `rlstream demo`, defined once with its default, bounds and doc line."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from streams.settings import Settings
from workers.rollout.synthetic import SyntheticShape

PolicyName = Literal["windowed", "weight_fifo", "in_order", "ready_first"]


def demo_shape() -> SyntheticShape:
    """Multi-turn groups of 8 with varied lengths, some violation flags and a few failed rollouts."""
    return SyntheticShape(
        group_size=8,
        calls=(1, 4),
        prompt_len=(16, 96),
        answer_len=(16, 192),
        observation_len=(4, 48),
        failure_rate=0.03,
        violation_rate=0.1,
    )


class DemoConfig(Settings, frozen=True):
    """What the demo starts, how much it produces, and how its trainer consumes."""

    section = "demo"

    bootstrap_servers: Annotated[
        str | None, Meta(description="use this Kafka cluster instead of starting a local broker")
    ] = None
    prefix: Annotated[str, Meta(description="topic prefix (default: a fresh demo-<id>)")] = ""
    ray_address: Annotated[
        str | None, Meta(description="attach to this Ray cluster instead of starting one (default: start one)")
    ] = None
    placement_resource: Annotated[
        str | None,
        Meta(
            description="spread TQ storage units and reassembler actors over the Ray nodes offering this "
            "custom resource (default: over all nodes)"
        ),
    ] = None
    # The failure drills need producer 0 to reach its 6th group: its 4th group's rollouts all fail
    # and a poison receipt follows its 6th.
    groups: Annotated[int, Meta(ge=1, le=1_000_000, description="prompt groups to produce")] = 160
    producers: Annotated[int, Meta(ge=1, le=64, description="synthetic rollout producer threads")] = 2
    reassemblers: Annotated[int, Meta(ge=1, le=64, description="reassembler Ray actors (one consumer group)")] = 2
    external_reassemblers: Annotated[
        bool, Meta(description="start no reassemblers: they run elsewhere (e.g. docker compose)")
    ] = False
    partitions: Annotated[int, Meta(ge=1, le=1024, description="partitions of each pipeline topic")] = 4
    batch_groups: Annotated[int, Meta(ge=1, le=10_000, description="prompt groups per trainer batch")] = 8
    policy: Annotated[PolicyName, Meta(description="trainer consumption policy")] = "windowed"
    max_staleness: Annotated[
        int, Meta(ge=0, le=1000, description="staleness bound in versions (in_order: its lookahead)")
    ] = 2
    versions_every: Annotated[int, Meta(ge=1, le=100_000, description="trainer batches per weight-version step")] = 3
    train_step_s: Annotated[float, Meta(ge=0, le=60, description="seconds one simulated training step takes")] = 0.02
    # Paced, so the trainer advances its version while rollouts still arrive, as in asynchronous RL.
    produce_rate_groups_s: Annotated[
        float, Meta(gt=0, le=100_000, description="prompt groups per second, all producers together")
    ] = 8.0
    group_timeout_s: Annotated[
        float,
        Meta(gt=0, le=3600, description="seconds from a group's first receipt until it is finalized incomplete"),
    ] = 10.0
    timeout_s: Annotated[float, Meta(gt=0, le=86_400, description="give up after this many seconds")] = 300.0
    # On: producers start a group only when the admission gate (workers/rollout/gate.py), fed by the
    # trainer's version topic, has room, and generate it at the version the gate saw; off: each group
    # is generated at the trainer's version less a drawn lag, with no admission control.
    admission: Annotated[
        bool, Meta(description="gate producers on the trainer's published version (AReaL-style staleness capacity)")
    ] = True
    inflight_groups: Annotated[
        int,
        Meta(ge=1, le=10_000, description="with admission: groups each producer runs ahead (started, not published)"),
    ] = 32
    metrics_port: Annotated[
        Annotated[int, Meta(ge=0, le=65535)] | None,
        Meta(
            description="serve Prometheus /metrics: the trainer on this port, reassembler actor i on PORT+1+i, "
            "and TQ's own exporter (0: free ports; every endpoint is logged)"
        ),
    ] = None
    # On: each rollout is captured with NeMo Gym's own code (RolloutTokenCapture into rlstream's
    # TQStagingSink, NeMo Gym's ledger and receipt) and published as a NeMo Gym receipt; needs
    # nemo-gym 0.7.0 (docs/NEMO.md).
    nemo_gym: Annotated[
        bool,
        Meta(
            description="produce NeMo Gym receipts: capture rollouts with NeMo Gym's RolloutTokenCapture into "
            "rlstream's staging sink (needs nemo-gym 0.7.0)"
        ),
    ] = False
    shape: SyntheticShape = msgspec.field(default_factory=demo_shape)

    @property
    def policy_params(self) -> dict[str, int]:
        """The policy's parameters: `max_staleness` is the windowed bound and the in_order lookahead."""
        if self.policy in ("windowed", "weight_fifo"):
            return {"max_staleness_versions": self.max_staleness}
        if self.policy == "in_order":
            return {"max_lookahead_versions": self.max_staleness}
        return {}
