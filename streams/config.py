"""Typed Kafka client configuration, passed in explicitly rather than read from the environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class KafkaConfig:
    """Where the cluster is and any client settings to pass through (SASL, TLS, timeouts)."""

    bootstrap_servers: str
    client_settings: Mapping[str, str] = field(default_factory=dict)

    def common(self) -> dict[str, object]:
        # Brokers closing idle connections is routine; librdkafka would log each one.
        conf: dict[str, object] = {"bootstrap.servers": self.bootstrap_servers, "log.connection.close": False}
        conf.update(self.client_settings)
        return conf

    def admin(self) -> dict[str, object]:
        return self.common()

    def producer(self, *, transactional_id: str | None = None, **overrides: object) -> dict[str, object]:
        """Idempotent producer settings; transactional when an id is given."""
        conf = self.common()
        # murmur2 is the Java clients' partitioner: keyed records land where Kafka Streams or a
        # Java producer would put them, which co-partitioning across clients depends on.
        conf.update({"enable.idempotence": True, "acks": "all", "linger.ms": 5,
                     "compression.type": "lz4", "partitioner": "murmur2_random"})
        if transactional_id is not None:
            conf["transactional.id"] = transactional_id
        conf.update(overrides)
        return conf

    def consumer(self, group_id: str, *, read_committed: bool = True, **overrides: object) -> dict[str, object]:
        """Manual-commit consumer settings; offsets move only through transactions or explicit commits."""
        conf = self.common()
        conf.update({
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
        })
        conf.update(overrides)
        return conf


def parse_client_settings(pairs: list[str] | None) -> dict[str, str]:
    """Turn repeated `key=value` command-line settings into a dict, naming a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"client setting {pair!r} is not of the form key=value")
        out[key.strip()] = value.strip()
    return out
