"""Where rlstream's Kafka clients come from: confluent-kafka itself, or something with its three classes.

Every confluent-kafka client rlstream makes is built as `api.Consumer(conf)`, `api.Producer(conf)` or
`api.AdminClient(conf)` from a `KafkaApi` it is given, and the default is confluent-kafka's own classes
(`REAL_KAFKA`), so nothing changes for a caller that passes none. A deterministic model of Kafka
(tests/tools/sim/kafka's `SimKafka`, one process's view of a model cluster) has the same three
classes, so rlstream's own wrappers (`streams.producer`, `streams.consumer`, `streams.admin`'s group
members, the changelog read, the workers' client factories, `resume`) run on it unchanged. Like the
`Runtime`, it is a constructor or call argument only: no setting, flag, file or environment variable
reaches it.
"""

from __future__ import annotations

from typing import Any, Protocol

import confluent_kafka
import confluent_kafka.admin


class KafkaApi(Protocol):
    """confluent-kafka's client classes: `confluent_kafka.Consumer`, `.Producer` and `.admin.AdminClient`."""

    def Consumer(self, conf: dict[str, Any]) -> Any:  # noqa: N802 - confluent-kafka's name
        """A consumer with these librdkafka settings (confluent-kafka's `Consumer` API)."""
        ...

    def Producer(self, conf: dict[str, Any]) -> Any:  # noqa: N802 - confluent-kafka's name
        """A producer with these librdkafka settings (confluent-kafka's `Producer` API)."""
        ...

    def AdminClient(self, conf: dict[str, Any]) -> Any:  # noqa: N802 - confluent-kafka's name
        """An admin client with these librdkafka settings (confluent-kafka's `admin.AdminClient` API)."""
        ...


class _ConfluentKafka:
    Consumer = confluent_kafka.Consumer
    Producer = confluent_kafka.Producer
    AdminClient = confluent_kafka.admin.AdminClient


REAL_KAFKA: KafkaApi = _ConfluentKafka()  # type: ignore[assignment]
"""The real clients: confluent-kafka's classes."""
