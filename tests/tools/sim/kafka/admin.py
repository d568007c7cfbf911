"""`confluent_kafka.admin.AdminClient` as the model offers it: what rlstream's `resume` and `streams.admin` ask.

- `describe_consumer_groups(ids)`: each group's members as the coordinator lists them now (member id,
  client id, host, group.instance.id, assignment) and its state; a member stays listed until it leaves
  or the coordinator removes it (its session timed out: a killed or frozen process, a static member
  closed). A group the broker does not know (no member, no committed offset) is described with no
  members, as Kafka 4.1 answers librdkafka 2.16 (not `GROUP_ID_NOT_FOUND`, which `streams.admin` also
  takes for empty).
- `describe_configs(resources)`: a topic's configs as `ConfigEntry`s by name: the ones it was created
  with, and `retention.ms` (the cluster's default when it set none); an unknown topic fails
  `UNKNOWN_TOPIC_OR_PART`.
- `list_topics`: the cluster's metadata, as a consumer's.

While the broker is down, each call's futures fail `_TIMED_OUT` once its `request_timeout` (30 s by
default) has passed. Every future is done when the call returns (the call waits in virtual time), so a
`result()` never blocks a simulated thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigEntry, ConfigResource

from tests.tools.sim.kafka import errors
from tests.tools.sim.kafka.messages import cluster_metadata

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEAD = "Dead"  # the state a broker describes a group it does not know in


@dataclass(frozen=True)
class MemberAssignment:
    topic_partitions: list[TopicPartition] = field(default_factory=list)


@dataclass(frozen=True)
class MemberDescription:
    """`confluent_kafka.admin.MemberDescription`'s fields rlstream reads."""

    member_id: str
    client_id: str
    host: str
    assignment: MemberAssignment
    group_instance_id: str | None = None


@dataclass(frozen=True)
class ConsumerGroupDescription:
    """`confluent_kafka.admin.ConsumerGroupDescription`'s fields rlstream reads."""

    group_id: str
    is_simple_consumer_group: bool
    members: list[MemberDescription]
    partition_assignor: str
    state: str


def _done(value: Any = None, error: KafkaError | None = None) -> Future:
    fut: Future = Future()
    if error is not None:
        fut.set_exception(KafkaException(error))
    else:
        fut.set_result(value)
    return fut


class AdminClient:
    def __init__(self, conf: dict, *, cluster: KafkaCluster, process: str = "main"):
        self._cluster, self._env, self._process = cluster, cluster.env, process
        self.name = conf.get("client.id") or cluster.client_name("admin")

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def _reachable(self, request_timeout: float | None, call: str) -> KafkaError | None:
        """None once the broker answers; `_TIMED_OUT` when it stayed down for the request's timeout."""
        self._env.point(f"kafka.admin.{call}.begin", client=self.name, process=self._process)
        timeout = DEFAULT_REQUEST_TIMEOUT_S if request_timeout is None or request_timeout < 0 else request_timeout
        if self._env.wait_until(lambda: self._cluster.broker_up, self._env.now() + timeout):
            return None
        return errors.error(KafkaError._TIMED_OUT, f"{call}: Local: Timed out")

    def describe_consumer_groups(self, group_ids: list[str], request_timeout: float | None = None, **_: Any):
        down = self._reachable(request_timeout, "describe_consumer_groups")
        out: dict[str, Future] = {}
        for gid in group_ids:
            out[gid] = _done(error=down) if down is not None else self._describe(gid)
        return out

    def _describe(self, gid: str) -> Future:
        with self._cluster.lock:
            g = self._cluster.groups.groups.get(gid)
            if g is None or not (g.members or g.offsets or g.pending):
                return _done(ConsumerGroupDescription(gid, False, [], "", DEAD))
            members = [
                MemberDescription(
                    m.member_id,
                    m.client.client_id,
                    f"/{m.client.process}",
                    MemberAssignment([TopicPartition(t, p) for t, p in sorted(m.owned)]),
                    m.instance_id,
                )
                for m in g.members.values()
            ]
            return _done(ConsumerGroupDescription(gid, False, members, g.protocol or "", g.state))

    def describe_configs(self, resources: list[ConfigResource], request_timeout: float | None = None, **_: Any):
        down = self._reachable(request_timeout, "describe_configs")
        out: dict[ConfigResource, Future] = {}
        for r in resources:
            if down is not None:
                out[r] = _done(error=down)
                continue
            topic = self._cluster.topics.get(r.name)
            if topic is None:
                out[r] = _done(error=errors.unknown_topic(r.name))
                continue
            configs = {"retention.ms": str(topic.retention_ms(self._cluster.config.default_retention_ms))}
            configs.update({k: str(v) for k, v in topic.config.items()})
            out[r] = _done({k: ConfigEntry(k, v) for k, v in configs.items()})
        return out

    def list_topics(self, topic: str | None = None, timeout: float | None = -1):
        return cluster_metadata(self._cluster, topic, timeout)
