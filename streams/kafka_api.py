"""Where rlstream's Kafka clients come from: confluent-kafka itself, or something with its two classes.

Every confluent-kafka client rlstream makes is built as `api.Consumer(conf)` or `api.Producer(conf)`
from a `KafkaApi` it is given, and the default is the `confluent_kafka` module itself, so nothing
changes for a caller that passes none. A deterministic model of Kafka (tests/tools/sim/kafka's
`SimKafka`, one process's view of a model cluster) has the same two classes, so rlstream's own
wrappers (`streams.producer`, `streams.consumer`, the changelog read, the workers' client factories)
run on it unchanged. Like the `Runtime`, it is a constructor or call argument only: no setting,
flag, file or environment variable reaches it.
"""

from __future__ import annotations

from typing import Any, Protocol

import confluent_kafka


class KafkaApi(Protocol):
    """confluent-kafka's client classes: what `confluent_kafka` (the module) offers."""

    def Consumer(self, conf: dict[str, Any]) -> Any:  # noqa: N802 - confluent-kafka's name
        """A consumer with these librdkafka settings (confluent-kafka's `Consumer` API)."""
        ...

    def Producer(self, conf: dict[str, Any]) -> Any:  # noqa: N802 - confluent-kafka's name
        """A producer with these librdkafka settings (confluent-kafka's `Producer` API)."""
        ...


REAL_KAFKA: KafkaApi = confluent_kafka  # type: ignore[assignment]
"""The real clients: the confluent_kafka module."""
