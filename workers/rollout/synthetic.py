"""Synthetic multi-turn rollouts for the demo, the benchmarks and the integration tests.

`SyntheticShape` sizes them; `make_group` builds a prompt group's rollouts (`make_rollout` one) as
`StagedRollout`s ready for `RolloutPublisher.publish`. Each rollout is a chain of model calls:
call 0 stages prompt + first answer, later calls stage a tool/environment observation + the next
answer, exactly as a rollout worker would. Everything is drawn from seeded generators, so the
same arguments give the same tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from schemas.digest import token_digest
from schemas.receipt import CallRecord, Receipt
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
    routed_experts_k: int = 0


def _segment(
    rng: random.Random, gen: torch.Generator, prefix_len: int, answer_len: int, vocab: int, experts_k: int
) -> dict[str, torch.Tensor]:
    n = prefix_len + answer_len
    seg = {
        "token_ids": torch.randint(1, vocab, (n,), generator=gen, dtype=torch.int64),
        "token_mask": torch.cat([torch.zeros(prefix_len, dtype=torch.bool), torch.ones(answer_len, dtype=torch.bool)]),
        "generation_logprobs": torch.cat([torch.zeros(prefix_len), -torch.rand(answer_len, generator=gen) * 4]).to(
            torch.float32
        ),
    }
    if experts_k:
        seg["routed_experts"] = torch.randint(0, 64, (n, experts_k), generator=gen, dtype=torch.int32)
    return seg


def _calls(
    rng: random.Random,
    gen: torch.Generator,
    rollout_id: str,
    weight_version: int,
    shape: SyntheticShape,
    prompt: torch.Tensor | None,
) -> tuple[list[dict[str, torch.Tensor]], list[CallRecord]]:
    """A chain of calls: call 0 is prompt + answer, each later one an observation + the next answer."""
    segments, calls, cum = [], [], 0
    parent = None
    for c in range(rng.randint(*shape.calls)):
        if c == 0:
            prefix = len(prompt) if prompt is not None else rng.randint(*shape.prompt_len)
        else:
            prefix = rng.randint(*shape.observation_len)
        seg = _segment(rng, gen, prefix, rng.randint(*shape.answer_len), shape.vocab, shape.routed_experts_k)
        if c == 0 and prompt is not None:
            seg["token_ids"][:prefix] = prompt
        n = int(seg["token_ids"].numel())
        call_id = f"c{c}"
        calls.append(
            CallRecord(
                staging_key=f"{rollout_id}/{call_id}",
                call_id=call_id,
                parent_call_id=parent,
                prev_len=cum,
                delta_len=n,
                cum_len=cum + n,
                weight_version=weight_version,
                digest=token_digest(seg["token_ids"]),
                invalid_tool_call=rng.random() < shape.violation_rate,
                malformed_thinking=rng.random() < shape.violation_rate,
            )
        )
        segments.append(seg)
        parent, cum = call_id, cum + n
    return segments, calls


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
    rng = random.Random(f"{group_id}/{rollout_index}/{seed}")
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    rollout_id = f"{group_id}-r{rollout_index}"
    failed = rng.random() < shape.failure_rate
    segments, calls = ([], []) if failed else _calls(rng, gen, rollout_id, weight_version, shape, prompt)
    receipt = Receipt(
        rollout_id=rollout_id,
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=rollout_index,
        group_size=shape.group_size,
        # A failed rollout has no calls and no reward: the environment crashed before scoring it.
        reward=0.0 if failed else round(rng.uniform(-1, 1), 4),
        mask_sample=True,
        loss_multiplier=1.0,
        environment="synthetic",
        failure_reason="env_crashed" if failed else None,
        manifest=tuple(calls),
    )
    return StagedRollout(receipt, segments)


def make_group(
    group_id: str, prompt_idx: int, weight_version: int, *, shape: SyntheticShape = SyntheticShape(), seed: int = 0
) -> list[StagedRollout]:
    """All rollouts of one prompt group, sharing one prompt."""
    rng = random.Random(f"{group_id}/prompt/{seed}")
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    prompt = torch.randint(1, shape.vocab, (rng.randint(*shape.prompt_len),), generator=gen, dtype=torch.int64)
    return [
        make_rollout(group_id, prompt_idx, i, weight_version, shape=shape, seed=seed, prompt=prompt)
        for i in range(shape.group_size)
    ]
