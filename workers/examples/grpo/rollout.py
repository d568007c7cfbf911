"""The rollout side of the example: a board holding the latest weights, and rollout workers as Ray actors.

`WeightBoard` keeps the trainer's newest (version, state_dict); Ray moves the weights between actors,
never Kafka. A `RolloutWorker` loops: wait for room in the admission gate (the trainer's version
topic bounds how far ahead of it rollouts may run), take newer weights from the board if there are
any, sample a prompt group, score it, and publish it through `RolloutPublisher`: tensors staged in
TQ, a metadata-only receipt per rollout on Kafka, each carrying the weight version it was sampled at.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from streams.config import KafkaConfig
from workers.examples.grpo.policy import PolicyShape, TinyPolicy
from workers.examples.grpo.task import CopyTask
from workers.rollout.convert import Turn, staged_rollout
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher, StagedRollout
from workers.topics import TopicNames

ENVIRONMENT = "grpo-copy"


class WeightBoard:
    """The newest weights and a stop flag, shared by the trainer and every rollout worker (a Ray actor)."""

    def __init__(self) -> None:
        self._version = -1
        self._state: dict[str, torch.Tensor] | None = None
        self._stopped = False

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        if version > self._version:
            self._version, self._state = version, state

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor] | None, bool]:
        """(latest version, its weights if newer than `version` else None, stopped)."""
        newer = self._state if self._version > version else None
        return self._version, newer, self._stopped

    def stop(self) -> None:
        self._stopped = True


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout worker needs: where to publish, the task, the policy's shape and the gate's bounds."""

    kafka: KafkaConfig
    prefix: str
    trainer_id: str
    task: CopyTask
    policy: PolicyShape
    group_size: int
    max_staleness: int
    workers: int
    seed: int = 0


def make_group(
    policy: TinyPolicy, task: CopyTask, group_id: str, prompt_idx: int, version: int, size: int, gen: torch.Generator
) -> tuple[list[StagedRollout], float]:
    """A prompt group of `size` sampled answers to one prompt, as StagedRollouts; and its mean reward."""
    prompt = task.prompt(gen)
    prompts = prompt.unsqueeze(0).expand(size, -1)
    answers, logprobs = policy.sample(prompts, task.answer_len, gen)
    rewards = task.reward(prompts, answers)
    rollouts = [
        staged_rollout(
            [Turn(input_ids=prompt, output_ids=answers[i], output_logprobs=logprobs[i], weight_version=version)],
            rollout_id=f"{group_id}-r{i}",
            group_id=group_id,
            prompt_idx=prompt_idx,
            rollout_index=i,
            group_size=size,
            reward=float(rewards[i]),
            environment=ENVIRONMENT,
        )
        for i in range(size)
    ]
    return rollouts, float(rewards.mean())


class RolloutWorker:
    """One rollout worker (run as a Ray actor): generates and publishes groups until the board says stop."""

    def __init__(self, spec: RolloutSpec, index: int, board) -> None:
        from streams.tq import TQConfig, TQStore, init_tq

        torch.set_num_threads(1)  # many small ops: more threads only contend for the shared cores
        init_tq(TQConfig(address="auto"))
        names = TopicNames(spec.prefix)
        self._spec, self._index, self._board = spec, index, board
        self._policy = TinyPolicy(spec.policy)
        self._version = -1
        self._gen = torch.Generator().manual_seed(spec.seed * 1000 + index)
        self._publisher = RolloutPublisher(spec.kafka, TQStore(), names.receipts)
        self._gate = AdmissionGate(
            spec.kafka,
            names,
            max_staleness=spec.max_staleness,
            trainer_id=spec.trainer_id,
            batch_share=1.0 / spec.workers,
        )
        self._stop = threading.Event()

    def _refresh(self) -> bool:
        """Take newer weights from the board; False once the board says stop."""
        import ray

        version, state, stopped = ray.get(self._board.newer_than.remote(self._version))
        if state is not None:
            self._policy.load_state_dict(state)
            self._version = version
        return not stopped

    def run(self, max_groups: int) -> dict[str, float]:
        """Publish up to `max_groups` groups; returns this worker's totals."""
        groups, rewards, t0 = 0, 0.0, time.monotonic()
        try:
            while groups < max_groups and self._refresh():
                if self._version < 0:  # the trainer has not published its first weights yet
                    time.sleep(0.1)
                    continue
                if not self._gate.acquire(1, timeout=0.5):
                    continue
                group_id = f"{self._spec.prefix}-w{self._index}-g{groups:05d}"
                rollouts, reward = make_group(
                    self._policy, self._spec.task, group_id, groups, self._version, self._spec.group_size, self._gen
                )
                self._publisher.publish(rollouts)
                self._gate.on_finished(accepted=True)
                groups += 1
                rewards += reward
        finally:
            self._gate.close()
            self._publisher.close()
        return {"groups": groups, "mean_reward": rewards / max(groups, 1), "seconds": time.monotonic() - t0}
