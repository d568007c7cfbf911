"""What verl's ``trainer.v1.sampler.sampler_kwargs.rlstream`` may hold, and the consumer and policy it builds.

The sampler's own settings are `VerlSamplerSettings`; every other key goes to rlstream's
``ConsumerConfig`` (prefix, consumer_group, train_partition, ...) or ``KafkaConfig``
(bootstrap_servers, client_settings). docs/VERL.md lists the override lines a verl user writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from streams.config import KafkaConfig, is_secret
from streams.errors import ConfigError
from streams.tq import KVStore
from workers.actors.kafka_secrets import SECRETS_ENV, KafkaFiles, node_settings
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import Policy, policy_by_name, ready_first, windowed


@dataclass(frozen=True)
class VerlSamplerSettings:
    """What ``sampler_kwargs.rlstream`` may set (the consumer's settings go to ConsumerConfig)."""

    version_offset: int = 0  # rlstream weight version = verl's weight label + version_offset
    poll_interval_s: float = 0.5  # longest single wait on Kafka inside a blocking call
    wait_timeout_s: float | None = None  # None: block like verl's own buffer; else raise SampleTimeout
    policy: str | None = None  # rlstream policy name; None: windowed from verl's threshold
    policy_params: Mapping[str, Any] | None = None
    group_size: int | None = None  # verl's actor_rollout_ref.rollout.n; a group of another size is refused
    checkpoint_dir: str | None = None  # verl's trainer.default_local_dir: state saved beside its checkpoints
    resume_mode: str = "auto"  # verl's trainer.resume_mode
    resume_from_path: str | None = None  # verl's trainer.resume_from_path
    publish_version: bool = True  # the trainer's version on <prefix>.trainer.version, for admission gates
    trainer_id: str = "verl"
    guard_tq: bool = True  # keep verl's whole-TQ checkpoint and close off rlstream's partitions
    refill_lost: bool = True  # have verl dispatch a prompt for each group that will never reach it

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[VerlSamplerSettings, dict[str, Any]]:
        """These settings, and the rest of `options` (for KafkaConfig and ConsumerConfig)."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in own}), {k: v for k, v in options.items() if k not in own}


def plain(value: Any) -> Any:
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


# Where verl's config keeps rlstream's Kafka settings.
RLSTREAM_OPTIONS = "trainer.v1.sampler.sampler_kwargs.rlstream"


def kafka_from_options(options: dict[str, Any], env: Mapping[str, str] | None = None) -> KafkaConfig:
    """The KafkaConfig of ``sampler_kwargs.rlstream`` (its keys are taken out of `options`), read on this node.

    verl hands its whole config to Ray actors (its TaskRunner, which builds the replay buffer, and the
    agent-loop workers), and Ray records what an actor is given, so ``client_settings`` there may
    hold no secret (ConfigError naming it). Secrets are read on the node each process runs on, as a
    reassembler actor reads them (`workers.actors.kafka_secrets.node_settings`): from the librdkafka
    properties file ``kafka_config`` names (the same path on every node), then
    ``RLSTREAM_KAFKA_CLIENT_SETTINGS`` in the environment the node's Ray was started with; the
    settings ``client_settings`` names win over the node's where both say.
    """
    settings = {str(k): str(v) for k, v in dict(options.pop("client_settings", None) or {}).items()}
    secret = sorted(k for k in settings if is_secret(k))
    if secret:
        raise ConfigError(
            f"{RLSTREAM_OPTIONS}.client_settings holds secret setting(s) {', '.join(secret)}: verl hands its "
            "whole config to Ray actors and Ray records what an actor is given. Put them in a librdkafka "
            f"properties file at the same path on every node, named by {RLSTREAM_OPTIONS}.kafka_config, or in "
            f"{SECRETS_ENV} (a JSON object) in the environment every node's Ray was started with (docs/VERL.md)"
        )
    properties = options.pop("kafka_config", None)
    found, _ = node_settings(KafkaFiles(properties=None if properties is None else str(properties)), env)
    return KafkaConfig(options.pop("bootstrap_servers"), client_settings={**found, **settings})


def consumer_from_options(options: Mapping[str, Any], store: KVStore, policy: Policy) -> ExperienceConsumer:
    """An ExperienceConsumer from ``sampler_kwargs.rlstream`` minus the sampler's own settings.

    A group whose rows are gone is dead-lettered unless the user says otherwise: a hand-back goes to
    ``rollout.regenerate``, which nothing reads in a verl deployment (verl's prompts come from its
    dataloader), and the replay buffer has verl dispatch a prompt in its place instead.
    """
    options = {"hand_back_lost_rows": False, **options}
    kafka = kafka_from_options(options)
    return ExperienceConsumer(kafka, store, ConsumerConfig(**options), policy)
