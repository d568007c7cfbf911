"""Running a reassembler over a replay topic without touching production.

A replay run reads `[prefix.]replay.<name>` with its own consumer group and writes its finalized
records, dead letters and state under another topic prefix. Its packed rows go to a TQ train
partition of their own (sample IDs are deterministic, `{group_id}_g{i}`, so writing to `train`
would overwrite production rows), and it reads the staged tensors without clearing them: they
belong to production, which may not have finalized those groups yet.
"""

from __future__ import annotations

import msgspec

from schemas.errors import InvalidArgument
from streams.admin import create_topics, partition_count
from streams.config import KafkaConfig
from streams.tq import TRAIN
from workers.reassembler.config import DEFAULT_CONSUMER_GROUP as PRODUCTION_GROUP
from workers.reassembler.config import ReassemblerConfig
from workers.topics import REPLAY_PREFIX, is_replay_topic, pipeline_topics


def replay_source_prefix(replay_topic: str) -> str:
    """The topic prefix a replay topic lives under (`p.replay.x` -> `p`, `replay.x` -> ``)."""
    if replay_topic.startswith(REPLAY_PREFIX):
        return ""
    return replay_topic[: replay_topic.index("." + REPLAY_PREFIX)]


def replay_train_partition(prefix: str) -> str:
    """The TQ partition a replay run under `prefix` writes its packed rows to."""
    return f"{TRAIN}@{prefix}"


def prepare_replay_run(kafka: KafkaConfig, config: ReassemblerConfig, *, create: bool = True) -> ReassemblerConfig:
    """Check that a config reading a replay topic is isolated from production, and isolate its TQ writes.

    Refuses (InvalidArgument) the production consumer group and the replay topic's own prefix (whose
    finalized topic the trainer reads); creates the output topics under the run's prefix with the
    replay topic's partition count, so the state changelog stays co-partitioned with its input.
    A config whose input is not a replay topic is returned unchanged.
    """
    topic = config.input_topic
    if not topic or not is_replay_topic(topic):
        return config
    source_prefix = replay_source_prefix(topic)
    if config.topics.prefix == source_prefix:
        raise InvalidArgument(
            f"input {topic} is a replay topic: pass --prefix other than {source_prefix!r}, or the "
            f"run would write to the production topics {config.topics.finalized} and "
            f"{config.topics.state}"
        )
    if config.consumer_group == PRODUCTION_GROUP:
        raise InvalidArgument(
            f"input {topic} is a replay topic: pass its own --consumer-group, not the production "
            f"consumer group {PRODUCTION_GROUP!r}"
        )
    if create:
        create_topics(kafka, pipeline_topics(config.topics, partition_count(kafka, topic)))
    actor = msgspec.structs.replace(config.actor, partition_id=replay_train_partition(config.topics.prefix))
    return msgspec.structs.replace(config, actor=actor, clear_staging=False)
