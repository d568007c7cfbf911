"""The rollout side of the example: a board holding the latest weights, and rollout workers as Ray actors.

`WeightBoard` keeps the trainer's newest (version, state_dict); Ray moves the weights between actors,
never Kafka. A `RolloutWorker` loops: wait for room in the admission gate (the trainer's version
topic bounds how far ahead of it rollouts may run), take newer weights from the board if there are
any, pick a prompt, sample its group, score it, and publish it through `RolloutPublisher`: tensors
staged in TQ, a metadata-only receipt per rollout on Kafka, each carrying the weight version it was
sampled at. Prompts are numbered (`CopyTask.prompt_at`): a worker takes every `workers`-th one,
skipping those already published before a restart, and first any group handed back on
`rollout.regenerate` (its rows were lost with the job), which it generates again under the derived
group id the hand-back names (those generated before a restart were settled by `resume`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from workers.actors.kafka_secrets import NodeKafka
from workers.examples.grpo.policy import PolicyShape, TinyPolicy
from workers.examples.grpo.task import CopyTask
from workers.rollout.convert import Turn, failed_rollout, staged_rollout
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher, StagedRollout
from workers.rollout.regenerate_feed import HandBack, RegenerateFeed
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

    kafka: NodeKafka  # no secret: Ray records an actor's arguments; each actor reads them on its node
    prefix: str
    trainer_id: str
    task: CopyTask
    policy: PolicyShape
    group_size: int
    max_staleness: int
    workers: int
    seed: int = 0
    # Prompts 0 .. prompts - 1 (None: no end); those already published (before a restart) are skipped.
    prompts: int | None = None
    published: frozenset[int] = frozenset()
    # Every n-th prompt's first rollout reports a failure, as an environment that crashed would (0: none).
    failed_rollout_every: int = 0


def group_id_of(prefix: str, prompt_idx: int) -> str:
    """The group id of prompt `prompt_idx`'s first generation (a regeneration takes the id its hand-back names)."""
    return f"{prefix}-p{prompt_idx:06d}"


def prompt_of(prefix: str, group_id: str) -> int | None:
    """The prompt of a group of this run, its first generation or a regeneration (`...~r1`); None if not one."""
    head = f"{prefix}-p"
    if not group_id.startswith(head):
        return None
    digits = group_id[len(head) :].split("~", 1)[0]
    return int(digits) if digits.isdigit() else None


def make_group(
    policy: TinyPolicy,
    task: CopyTask,
    group_id: str,
    prompt_idx: int,
    version: int,
    size: int,
    gen: torch.Generator,
    prompt: torch.Tensor,
    failed_rollout_every: int = 0,
) -> tuple[list[StagedRollout], float]:
    """A prompt group of `size` sampled answers to `prompt`, as StagedRollouts; and its mean reward.

    With `failed_rollout_every` n, every n-th prompt's rollout 0 failed instead (no calls, nothing staged).
    """
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
    if failed_rollout_every and prompt_idx % failed_rollout_every == 0:
        rollouts[0] = failed_rollout(
            rollout_id=f"{group_id}-r0", group_id=group_id, prompt_idx=prompt_idx, rollout_index=0,
            group_size=size, environment=ENVIRONMENT, failure_reason="env_crashed",
        )  # fmt: skip
    return rollouts, float(rewards.mean())


class RolloutWorker:
    """One rollout worker (run as a Ray actor): generates and publishes groups until the board says stop."""

    def __init__(self, spec: RolloutSpec, index: int, board) -> None:
        torch.set_num_threads(1)  # many small ops: more threads only contend for the shared cores
        self._spec, self._index, self._board = spec, index, board
        self._policy = TinyPolicy(spec.policy)
        self._version = -1
        self._gen = torch.Generator().manual_seed(spec.seed * 1000 + index)
        self._next_prompt = index
        self._stop = threading.Event()
        self._connected = False

    def connect(self) -> list[str]:
        """Read the Kafka secrets on this node and build the worker's clients (once); the names of the
        client settings it has, never values. ConfigError naming a secret the node lacks, before
        anything connects: the run calls it on every actor first (`kafka_secrets.check_on_nodes`)."""
        from streams.tq import TQConfig, TQStore, init_tq

        spec = self._spec
        kafka = spec.kafka.resolve()
        if not self._connected:
            init_tq(TQConfig(address="auto"))
            names = TopicNames(spec.prefix)
            self._publisher = RolloutPublisher(kafka, TQStore(), names.receipts)
            self._gate = AdmissionGate(
                kafka,
                names,
                max_staleness=spec.max_staleness,
                trainer_id=spec.trainer_id,
                batch_share=1.0 / spec.workers,
            )
            # Hand-backs generated before a restart were settled on this consumer group by `resume`.
            self._feed = RegenerateFeed(kafka, names, f"rollouts.{spec.prefix}")
            self._connected = True
        return sorted(kafka.client_settings)

    def _refresh(self) -> bool:
        """Take newer weights from the board; False once the board says stop."""
        import ray

        version, state, stopped = ray.get(self._board.newer_than.remote(self._version))
        if state is not None:
            self._policy.load_state_dict(state)
            self._version = version
        return not stopped

    def _next(self) -> tuple[str, int, HandBack | None] | None:
        """(group id, prompt index, its hand-back if it is one) of the next group to generate; None for now."""
        for back in self._feed.take(1, 0.0):
            return back.regenerate.new_group_id, back.regenerate.prompt_idx, back
        spec = self._spec
        while self._next_prompt in spec.published:
            self._next_prompt += spec.workers
        if spec.prompts is not None and self._next_prompt >= spec.prompts:
            return None
        idx = self._next_prompt
        self._next_prompt += spec.workers
        return group_id_of(spec.prefix, idx), idx, None

    def run(self, max_groups: int) -> dict[str, float]:
        """Publish up to `max_groups` groups (regenerations included); returns this worker's totals."""
        groups, regenerated, rewards, t0 = 0, 0, 0.0, time.monotonic()
        spec = self._spec
        self.connect()
        try:
            while groups < max_groups and self._refresh():
                if self._version < 0:  # the trainer has not published its first weights yet
                    time.sleep(0.1)
                    continue
                if not self._gate.acquire(1, timeout=0.5):
                    continue
                job = self._next()
                if job is None:  # every prompt published: only hand-backs are left to serve
                    self._gate.on_finished(accepted=False)
                    time.sleep(0.2)
                    continue
                group_id, idx, back = job
                prompt = spec.task.prompt_at(idx, spec.seed)
                rollouts, reward = make_group(
                    self._policy, spec.task, group_id, idx, self._version, spec.group_size, self._gen, prompt,
                    spec.failed_rollout_every,
                )  # fmt: skip
                self._publisher.publish(rollouts)
                self._gate.on_finished(accepted=True)
                if back is not None:
                    self._feed.done(back)
                    regenerated += 1
                groups += 1
                rewards += reward
        finally:
            self._gate.close()
            self._feed.close()
            self._publisher.close()
        return {
            "groups": groups,
            "regenerated": regenerated,
            "mean_reward": rewards / max(groups, 1),
            "seconds": time.monotonic() - t0,
        }
