"""The example's trainer: select finalized groups by weight version, take a GRPO step, publish new weights.

Each step selects `batch_groups` groups usable at the current version (the consumer's policy
evicts groups past the staleness bound), materializes their padded rows from TQ, computes
group-normalized advantages from `total_reward` and the clipped loss on the answer tokens
(`token_mask`) against the rollouts' `generation_logprobs`, steps the optimizer, acks the groups,
then moves to the next version: weights to the board first, then the version on Kafka, so a rollout
worker the admission gate lets through finds the weights it is admitted for. It keeps a journal of
the groups it trained (and saw evicted), by prompt, which its checkpoints keep with the weights
(`checkpoints.py`): after a whole-job restart the journal says which prompts are settled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from streams.config import KafkaConfig
from streams.tq import KVStore
from workers.examples.grpo.loss import clipped_loss, group_advantages
from workers.examples.grpo.policy import TinyPolicy, state_to_cpu
from workers.topics import TopicNames
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import WITHDRAWN, ExperienceConsumer
from workers.trainer.policies import weight_fifo
from workers.trainer.version_topic import VersionPublisher

FIELDS = ("input_ids", "token_mask", "generation_logprobs", "total_reward", "sample_mask")


@dataclass(frozen=True)
class StepStats:
    """One trainer step: the version it trained at, its batch's reward and staleness, and the loss."""

    step: int
    version: int
    groups: int
    mean_reward: float
    mean_staleness: float
    max_staleness: int
    loss: float
    clipped_fraction: float
    seconds: float  # since the trainer started
    groups_per_s: float  # groups trained over the step's wall time, waiting included


class GrpoTrainer:
    """Owns the policy, its optimizer and the experience consumer; `step` trains one batch."""

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        prefix: str,
        policy: TinyPolicy,
        board,
        *,
        batch_groups: int,
        max_staleness: int,
        lr: float,
        clip: float = 0.2,
        trainer_id: str = "grpo-trainer",
        checkpointed: bool = False,
    ):
        self.policy, self.board = policy, board
        self.batch_groups, self.clip = batch_groups, clip
        self.version = 0
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
        # (group id, prompt index) of every group trained, and of every group evicted, in order.
        self.trained: list[tuple[str, int]] = []
        self.evicted_groups: list[tuple[str, int]] = []
        self.consumer = ExperienceConsumer(
            kafka,
            store,
            ConsumerConfig(prefix=prefix, consumer_group=trainer_id, checkpointed=checkpointed),
            weight_fifo(max_staleness),
            version=0,
            on_evict=lambda g, v: self.evicted_groups.append((g.group_id, g.prompt_idx)),
        )
        self.versions = VersionPublisher(
            kafka,
            TopicNames(prefix).trainer_version,
            trainer_id=trainer_id,
            consumer_group=trainer_id,
            batch_groups=batch_groups,
        )
        self.steps: list[StepStats] = []
        self._t0 = self._last = time.monotonic()

    def start(self) -> None:
        """Publish the current weights and version: rollout workers wait for the first ones."""
        self._publish()

    def settled(self) -> set[int]:
        """Prompts whose group was trained or evicted (a group handed back is not: it comes again)."""
        return {idx for _, idx in self.trained} | {idx for _, idx in self.evicted_groups}

    def _publish(self) -> None:
        import ray

        ray.get(self.board.publish.remote(self.version, state_to_cpu(self.policy)))
        self._publish_version()

    def _publish_version(self) -> None:
        # With the groups lost so far: the rollout workers' gates give their capacity back.
        self.versions.publish(self.version, lost_groups=self.consumer.counts.lost)

    def step(self, timeout_s: float, min_groups: int | None = None) -> StepStats | None:
        """Train one batch (at least `min_groups`, default a full one) at the current version and publish
        the next; None if no batch came in time."""
        least = self.batch_groups if min_groups is None else max(1, min(min_groups, self.batch_groups))
        meta = self.consumer.select(self.version, least, self.batch_groups, timeout_s=timeout_s)
        if meta is None:
            # No full batch: perhaps because groups were lost, which the gates must hear of to admit more.
            self._publish_version()
            return None
        try:
            td = self.consumer.materialize(meta, fields=FIELDS)
        except WITHDRAWN:  # the consumer took the batch back (rows gone, or not settled in TQ now)
            return None
        rewards = td["total_reward"].float()
        advantages = group_advantages(rewards, [len(g.sample_ids) for g in meta.groups])
        mask = td["token_mask"].bool() & (td["sample_mask"] > 0).unsqueeze(1)
        new_logprobs = self.policy.token_logprobs(td["input_ids"].long())
        loss, stats = clipped_loss(new_logprobs, td["generation_logprobs"].float(), advantages, mask, self.clip)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.consumer.ack(meta)
        self.trained.extend((g.group_id, g.prompt_idx) for g in meta.groups)
        now = time.monotonic()
        staleness = meta.staleness
        result = StepStats(
            step=self.steps[-1].step + 1 if self.steps else 0,
            version=self.version,
            groups=len(meta),
            mean_reward=float(rewards[td["sample_mask"] > 0].mean()),
            mean_staleness=sum(staleness) / len(staleness),
            max_staleness=max(staleness),
            loss=stats.loss,
            clipped_fraction=stats.clipped_fraction,
            seconds=now - self._t0,
            groups_per_s=len(meta) / max(now - self._last, 1e-6),
        )
        self._last = now
        self.steps.append(result)
        self.version += 1
        self._publish()
        return result

    @property
    def evicted(self) -> int:
        return self.consumer.counts.evicted_stale

    def close(self) -> None:
        self.consumer.close()
        self.versions.close()
