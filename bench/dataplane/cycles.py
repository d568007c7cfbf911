"""The bounds `python -m bench.dataplane` compares rlstream with: the raw TQ cycle, Ray RPC by value, memcpy.

Every bound moves the bytes a prompt group must go through on its way to the trainer, in one of the
`SHAPES`: `dense` is `bench/pipeline.py`'s (8 rollouts x 2048 tokens, 4 calls each), `moe` the same
group at 8 rollouts x 8,192 tokens with mixture-of-experts router replay (routed experts: 48 layers x
top-8 per token, uint8). A group's 32 staged call deltas (token ids int64, mask bool, logprobs
float32, routed experts, jagged) are put and fetched, then its 8 training rows (as `build_group`
makes them) are put and fetched, then both are cleared, with TQ's own per-(row, field) layout (the
raw cycle is TQ's API with nothing of rlstream). `groups_per_call` groups share each call. Each
function returns a `CycleResult`: wall seconds for `groups` groups and the seconds spent in each
operation, summed over calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
from tensordict import TensorDict

from bench.common import SHAPE
from schemas.group_build import build_group
from schemas.request import RolloutReassemblerActorConfig
from workers.reassembler.config import default_actor_config
from workers.reassembler.staged_fetch import tensor_rows
from workers.rollout.publisher import segments_to_fields
from workers.rollout.synthetic import SyntheticShape, make_group

# Partitions of their own, so the bounds never meet the end-to-end run's rows.
RAW_STAGING = "dp_staging"
RAW_TRAIN = "dp_train"
OPS = ("put_staging", "get_staging", "put_train", "get_train", "clear")


@dataclass(frozen=True)
class BenchShape:
    """A group shape of the benchmark and the groups per call its bounds and end-to-end run use."""

    name: str
    synthetic: SyntheticShape
    tokens_per_rollout: int
    bound_groups_per_call: tuple[int, ...]
    e2e_groups_per_call: int
    router_replay: bool = False

    @property
    def tokens_per_group(self) -> int:
        return self.synthetic.group_size * self.tokens_per_rollout

    @property
    def actor_config(self) -> RolloutReassemblerActorConfig:
        return msgspec.structs.replace(default_actor_config(), router_replay_enabled=self.router_replay)

    def describe(self) -> str:
        experts = ", routed experts 48 layers x top-8 uint8" if self.router_replay else ""
        return f"groups of 8 rollouts x {self.tokens_per_rollout} tokens (4 calls{experts})"


# 256 prompt tokens + 4 answers of 1948 + 3 observations of 48 = 8192 tokens per rollout.
MOE = SyntheticShape(
    group_size=8,
    calls=(4, 4),
    prompt_len=(256, 256),
    answer_len=(1948, 1948),
    observation_len=(48, 48),
    routed_experts_k=48 * 8,
    routed_experts_dtype="uint8",
)
SHAPES = {
    "dense": BenchShape("dense", SHAPE, 2048, (1, 8), 8),
    # A group is ~50 MB: bytes, not calls, dominate, so one group per call.
    "moe": BenchShape("moe", MOE, 8192, (1,), 1, router_replay=True),
}


@dataclass(frozen=True)
class Payload:
    """The tensors of `groups` prompt groups as one call moves them: staged deltas, then training rows."""

    groups: int
    staging: TensorDict
    staging_tags: list[dict]
    train: TensorDict
    train_tags: list[dict]

    @property
    def staging_bytes(self) -> int:
        return td_bytes(self.staging)

    @property
    def train_bytes(self) -> int:
        return td_bytes(self.train)


@dataclass
class CycleResult:
    """One bound measured over `groups` groups; `ops` sums the seconds of each operation."""

    name: str
    groups_per_call: int
    groups: int
    seconds: float
    ops: dict[str, float] = field(default_factory=dict)

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


def td_bytes(td: TensorDict) -> int:
    """Payload bytes of a TensorDict: the values of jagged fields, the storage of dense ones."""
    return sum((v.values() if v.is_nested else v).nbytes for v in td.values())


def stack_rows(parts: list[TensorDict]) -> TensorDict:
    """TensorDicts of rows concatenated row-wise, jagged fields staying jagged."""
    out: dict[str, torch.Tensor] = {}
    for name, first in parts[0].items():
        rows = [r for td in parts for r in tensor_rows(td.get(name))]
        out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged) if first.is_nested else torch.stack(rows)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in parts)])


def _staging_tag(key: str, group_id: str) -> dict:
    rollout_id, call_id = key.split("/")
    return {"rollout_id": rollout_id, "call_id": call_id, "group_id": group_id, "weight_version": 1}


def make_payload(groups: int, shape: BenchShape = SHAPES["dense"]) -> Payload:
    """`groups` synthetic groups: their staged fields as `stage_rollouts` puts them, their built rows."""
    staged, train, train_tags, seg_list = [], [], [], []
    for g in range(groups):
        rollouts = make_group(f"dp{g}", g, 1, shape=shape.synthetic)
        segments = {c.staging_key: s for r in rollouts for c, s in zip(r.receipt.manifest, r.segments)}
        seg_list += list(segments.values())
        build = build_group(
            group_id=f"dp{g}",
            prompt_idx=g,
            group_size=shape.synthetic.group_size,
            receipts=[r.receipt for r in rollouts],
            segments=segments,
            config=shape.actor_config,
        )
        train.append(build.fields)
        train_tags += build.tags
        staged += [_staging_tag(k, f"dp{g}") for k in segments]
    fields, _ = segments_to_fields(seg_list)
    return Payload(groups, fields, staged, stack_rows(train), train_tags)


def _timed(ops: dict[str, float], name: str, call: Callable[[], object]) -> object:
    t0 = time.perf_counter()
    out = call()
    ops[name] = ops.get(name, 0.0) + time.perf_counter() - t0
    return out


def _run(name: str, payload: Payload, calls: int, one_call: Callable[[int, dict[str, float]], None]) -> CycleResult:
    one_call(-1, {})  # warm-up: first-use costs (connections, allocator) are not the steady state
    ops: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(calls):
        one_call(i, ops)
    return CycleResult(name, payload.groups, calls * payload.groups, time.perf_counter() - t0, ops)


def _keys(payload: Payload, i: int) -> tuple[list[str], list[str]]:
    n_stage, n_train = payload.staging.batch_size[0], payload.train.batch_size[0]
    return [f"c{i}/s{j}" for j in range(n_stage)], [f"c{i}_g{j}" for j in range(n_train)]


def raw_tq_cycle(payload: Payload, calls: int) -> CycleResult:
    """TQ's module-level KV API, one process, nothing of rlstream in between (init_tq has run)."""
    import transfer_queue as tq

    def one_call(i: int, ops: dict[str, float]) -> None:
        skeys, tkeys = _keys(payload, i)
        p = payload
        _timed(ops, "put_staging", lambda: tq.kv_batch_put(skeys, RAW_STAGING, p.staging, p.staging_tags))
        _timed(ops, "get_staging", lambda: tq.kv_batch_get(skeys, RAW_STAGING))
        _timed(ops, "put_train", lambda: tq.kv_batch_put(tkeys, RAW_TRAIN, p.train, p.train_tags))
        _timed(ops, "get_train", lambda: tq.kv_batch_get(tkeys, RAW_TRAIN))
        _timed(ops, "clear", lambda: (tq.kv_clear(skeys, RAW_STAGING), tq.kv_clear(tkeys, RAW_TRAIN)))

    return _run("raw TQ cycle", payload, calls, one_call)


class _KVActor:
    """A Ray actor holding whatever it is sent, by value: the transport without TQ's bookkeeping."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, ...], object] = {}

    def put(self, keys: list[str], fields: TensorDict, tags: list[dict]) -> int:
        self._data[tuple(keys)] = (fields, tags)
        return len(keys)

    def get(self, keys: list[str]) -> TensorDict:
        return self._data[tuple(keys)][0]

    def clear(self, *key_lists: list[str]) -> None:
        for keys in key_lists:
            self._data.pop(tuple(keys), None)


def ray_rpc_cycle(payload: Payload, calls: int) -> CycleResult:
    """The same cycle against `_KVActor`: the tensors pickled into each call and out of each reply."""
    import ray
    from ray import cloudpickle

    # Ray workers cannot import bench/: the actor's class travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(num_cpus=0)(_KVActor).remote()

    def one_call(i: int, ops: dict[str, float]) -> None:
        skeys, tkeys = _keys(payload, i)
        p = payload
        _timed(ops, "put_staging", lambda: ray.get(actor.put.remote(skeys, p.staging, p.staging_tags)))
        _timed(ops, "get_staging", lambda: ray.get(actor.get.remote(skeys)))
        _timed(ops, "put_train", lambda: ray.get(actor.put.remote(tkeys, p.train, p.train_tags)))
        _timed(ops, "get_train", lambda: ray.get(actor.get.remote(tkeys)))
        _timed(ops, "clear", lambda: ray.get(actor.clear.remote(skeys, tkeys)))

    try:
        return _run("Ray RPC by value", payload, calls, one_call)
    finally:
        ray.kill(actor)


def memcpy_cycle(payload: Payload, calls: int) -> CycleResult:
    """The floor: each of the cycle's four moves (put and get of each half) as one flat memcpy."""
    src_s = torch.ones(payload.staging_bytes, dtype=torch.uint8)
    src_t = torch.ones(payload.train_bytes, dtype=torch.uint8)
    dst_s, dst_t = torch.empty_like(src_s), torch.empty_like(src_t)

    def one_call(i: int, ops: dict[str, float]) -> None:
        _timed(ops, "put_staging", lambda: dst_s.copy_(src_s))
        _timed(ops, "get_staging", lambda: src_s.copy_(dst_s))
        _timed(ops, "put_train", lambda: dst_t.copy_(src_t))
        _timed(ops, "get_train", lambda: src_t.copy_(dst_t))

    # One thread, as a single client would copy, and many calls: one copy takes microseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run("memcpy", payload, calls * 50, one_call)
    finally:
        torch.set_num_threads(threads)
