"""The pipeline's topics: their names under a prefix, their specs, and what a record of each holds.

A record's role comes from its topic name, and its value is decoded as that role's message.

A pipeline topic's role comes from its name suffix; a replay topic (`[prefix.]replay.<name>`) may hold
a slice of any of them, so its values are recognised by the `"kind"` every message carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from schemas.codec import Message
from schemas.deadletter import DeadLetter
from schemas.errors import InvalidArgument, SchemaError
from schemas.finalized import FinalizedGroup
from schemas.gym_receipt import GymReceipt
from schemas.receipt import Receipt
from schemas.regenerate import Regenerate
from schemas.state import GroupState, PartitionProgress
from schemas.trainer_progress import TrainerProgress
from schemas.trainer_version import TrainerVersion
from streams.admin import TopicSpec

RECEIPTS = "rollout.receipts"
FINALIZED = "experience.finalized"
DEADLETTER = "experience.deadletter"
# Finalized records the trainer cannot use (undecodable, rows missing from TQ), with the reason.
TRAINER_DEADLETTER = "trainer.deadletter"
STATE = "reassembler.state"
# The trainer's current weight version, keyed by trainer id (compacted): what admission gates read.
TRAINER_VERSION = "trainer.version"
# The resolved records past a trainer's commit that its metadata cannot hold (compacted, one key a chunk).
TRAINER_PROGRESS = "trainer.progress"
# Prompt groups handed back for regeneration (their tensors were lost with the job), keyed by group id.
REGENERATE = "rollout.regenerate"
REPLAY_PREFIX = "replay."
# How long the progress topic keeps a tombstone once compacted (delete.retention.ms): ten minutes.
PROGRESS_TOMBSTONE_MS = "600000"


@dataclass(frozen=True)
class TopicNames:
    """The pipeline's topic names under a prefix, so several runs can share one cluster."""

    prefix: str = ""

    def _p(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    @property
    def receipts(self) -> str:
        return self._p(RECEIPTS)

    @property
    def finalized(self) -> str:
        return self._p(FINALIZED)

    @property
    def deadletter(self) -> str:
        return self._p(DEADLETTER)

    @property
    def trainer_deadletter(self) -> str:
        return self._p(TRAINER_DEADLETTER)

    @property
    def state(self) -> str:
        return self._p(STATE)

    @property
    def trainer_version(self) -> str:
        return self._p(TRAINER_VERSION)

    @property
    def trainer_progress(self) -> str:
        return self._p(TRAINER_PROGRESS)

    @property
    def regenerate(self) -> str:
        return self._p(REGENERATE)

    def replay(self, name: str) -> str:
        return self._p(REPLAY_PREFIX + name)


def default_replication(brokers: int) -> int:
    """Replication factor of the pipeline's topics on a cluster of `brokers`: 3 where it can be."""
    return max(1, min(3, brokers))


def pipeline_topics(
    names: TopicNames,
    partitions: int = 4,
    replication_factor: int = 1,
    config: Mapping[str, str] | None = None,
) -> list[TopicSpec]:
    """Receipts, finalized, the two dead-letter topics, the trainer's version and progress (compacted, one
    partition each), the hand-backs for regeneration and the state changelog (compacted, co-partitioned
    with receipts); the changelog comes last.

    `config` applies to every topic. With 3 or more replicas, `min.insync.replicas` defaults to 2, so
    an acknowledged write (acks=all) survives the loss of any one broker; with 2 replicas it is 1.

    Receipts, finalized records and hand-backs are kept for good (`retention.ms=-1`) unless `config`
    says otherwise: what lies past the reassemblers', the trainer's and the rollout workers' offsets is
    what a job restarted after any outage still needs (`workers/trainer/resume.py`), and the broker's
    default (7 days) lost it to a job down a week. They are the run's record (metadata only, about a
    KB per group); delete a finished run's topics with the run. The state changelog is compacted
    (entries stay until tombstoned), the version topic too; dead letters keep the broker's default.
    """
    if partitions < 1:
        raise InvalidArgument(f"partitions must be >= 1, got {partitions}")
    if replication_factor < 1:
        raise InvalidArgument(f"replication factor must be >= 1, got {replication_factor}")
    # Two in sync when there are three replicas; one with two, or losing a broker would stop writes.
    common = {"min.insync.replicas": "2" if replication_factor >= 3 else "1"} if replication_factor >= 2 else {}
    common.update(config or {})
    compacted = {**common, "cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": "60000"}
    kept = {"retention.ms": "-1", **common}
    # Trainers read the progress topic whole (workers/trainer/progress.py): a tombstone need only outlast
    # one read, seconds, where the broker's default (a day) kept a day of them in every read.
    progress = {"delete.retention.ms": PROGRESS_TOMBSTONE_MS, **compacted}
    return [
        TopicSpec(names.receipts, partitions, dict(kept), replication_factor=replication_factor),
        TopicSpec(names.finalized, partitions, dict(kept), replication_factor=replication_factor),
        TopicSpec(names.deadletter, 1, dict(common), replication_factor=replication_factor),
        TopicSpec(names.trainer_deadletter, 1, dict(common), replication_factor=replication_factor),
        TopicSpec(names.trainer_version, 1, dict(compacted), replication_factor=replication_factor),
        TopicSpec(names.trainer_progress, 1, progress, replication_factor=replication_factor),
        TopicSpec(names.regenerate, partitions, dict(kept), replication_factor=replication_factor),
        TopicSpec(names.state, partitions, compacted, replication_factor=replication_factor),
    ]


RECEIPTS_ROLE, FINALIZED_ROLE, DEADLETTER_ROLE, STATE_ROLE = "receipts", "finalized", "deadletter", "state"
TRAINER_VERSION_ROLE = "trainer_version"
TRAINER_PROGRESS_ROLE = "trainer_progress"
REGENERATE_ROLE = "regenerate"
_SUFFIXES = {
    RECEIPTS: RECEIPTS_ROLE,
    FINALIZED: FINALIZED_ROLE,
    DEADLETTER: DEADLETTER_ROLE,
    TRAINER_DEADLETTER: DEADLETTER_ROLE,
    STATE: STATE_ROLE,
    TRAINER_VERSION: TRAINER_VERSION_ROLE,
    TRAINER_PROGRESS: TRAINER_PROGRESS_ROLE,
    REGENERATE: REGENERATE_ROLE,
}
# The state topic holds two kinds (a prompt group's entry and its partition's progress); the first
# kind of a role is what an unrecognised value is decoded as, so its error names the usual message.
_BY_ROLE: dict[str, tuple[type[Message], ...]] = {
    # rlstream's own receipts and NeMo Gym's, side by side (a consumer group reads both).
    RECEIPTS_ROLE: (Receipt, GymReceipt),
    FINALIZED_ROLE: (FinalizedGroup,),
    DEADLETTER_ROLE: (DeadLetter,),
    STATE_ROLE: (GroupState, PartitionProgress),
    TRAINER_VERSION_ROLE: (TrainerVersion,),
    TRAINER_PROGRESS_ROLE: (TrainerProgress,),
    REGENERATE_ROLE: (Regenerate,),
}
_BY_KIND: dict[str, type[Message]] = {cls.kind(): cls for kinds in _BY_ROLE.values() for cls in kinds}


class _Kind(msgspec.Struct):
    kind: str = ""


_KIND = msgspec.msgpack.Decoder(_Kind)


def is_replay_topic(topic: str) -> bool:
    return topic.startswith(REPLAY_PREFIX) or f".{REPLAY_PREFIX}" in topic


def topic_role(topic: str) -> str | None:
    """Role from the name: receipts, finalized, deadletter, state, trainer_version, trainer_progress, regenerate;
    else None."""
    if is_replay_topic(topic):
        return None
    for suffix, role in _SUFFIXES.items():
        if topic == suffix or topic.endswith("." + suffix):
            return role
    return None


def sniff_kind(value: bytes | None) -> str | None:
    """The message kind a MessagePack value says it is, or None when it is not one of ours."""
    if not value:
        return None
    try:
        return _KIND.decode(value).kind or None
    except Exception:  # noqa: BLE001 - garbage is a normal input here (poison receipts)
        return None


def decode_value(value: bytes | None, role: str | None = None) -> Message:
    """Decode a record value as its role's message (sniffing the kind when role is None); SchemaError if not."""
    if value is None:
        raise SchemaError("record", "empty value (tombstone)")
    cls = _role_class(role, value) if role else _BY_KIND.get(sniff_kind(value) or "")
    if cls is None:
        raise SchemaError("record", f"not an rlstream message (kind {sniff_kind(value)!r})")
    return cls.from_bytes(value)


def _role_class(role: str, value: bytes) -> type[Message] | None:
    kinds = _BY_ROLE.get(role, ())
    if len(kinds) > 1:  # sniffing costs a parse, so only where a role has a choice
        kind = sniff_kind(value)
        return next((cls for cls in kinds if cls.kind() == kind), kinds[0])
    return kinds[0] if kinds else None


def receipt_from_bytes(value: bytes) -> Receipt | GymReceipt:
    """A receipt of either kind (rlstream's or NeMo Gym's); SchemaError if it is neither."""
    cls = GymReceipt if sniff_kind(value) == GymReceipt.kind() else Receipt
    return cls.from_bytes(value)


def message_group_id(msg: Message) -> str | None:
    """The prompt group a message is about (a dead letter: the group of its original receipt, if any)."""
    if isinstance(msg, (Receipt, GymReceipt, FinalizedGroup, GroupState, Regenerate)):
        return msg.group_id
    if isinstance(msg, DeadLetter):
        try:
            return receipt_from_bytes(msg.original).group_id
        except SchemaError:
            return msg.source_key.decode(errors="replace") if msg.source_key else None
    return None


def message_weight_versions(msg: Message) -> tuple[int, int] | None:
    """(lowest, highest) policy weight version a message carries, or None when it carries none."""
    if isinstance(msg, FinalizedGroup):
        return msg.group_min_wv, msg.group_max_wv
    if isinstance(msg, (Receipt, GymReceipt)):
        versions = [c.weight_version for c in msg.manifest]
        return (min(versions), max(versions)) if versions else None
    if isinstance(msg, DeadLetter):
        try:
            return message_weight_versions(receipt_from_bytes(msg.original))
        except SchemaError:
            return None
    return None
