"""What the explorer's rollout workers publish: prompt groups of a few kinds, and the rows each should train as.

A run has `prompts` prompts; prompt i's kind decides what its groups' rollouts are (the same for
its regenerations, which are generated again under the derived id a hand-back names):

- `ok`: every rollout has calls and a reward;
- `some_failed`: rollout 0 failed (no calls; the environment crashed), the others ok;
- `all_failed`: every rollout failed: the group is dead-lettered `all_rollouts_failed`, earned;
- `one_garbage`: rollout 0's receipt is garbage bytes (a `decode_error` letter); the group closes at
  its timeout without it and is trained from the others;
- `poison`: every receipt is garbage: no group ever opens; each receipt is dead-lettered.

Tokens come from seeded generators (`workers.rollout.synthetic`), so a group's rows are the same in
every replay, and `expected_rows` gives the digest of each valid rollout's tokens as the trainer
must read them back (the chaos drill's `rows_digest`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from schemas.regenerate import regeneration_of
from workers.rollout.convert import failed_rollout
from workers.rollout.publisher import StagedRollout
from workers.rollout.synthetic import SyntheticShape, make_group

KINDS = ("ok", "some_failed", "all_failed", "one_garbage", "poison")
GARBAGE = b"\x00not a receipt"


@dataclass(frozen=True)
class Workload:
    """How big a run is and what its prompts are."""

    prompts: int = 8
    group_size: int = 2
    partitions: int = 2
    reassemblers: int = 2
    kinds: tuple[str, ...] = ()  # per prompt; () = all "ok"
    static_membership: bool = False
    batch_groups: int = 2  # groups the trainer trains per version step
    checkpoint_every: int = 2  # trainer steps between checkpoints
    max_staleness: int = 2  # the admission gate's eta
    generate_s: float = 1.0  # virtual seconds a rollout worker takes to generate a group
    policy: str = "ready_first"  # the trainer's: "ready_first", or "weight_fifo" (evicts past 2 versions)
    checkpointed: bool = True  # the trainer checkpoints (acks settle with durable checkpoints), else acks commit
    train_s: float = 0.5  # virtual seconds a trainer step takes
    # The finalized topic's partitions when not the receipts' (None: as many, as `rlstream topics create`
    # makes them). Fewer, a finalized partition takes records of groups other workers own.
    finalized_partitions: int | None = None
    # The reassemblers' transaction.timeout.ms, in seconds. Past resume's wait for the killed job's members
    # to leave (the rollout feed's 45 s session), a transaction the job left open is still open when resume
    # reads: only its abort (or wait) stands between it and the last stable offset (issue 30 item 6).
    transaction_timeout_s: float = 10.0
    # `rlstream resume --force`: an operator who knows the job is dead does not wait for its members to leave,
    # so resume reads at once, while a transaction the job left open may still hold the topics.
    resume_force: bool = False

    def kind(self, prompt: int) -> str:
        return self.kinds[prompt] if prompt < len(self.kinds) else "ok"

    def smaller(self) -> list[Workload]:
        """Workloads one step smaller, for shrinking: fewer prompts, fewer workers, smaller groups."""
        out = []
        if self.prompts > 1:
            half = max(1, self.prompts // 2)
            out.append(_replace(self, prompts=half, kinds=self.kinds[:half]))
            out.append(_replace(self, prompts=self.prompts - 1, kinds=self.kinds[: self.prompts - 1]))
        if self.reassemblers > 1:
            out.append(_replace(self, reassemblers=self.reassemblers - 1))
        if self.group_size > 2:
            out.append(_replace(self, group_size=self.group_size - 1))
        if self.partitions > 1:
            out.append(_replace(self, partitions=self.partitions - 1))
        return out

    def to_json(self) -> dict:
        return {
            "prompts": self.prompts,
            "group_size": self.group_size,
            "partitions": self.partitions,
            "reassemblers": self.reassemblers,
            "kinds": list(self.kinds),
            "static_membership": self.static_membership,
            "batch_groups": self.batch_groups,
            "checkpoint_every": self.checkpoint_every,
            "max_staleness": self.max_staleness,
            "generate_s": self.generate_s,
            "policy": self.policy,
            "checkpointed": self.checkpointed,
            "train_s": self.train_s,
            "finalized_partitions": self.finalized_partitions,
            "transaction_timeout_s": self.transaction_timeout_s,
            "resume_force": self.resume_force,
        }

    @staticmethod
    def from_json(d: dict) -> Workload:
        return Workload(**{**d, "kinds": tuple(d.get("kinds", ()))})


def _replace(w: Workload, **changes) -> Workload:
    return Workload.from_json({**w.to_json(), **{k: list(v) if k == "kinds" else v for k, v in changes.items()}})


def random_workload(rng: random.Random, *, max_prompts: int = 10) -> Workload:
    prompts = rng.randint(3, max_prompts)
    weights = {"ok": 6, "some_failed": 3, "all_failed": 1, "one_garbage": 1, "poison": 1}
    kinds = tuple(rng.choices(list(weights), weights=list(weights.values()), k=prompts))
    return Workload(
        prompts=prompts,
        group_size=rng.choice((2, 2, 3)),
        partitions=rng.choice((1, 2, 2, 3)),
        reassemblers=rng.choice((1, 2, 2, 3)),
        kinds=kinds,
        static_membership=rng.random() < 0.5,
        batch_groups=rng.choice((1, 2, 3)),
        checkpoint_every=rng.choice((1, 2, 3)),
        max_staleness=rng.choice((1, 2, 4)),
        generate_s=rng.choice((0.5, 1.0, 2.0)),
        policy=rng.choice(("ready_first", "ready_first", "weight_fifo")),
        checkpointed=rng.random() < 0.7,
        train_s=rng.choice((0.2, 0.5, 1.0)),
    )


SHAPE = dict(calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2), vocab=1000)


def group_id(prompt: int) -> str:
    return f"p{prompt:03d}"


def prompt_of(gid: str) -> int:
    base, _ = regeneration_of(gid)
    return int(base[1:])


@dataclass(frozen=True)
class Published:
    """One group as its rollout worker publishes it: the staged rollouts and the garbage receipts."""

    group_id: str
    prompt: int
    kind: str
    rollouts: tuple[StagedRollout, ...]
    garbage: int  # receipts sent as garbage bytes (keyed by the group id)

    @property
    def staging_keys(self) -> list[str]:
        return [c.staging_key for r in self.rollouts for c in r.receipt.manifest]


def build(w: Workload, gid: str, version: int = 0) -> Published:
    """The rollouts of group `gid` (a prompt's group or one of its regenerations) as its kind makes them,
    sampled at weight `version` (the trainer's, as the rollout worker's gate last read it)."""
    prompt = prompt_of(gid)
    kind = w.kind(prompt)
    shape = SyntheticShape(group_size=w.group_size, **SHAPE)
    rollouts = make_group(gid, prompt, version, shape=shape, seed=prompt)
    if kind == "some_failed":
        rollouts[0] = _failed(rollouts[0], w.group_size)
    elif kind == "all_failed":
        rollouts = [_failed(r, w.group_size) for r in rollouts]
    garbage = {"one_garbage": 1, "poison": w.group_size}.get(kind, 0)
    return Published(gid, prompt, kind, tuple(rollouts[garbage:]), garbage)


def _failed(r: StagedRollout, size: int) -> StagedRollout:
    rec = r.receipt
    return failed_rollout(
        rollout_id=rec.rollout_id,
        group_id=rec.group_id,
        prompt_idx=rec.prompt_idx,
        rollout_index=rec.rollout_index,
        group_size=size,
        environment="synthetic",
        failure_reason="env_crashed",
    )


def rows_digest(ids: torch.Tensor) -> str:
    """blake2b of one row's token ids (int64 little-endian, its length first)."""
    flat = ids.to(torch.int64).contiguous().numpy().astype("<i8")
    h = hashlib.blake2b(digest_size=8)
    h.update(len(flat).to_bytes(4, "little"))
    h.update(flat.tobytes())
    return h.hexdigest()


def expected_rows(p: Published) -> dict[int, str]:
    """Per rollout index with calls, the digest of the token ids its training row must hold."""
    out = {}
    for r in p.rollouts:
        if r.receipt.manifest:
            out[r.receipt.rollout_index] = rows_digest(torch.cat([s["token_ids"] for s in r.segments]))
    return out
