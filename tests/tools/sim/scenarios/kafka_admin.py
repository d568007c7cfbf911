"""Kafka scenario of the admin calls `resume` makes (K20): consumer groups' members, topics' retention."""

from __future__ import annotations

from confluent_kafka import KafkaException
from confluent_kafka.admin import ConfigResource

from tests.tools.sim.scenarios.kafka_groups import COOP
from tests.tools.sim.scenarios.observe import kerr, settled

# A coordinator still loading (a broker's first group calls create __consumer_offsets): asked again, as
# `streams.admin.group_members` does; not what the scenario compares.
_BUSY = {"NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE"}


def _members(w, admin, group: str):
    """(client id, group.instance.id) of each member, sorted, or the error the description failed with."""
    for _ in range(60):
        try:
            described = admin.describe_consumer_groups([group], request_timeout=15)[group].result(timeout=20)
        except KafkaException as exc:
            if exc.args[0].name() in _BUSY:
                w.sleep(0.5)
                continue
            return kerr(exc.args[0])
        return sorted((m.client_id, m.group_instance_id) for m in described.members)
    return "coordinator busy for 30 s"


def admin_groups(w) -> dict:
    """K20: a group's members as listed while they are members; a topic's retention.ms, its own or the default."""
    t = w.topic(2)
    kept = w.topic(1, **{"retention.ms": "-1"})
    group = w.name("g")
    admin = w.admin()
    obs = {"unknown_group": _members(w, admin, w.name("none"))}
    a = w.consumer(group, **COOP, **{"client.id": "member-a"})
    b = w.consumer(group, **COOP, **{"client.id": "member-b", "group.instance.id": "ib"})
    a.subscribe([t])
    b.subscribe([t])
    settled({"a": a, "b": b}, 2, w)
    obs["both"] = _members(w, admin, group)
    a.close()  # a dynamic member leaves as it closes
    obs["dynamic_closed"] = _members(w, admin, group)
    b.close()  # a static one stays a member until its session times out
    obs["static_closed"] = _members(w, admin, group)
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in (t, kept)])
    got = {r.name: f.result(timeout=20)["retention.ms"].value for r, f in futures.items()}
    obs["retention"] = (got[t], got[kept])
    return obs
