"""Test helpers: a rollout's receipt and staged segments from a plain description of its calls."""

from __future__ import annotations

import hashlib

import torch

from schemas.receipt import CallRecord, Receipt


def reference_digest(token_ids: list[int]) -> str:
    """The digest spelled out independently of schemas.digest: blake2b-8 over int64 LE bytes."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def make_rollout(
    calls: list[tuple[int, int]],
    *,
    rollout_id: str = "r0",
    group_id: str = "g",
    rollout_index: int = 0,
    group_size: int = 1,
    prompt_idx: int = 0,
    reward: float = 1.0,
    weight_versions: list[int] | None = None,
    experts_k: int | None = None,
    flags: dict[int, dict[str, bool]] | None = None,
    seed: int = 0,
) -> tuple[Receipt, dict[str, dict[str, torch.Tensor]]]:
    """`calls[i] = (non_generated_len, generated_len)`: call 0's first part is the prompt, later
    calls' first part is the environment observation. Returns the receipt and its segments."""
    gen = torch.Generator().manual_seed(seed)
    records, segments, prev = [], {}, 0
    for i, (observed, generated) in enumerate(calls):
        delta = observed + generated
        token_ids = torch.randint(0, 50_000, (delta,), generator=gen, dtype=torch.int64)
        segment = {
            "token_ids": token_ids,
            "token_mask": torch.cat([torch.zeros(observed, dtype=torch.bool), torch.ones(generated, dtype=torch.bool)]),
            "generation_logprobs": -torch.rand(delta, generator=gen),
        }
        if experts_k is not None:
            segment["routed_experts"] = torch.randint(0, 64, (delta, experts_k), generator=gen)
        key = f"{rollout_id}/c{i}"
        segments[key] = segment
        records.append(
            CallRecord(
                staging_key=key,
                call_id=f"c{i}",
                parent_call_id=None if i == 0 else f"c{i - 1}",
                prev_len=prev,
                delta_len=delta,
                cum_len=prev + delta,
                weight_version=weight_versions[i] if weight_versions else 5,
                digest=reference_digest(token_ids.tolist()),
                **(flags or {}).get(i, {}),
            )
        )
        prev += delta
    receipt = Receipt(
        rollout_id=rollout_id,
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=rollout_index,
        group_size=group_size,
        reward=reward,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="math",
        failure_reason=None,
        manifest=tuple(records),
    )
    return receipt, segments
