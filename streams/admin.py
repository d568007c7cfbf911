"""Topic administration over the admin API: idempotent creation, listing and partition counts; the
members of consumer groups.

Generic: it knows nothing of the pipeline's own topics (see `workers.topics`). Every admin call is
followed by `poll(0)`: librdkafka queues its log lines until the client is polled, and an admin
client nobody polls would never hand them to the `rlstream.kafka` logger."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from streams.config import KafkaConfig
from streams.errors import TopicError
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.runtime import REAL_RUNTIME, Runtime


@contextmanager
def _polled(admin: AdminClient) -> Iterator[AdminClient]:
    """Use `admin` for one call, then deliver the log lines it queued (also when the call failed)."""
    try:
        yield admin
    finally:
        admin.poll(0)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)
    replication_factor: int = 1


def create_topics(kafka: KafkaConfig, specs: list[TopicSpec], *, timeout_s: float = 30.0) -> dict[str, str]:
    """Create the topics that do not exist yet; returns name -> 'created' | 'exists'.

    An existing topic whose partition count differs from the spec is an error: co-partitioning
    of receipts and state depends on it.
    """
    admin = AdminClient(kafka.admin())
    with _polled(admin):
        existing = admin.list_topics(timeout=timeout_s).topics
    result: dict[str, str] = {}
    to_create = []
    for spec in specs:
        if spec.name in existing:
            have = len(existing[spec.name].partitions)
            if have != spec.partitions:
                raise TopicError(f"topic {spec.name} exists with {have} partitions, expected {spec.partitions}")
            result[spec.name] = "exists"
        else:
            to_create.append(
                NewTopic(
                    spec.name,
                    num_partitions=spec.partitions,
                    replication_factor=spec.replication_factor,
                    config=dict(spec.config),
                )
            )
    if to_create:
        with _polled(admin):
            result.update(_create(admin, to_create, timeout_s))
    _wait_for_leaders(admin, [s.name for s in specs], timeout_s)
    return result


def _create(admin: AdminClient, topics: list[NewTopic], timeout_s: float) -> dict[str, str]:
    result = {}
    futures = admin.create_topics(topics, operation_timeout=timeout_s, request_timeout=timeout_s)
    for name, fut in futures.items():
        try:
            fut.result()
            result[name] = "created"
        except KafkaException as exc:
            if exc.args[0].name() == "TOPIC_ALREADY_EXISTS":
                result[name] = "exists"
            else:
                raise TopicError(f"creating topic {name} failed: {exc.args[0].str()}") from None
    return result


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout_s: float) -> None:
    # A freshly created topic has no leader for a moment; producing then fails with a retriable
    # error that tests would see as flakiness.
    deadline = time.monotonic() + timeout_s
    while True:
        with _polled(admin):
            md = admin.list_topics(timeout=timeout_s).topics
        pending = [
            n
            for n in names
            if n not in md or md[n].error is not None or any(p.leader < 0 for p in md[n].partitions.values())
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TopicError(f"topics without a leader after {timeout_s:.0f}s: {', '.join(pending)}")
        time.sleep(0.1)


def list_topics(kafka: KafkaConfig, *, timeout_s: float = 10.0) -> dict[str, int]:
    """Non-internal topic names and their partition counts."""
    with _polled(AdminClient(kafka.admin())) as admin:
        md = admin.list_topics(timeout=timeout_s)
    return {name: len(t.partitions) for name, t in sorted(md.topics.items()) if not name.startswith("__")}


def partition_count(kafka: KafkaConfig, topic: str, *, timeout_s: float = 10.0) -> int:
    with _polled(AdminClient(kafka.admin())) as admin:
        md = admin.list_topics(topic=topic, timeout=timeout_s)
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        raise TopicError(f"topic {topic} not found on {kafka.bootstrap_servers}")
    return len(t.partitions)


def broker_count(kafka: KafkaConfig, *, timeout_s: float = 10.0) -> int:
    """How many brokers the cluster's metadata lists."""
    with _polled(AdminClient(kafka.admin())) as admin:
        return len(admin.list_topics(timeout=timeout_s).brokers)


@dataclass(frozen=True)
class GroupMember:
    """A member of a consumer group as the coordinator lists it."""

    client_id: str
    host: str
    member_id: str
    instance_id: str | None = None

    def __str__(self) -> str:
        return f"{self.client_id or self.member_id}@{self.host.lstrip('/')}"


# Answers of a coordinator moving or still loading its groups (a broker just started, a failover):
# asked again within the call's time.
_COORDINATOR_BUSY = frozenset(
    {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE}
)


def group_members(
    kafka: KafkaConfig,
    groups: list[str],
    *,
    timeout_s: float = 10.0,
    api: KafkaApi = REAL_KAFKA,
    runtime: Runtime = REAL_RUNTIME,
) -> dict[str, list[GroupMember]]:
    """The members each consumer group has now (none for a group that does not exist or is empty).

    A member stays listed until it leaves or its session times out, so a process killed a moment ago
    is still listed for up to its `session.timeout.ms`. A coordinator moving or loading is asked again
    until `timeout_s` has passed (on `runtime`'s clock; the admin client comes from `api`).
    """
    if not groups:
        return {}
    out: dict[str, list[GroupMember]] = {}
    deadline = runtime.monotonic() + timeout_s
    with _polled(api.AdminClient(kafka.admin())) as admin:
        todo = list(dict.fromkeys(groups))
        while todo:
            futures = admin.describe_consumer_groups(todo, request_timeout=timeout_s)
            todo = []
            for group, fut in futures.items():
                try:
                    described = fut.result(timeout=timeout_s + 5)
                except KafkaException as exc:
                    code = exc.args[0].code()
                    if code == KafkaError.GROUP_ID_NOT_FOUND:
                        out[group] = []
                        continue
                    if code in _COORDINATOR_BUSY and runtime.monotonic() < deadline:
                        todo.append(group)
                        continue
                    raise
                out[group] = [
                    GroupMember(m.client_id, m.host, m.member_id, m.group_instance_id) for m in described.members
                ]
            if todo:
                runtime.sleep(0.2)
    return out
