"""verl's v1 replay-buffer interface: the real class when verl imports, else its published signatures.

Mirrored from verl 0.9.1 on PyPI (verl-0.9.1-py3-none-any.whl, verl/trainer/ppo/v1/replay_buffer.py,
class ReplayBufferAsync); 0.9.0 has `sample` only, `get_sampleable_count` and `wait_for_sampleable`
arrived in 0.9.1 for the separate-async trainer. Only signatures matter here: bodies are never run.
"""

from __future__ import annotations

import inspect
from typing import Any

MIRRORED_VERSION = "0.9.1"
METHODS = ("__init__", "sample", "get_sampleable_count", "wait_for_sampleable")
# What verl's trainer_base._build_replay_buffer passes to a custom sampler (keyword arguments).
CUSTOM_SAMPLER_KWARGS = dict(
    trainer_mode="separate_async",
    trainer_config={},
    max_off_policy_threshold=2,
    max_off_policy_strategy="drop",
    sampler_kwargs={},
    refill_fn=print,
)


class PublishedReplayBufferAsync:
    def __init__(
        self,
        trainer_mode: str,
        trainer_config: Any,
        max_off_policy_threshold: int | None,
        max_off_policy_strategy: str,
        sampler_kwargs: Any,
        poll_interval: float = 2.0,
        refill_fn=None,
        filter_groups_metric: str | None = None,
        train_batch_size: int | None = None,
        gen_batch_size: int | None = None,
        max_inflight_gen_batches: int = 1,
        sync_refill_failed_groups: bool = False,
    ): ...

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]: ...

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int: ...

    def wait_for_sampleable(self, global_steps: int, partition_id: str, target_count: int) -> tuple[set[str], dict]: ...


def verl_base() -> tuple[type, str]:
    """verl's ReplayBufferAsync and its version if verl imports here, else the mirrored signatures."""
    try:
        import verl
        from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    except ImportError:
        return PublishedReplayBufferAsync, f"mirrored {MIRRORED_VERSION}"
    return ReplayBufferAsync, f"verl {verl.__version__}"


def incompatibilities(ours: type, theirs: type) -> list[str]:
    """Where `ours` cannot stand in for `theirs`: a positional or keyword call theirs takes that ours would not.

    `__init__` is compared only on what verl passes a custom sampler (the DAPO knobs go to built-ins only).
    """
    problems = []
    for name in METHODS:
        mine = inspect.signature(getattr(ours, name))
        base = inspect.signature(getattr(theirs, name))
        if name == "__init__":
            try:
                mine.bind(None, **CUSTOM_SAMPLER_KWARGS)
            except TypeError as exc:
                problems.append(f"__init__: {exc}")
            continue
        base_params = list(base.parameters.values())
        my_params = list(mine.parameters.values())
        for i, p in enumerate(base_params):
            if i >= len(my_params) or my_params[i].name != p.name or my_params[i].kind != p.kind:
                problems.append(f"{name}: parameter {i} should be {p.name!r} ({p.kind.description})")
        for extra in my_params[len(base_params) :]:
            if extra.default is inspect.Parameter.empty:
                problems.append(f"{name}: extra parameter {extra.name!r} has no default")
    return problems
