"""A replay buffer for verl's v1 trainer that takes its groups from rlstream (select, materialize, ack).

verl (0.9.1, ``verl/trainer/ppo/v1/replay_buffer.py``) loads a custom sampler by path and name::

    trainer.v1.sampler.custom_sampler.path=<path of this file's package>/verl_sampler.py
    trainer.v1.sampler.custom_sampler.name=RlstreamReplayBuffer
    trainer.v1.sampler.sampler_kwargs.rlstream={bootstrap_servers: ..., prefix: ..., consumer_group: ...}

and builds it with the keyword arguments of ``ReplayBuffer.__init__`` (trainer_mode, trainer_config,
max_off_policy_threshold, max_off_policy_strategy, sampler_kwargs, refill_fn). The loader is
duck-typed (``load_extern_type``, and ``hasattr`` checks for ``wait_for_sampleable`` /
``get_sampleable_count`` in the separate-async trainer), so this class does not subclass verl's:
rlstream must not import verl, which pins tensordict<=0.10.

`sample(global_steps, partition_id, batch_size)` selects `batch_size` prompt groups usable at
weight version ``global_steps + version_offset``, writes their rows under verl's field names
(verl_fields.py has the table) into verl's TQ partition `partition_id`, acks them in rlstream (which
clears rlstream's rows) and returns verl's ``KVBatchMeta`` for them with rlstream's metrics. The
keys are a function of the group, so a crash between the put and the ack re-delivers the group
onto the same keys. rlstream's rows stay in rlstream's own partition (``ConsumerConfig.
train_partition``), which must differ from verl's; verl's trainer clears its copies after the step.

Staleness is rlstream's policy: by default `windowed(max_off_policy_threshold - 1)`, verl's "drop"
bound (verl counts a span of versions, rlstream a distance). `refill_fn` is not called: rlstream's
rollout workers produce on their own, and nothing verl generates lands where this buffer reads.
Validation (``partition_id="val"``) is verl's: verl builds one buffer and ``_validate`` samples "val"
from it (``trainer.val_before_train`` defaults to true), so those calls go to verl's own
``ReplayBuffer``/``ReplayBufferAsync``, built with the same arguments on first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig
from streams.tq import KVStore
from workers.adapters.errors import SampleTimeout
from workers.adapters.verl_fields import VerlRows, to_verl_rows, verl_uid
from workers.trainer.batch import BatchMeta
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import Policy, policy_by_name, ready_first, windowed

# The verl release whose signatures this class mirrors (checked by the integration test when verl imports).
VERL_VERSION = "0.9.1"
VALIDATION_PARTITION = "val"


@dataclass(frozen=True)
class VerlSamplerSettings:
    """What ``sampler_kwargs.rlstream`` may set (the consumer's settings go to ConsumerConfig)."""

    version_offset: int = 0  # rlstream weight version = verl global_steps + version_offset
    poll_interval_s: float = 0.5  # longest single wait on Kafka inside a blocking call
    wait_timeout_s: float | None = None  # None: block like verl's own buffer; else raise SampleTimeout
    policy: str | None = None  # rlstream policy name; None: windowed from verl's threshold
    policy_params: Mapping[str, Any] | None = None

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[VerlSamplerSettings, dict[str, Any]]:
        """These settings, and the rest of `options` (for KafkaConfig and ConsumerConfig)."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in own}), {k: v for k, v in options.items() if k not in own}


def _plain(value: Any) -> Any:
    # verl hands over omegaconf DictConfigs; rlstream's configs want plain dicts.
    from omegaconf import OmegaConf  # a dependency of transferqueue

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def default_policy(settings: VerlSamplerSettings, max_off_policy_threshold: int | None) -> Policy:
    """The settings' policy, or verl's bound: a span of `threshold` versions is a staleness of `threshold - 1`."""
    if settings.policy is not None:
        return policy_by_name(settings.policy, **dict(settings.policy_params or {}))
    if max_off_policy_threshold is None:
        return ready_first()
    return windowed(max(0, int(max_off_policy_threshold) - 1))


def consumer_from_options(options: Mapping[str, Any], store: KVStore, policy: Policy) -> ExperienceConsumer:
    """An ExperienceConsumer from ``sampler_kwargs.rlstream`` minus the sampler's own settings."""
    options = dict(options)
    kafka = KafkaConfig(
        options.pop("bootstrap_servers"), client_settings=dict(options.pop("client_settings", None) or {})
    )
    return ExperienceConsumer(kafka, store, ConsumerConfig(**options), policy)


class RlstreamReplayBuffer:
    """verl's v1 replay-buffer plug-in over rlstream's ExperienceConsumer (see the module doc)."""

    def __init__(
        self,
        trainer_mode: str = "separate_async",
        trainer_config: Any = None,
        max_off_policy_threshold: int | None = None,
        max_off_policy_strategy: str = "drop",
        sampler_kwargs: Any = None,
        poll_interval: float = 2.0,
        refill_fn: Callable[[int], None] | None = None,
        *,
        consumer: ExperienceConsumer | None = None,
        store: KVStore | None = None,
    ):
        self.trainer_mode = trainer_mode
        self.trainer_config = trainer_config
        self.max_off_policy_threshold = max_off_policy_threshold
        self.max_off_policy_strategy = max_off_policy_strategy
        self.poll_interval = poll_interval
        self.refill_fn = refill_fn  # kept for verl's introspection; never called (module doc)
        # verl builds one replay buffer for both partitions; validation stays verl's (module doc).
        self._verl_kwargs = dict(
            trainer_mode=trainer_mode,
            trainer_config=trainer_config,
            max_off_policy_threshold=max_off_policy_threshold,
            max_off_policy_strategy=max_off_policy_strategy,
            sampler_kwargs=sampler_kwargs,
            refill_fn=refill_fn,
        )
        self._verl_val: Any = None
        options = dict(_plain(sampler_kwargs or {}).get("rlstream", {}) or {})
        self.settings, consumer_options = VerlSamplerSettings.split(options)
        if store is None:
            if consumer is not None:
                raise InvalidArgument("pass the consumer's store along with the consumer")
            from streams.tq import TQStore

            store = TQStore()
        if consumer is None:
            policy = default_policy(self.settings, max_off_policy_threshold)
            consumer = consumer_from_options(consumer_options, store, policy)
        self._consumer = consumer
        self._store = store
        self.last_batch: BatchMeta | None = None

    @property
    def consumer(self) -> ExperienceConsumer:
        return self._consumer

    def close(self) -> None:
        self._consumer.close()

    def _verl_buffer(self) -> Any:
        """verl's own buffer, built on first use as verl's _build_replay_buffer would without a custom sampler."""
        if self._verl_val is None:
            # Imported here: rlstream itself never imports verl (it pins tensordict<=0.10).
            from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

            cls = ReplayBuffer if self.trainer_mode == "sync" else ReplayBufferAsync
            self._verl_val = cls(**self._verl_kwargs)
        return self._verl_val

    def version_at(self, global_steps: int) -> int:
        return int(global_steps) + self.settings.version_offset

    def _check_partition(self, partition_id: str) -> None:
        if partition_id == self._consumer.config.train_partition:
            raise InvalidArgument(
                f"verl's partition {partition_id!r} is rlstream's train partition: rlstream's rows would be"
                " overwritten and cleared by verl; give rlstream a prefixed train_partition"
            )

    def _ready_groups(self, version: int) -> list:
        """The groups ready at `version` after reading what Kafka has now (no wait)."""
        self._consumer.set_version(version)
        self._consumer.poll(0.0)
        # ExperienceConsumer has no public view of its ready groups yet; this is the one private use.
        return self._consumer.ready_groups()

    def get_sampleable_count(self, global_steps: int, partition_id: str) -> int:
        """How many groups a `sample` at `global_steps` could take now (reads what Kafka has, waits for nothing)."""
        if partition_id == VALIDATION_PARTITION:
            return self._verl_buffer().get_sampleable_count(global_steps, partition_id)
        self._check_partition(partition_id)
        # verl asks at global_steps + 1 before it gets there (on_step_end): moving the consumer's
        # version now would evict groups still usable at the step verl actually samples.
        self._consumer.poll(0.0)
        return self._consumer.usable_at(self.version_at(global_steps))

    def wait_for_sampleable(
        self, global_steps: int, partition_id: str, target_count: int, *, timeout_s: float | None = None
    ) -> tuple[set[str], dict]:
        """Block until `target_count` groups are usable at `global_steps`; their verl uids and rlstream's metrics.

        Waits at most `timeout_s` (default: the settings' wait_timeout_s; None: for ever) and then
        raises SampleTimeout. Nothing is handed out: the groups stay ready for `sample`.
        """
        if partition_id == VALIDATION_PARTITION:
            return self._verl_buffer().wait_for_sampleable(global_steps, partition_id, target_count)
        self._check_partition(partition_id)
        if target_count < 1:
            raise InvalidArgument(f"target_count must be >= 1, got {target_count}")
        version = self.version_at(global_steps)
        limit = self.settings.wait_timeout_s if timeout_s is None else timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        evicted = self._consumer.counts.evicted_stale
        while len(ready := self._ready_groups(version)) < target_count:
            left = self.settings.poll_interval_s if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise SampleTimeout(f"{len(ready)} of {target_count} groups usable at version {version}")
            self._consumer.poll(min(left, self.settings.poll_interval_s))
        metrics = {"rlstream/evicted_stale": self._consumer.counts.evicted_stale - evicted}
        return {verl_uid(g.group_id) for g in ready}, metrics

    def _select(self, version: int, batch_size: int, deadline: float | None) -> BatchMeta:
        while True:
            wait = self.settings.poll_interval_s
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            meta = self._consumer.select(version, min_groups=batch_size, max_groups=batch_size, timeout_s=wait)
            if meta is not None:
                return meta
            if deadline is not None and time.monotonic() >= deadline:
                raise SampleTimeout(f"fewer than {batch_size} groups usable at version {version}")

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        """`batch_size` groups in verl's partition `partition_id`: verl's KVBatchMeta and rlstream's metrics."""
        from transfer_queue import KVBatchMeta

        if partition_id == VALIDATION_PARTITION:
            return self._verl_buffer().sample(global_steps, partition_id, batch_size)
        self._check_partition(partition_id)
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        limit = self.settings.wait_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        evicted = self._consumer.counts.evicted_stale
        meta = self._select(self.version_at(global_steps), batch_size, deadline)
        rows = self._consumer.materialize(meta, layout="jagged")
        verl = to_verl_rows(meta, rows, version_offset=self.settings.version_offset)
        self._hand_over(partition_id, verl)
        self._consumer.ack(meta)
        self.last_batch = meta
        batch = KVBatchMeta(partition_id=partition_id, keys=list(verl.keys), tags=list(verl.tags))
        return batch, self._metrics(meta, verl, self._consumer.counts.evicted_stale - evicted)

    def _hand_over(self, partition_id: str, verl: VerlRows) -> None:
        # Before the ack: a crash in between re-delivers the group, which lands on the same keys.
        if verl.fields is not None:
            self._store.put(partition_id, verl.keys, verl.fields, verl.tags)

    @staticmethod
    def _metrics(meta: BatchMeta, verl: VerlRows, evicted: int) -> dict[str, float]:
        staleness = meta.staleness
        return {
            "rlstream/groups": float(len(meta)),
            "rlstream/rows": float(len(verl.keys)),
            "rlstream/rejected_rows": float(verl.rejected),
            "rlstream/staleness/mean": sum(staleness) / len(staleness),
            "rlstream/staleness/max": float(max(staleness)),
            "rlstream/evicted_stale": float(evicted),
        }
