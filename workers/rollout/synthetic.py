"""Synthetic multi-turn rollouts for the demo, the benchmarks and the integration tests.

`SyntheticShape` sizes them; `make_group` builds a prompt group's rollouts (`make_rollout` one) as
`StagedRollout`s ready for `RolloutPublisher.publish`. Each rollout is a chain of model calls:
call 0 stages prompt + first answer, later calls stage a tool/environment observation + the next
answer, exactly as a rollout worker would; the turns go through `workers.rollout.convert` like
an engine's output. Everything is drawn from seeded generators, so the
same arguments give the same tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from schemas.turns import Turn
from workers.rollout.convert import failed_rollout, staged_rollout
from workers.rollout.publisher import StagedRollout


@dataclass(frozen=True)
class SyntheticShape:
    """Sizes of generated rollouts; lengths are drawn uniformly from the inclusive ranges."""

    group_size: int = 8
    calls: tuple[int, int] = (1, 4)
    prompt_len: tuple[int, int] = (16, 64)
    answer_len: tuple[int, int] = (16, 128)
    observation_len: tuple[int, int] = (4, 32)
    vocab: int = 32_000
    failure_rate: float = 0.0
    violation_rate: float = 0.0
    routed_experts_k: int = 0  # routed experts per token (layers x top-k, flattened); 0: none
    routed_experts_dtype: str = "int32"  # a torch dtype's name (uint8 for a model with up to 256 experts)


def _turn(
    rng: random.Random,
    gen: torch.Generator,
    prefix_len: int,
    answer_len: int,
    weight_version: int,
    shape: SyntheticShape,
    prompt: torch.Tensor | None,
) -> Turn:
    """One model call: `prefix_len` input ids (the prompt, or an observation) and `answer_len` output ids."""
    ids = torch.randint(1, shape.vocab, (prefix_len + answer_len,), generator=gen, dtype=torch.int64)
    logprobs = (-torch.rand(answer_len, generator=gen) * 4).to(torch.float32)
    routed = None
    if shape.routed_experts_k:
        routed = torch.randint(
            0,
            64,
            (prefix_len + answer_len, shape.routed_experts_k),
            generator=gen,
            dtype=getattr(torch, shape.routed_experts_dtype),
        )
    if prompt is not None:
        ids[:prefix_len] = prompt
    return Turn(
        input_ids=ids[:prefix_len],
        output_ids=ids[prefix_len:],
        output_logprobs=logprobs,
        weight_version=weight_version,
        invalid_tool_call=rng.random() < shape.violation_rate,
        malformed_thinking=rng.random() < shape.violation_rate,
        routed_experts=routed,
    )


def _turns(
    rng: random.Random, gen: torch.Generator, weight_version: int, shape: SyntheticShape, prompt: torch.Tensor | None
) -> list[Turn]:
    """A chain of turns: turn 0 is prompt + answer, each later one an observation + the next answer."""
    turns = []
    for c in range(rng.randint(*shape.calls)):
        if c == 0:
            prefix = len(prompt) if prompt is not None else rng.randint(*shape.prompt_len)
        else:
            prefix = rng.randint(*shape.observation_len)
        answer = rng.randint(*shape.answer_len)
        turns.append(_turn(rng, gen, prefix, answer, weight_version, shape, prompt if c == 0 else None))
    return turns


def rollout_turns(
    group_id: str,
    rollout_index: int,
    weight_version: int,
    *,
    shape: SyntheticShape = SyntheticShape(),
    seed: int = 0,
    prompt: torch.Tensor | None = None,
) -> tuple[list[Turn] | None, float]:
    """One rollout's engine turns and reward; (None, 0.0) for a rollout that failed before its first turn."""
    rng = random.Random(f"{group_id}/{rollout_index}/{seed}")
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    if rng.random() < shape.failure_rate:
        # A failed rollout has no calls and no reward: the environment crashed before scoring it.
        return None, 0.0
    turns = _turns(rng, gen, weight_version, shape, prompt)
    return turns, round(rng.uniform(-1, 1), 4)


def make_rollout(
    group_id: str,
    prompt_idx: int,
    rollout_index: int,
    weight_version: int,
    *,
    shape: SyntheticShape = SyntheticShape(),
    seed: int = 0,
    prompt: torch.Tensor | None = None,
) -> StagedRollout:
    """One rollout of a group with its receipt, manifest, digests and staged call segments."""
    rollout_id = f"{group_id}-r{rollout_index}"
    ids = dict(rollout_id=rollout_id, group_id=group_id, prompt_idx=prompt_idx, rollout_index=rollout_index)
    turns, reward = rollout_turns(group_id, rollout_index, weight_version, shape=shape, seed=seed, prompt=prompt)
    if turns is None:
        return failed_rollout(**ids, group_size=shape.group_size, environment="synthetic", failure_reason="env_crashed")
    return staged_rollout(turns, **ids, group_size=shape.group_size, reward=reward, environment="synthetic")


def group_prompt(group_id: str, *, shape: SyntheticShape = SyntheticShape(), seed: int = 0) -> torch.Tensor:
    """The prompt every rollout of a group starts from."""
    rng = random.Random(f"{group_id}/prompt/{seed}")
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    return torch.randint(1, shape.vocab, (rng.randint(*shape.prompt_len),), generator=gen, dtype=torch.int64)


def make_group(
    group_id: str, prompt_idx: int, weight_version: int, *, shape: SyntheticShape = SyntheticShape(), seed: int = 0
) -> list[StagedRollout]:
    """All rollouts of one prompt group, sharing one prompt."""
    prompt = group_prompt(group_id, shape=shape, seed=seed)
    return [
        make_rollout(group_id, prompt_idx, i, weight_version, shape=shape, seed=seed, prompt=prompt)
        for i in range(shape.group_size)
    ]
