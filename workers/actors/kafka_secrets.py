"""How a Ray actor gets its Kafka secrets: read on its own node, never handed to it through Ray.

Ray records what an actor is given. Constructor and method arguments are pickled into task specs
(kept by the caller to retry a call, by the GCS to restart an actor), and a `runtime_env` is stored
with the job; a `KafkaConfig` holding `sasl.password` passed that way leaves the password in those
records. So a driver hands an actor a `NodeKafka` (`for_actors`): the client settings without any
secret-looking one (`streams.config.is_secret`), the names of those left out, and where the actor
reads them on its node: the librdkafka properties file (`--kafka-config`) and the settings file
(`--config`, its `[kafka.client_settings]`) at the same paths on every node, and
`RLSTREAM_KAFKA_CLIENT_SETTINGS` in the Ray node's environment, with the driver's precedence (settings
file < properties file < environment). A child process gets its settings whole on its stdin instead
(`workers.reassembler.run`): a pipe keeps no record.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig, is_secret, read_client_properties
from streams.errors import ConfigError
from streams.settings import env_name, from_env, read_file


class KafkaFiles(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Files Kafka client settings are read from, at the same path on every node (None: not used)."""

    properties: str | None = None  # librdkafka key=value lines, as `--kafka-config` reads them
    config: str | None = None  # a settings file (TOML or JSON), as `--config`: its [kafka.client_settings]


# Settings read from no file: on a node, the environment only.
NO_FILES = KafkaFiles()
# Where a node's processes find client settings (a JSON object), secrets among them.
SECRETS_ENV = env_name(KafkaConfig, "client_settings")


class NodeKafka(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An actor's Kafka settings as Ray may carry them: no secret, only the names of those read on the node."""

    kafka: KafkaConfig
    secrets: tuple[str, ...] = ()
    files: KafkaFiles = NO_FILES

    def __post_init__(self) -> None:
        carried = sorted(k for k in self.kafka.client_settings if is_secret(k))
        if carried:
            raise InvalidArgument(
                f"Kafka settings for a Ray actor carry secret setting(s) {', '.join(carried)}: Ray records an "
                "actor's arguments; build them with for_actors(), which leaves secrets to be read on the node"
            )

    def resolve(self, env: Mapping[str, str] | None = None) -> KafkaConfig:
        """The whole `KafkaConfig` on this node: the settings carried, plus the secrets read here.

        ConfigError naming the secret settings not found and where they were looked for, never a value.
        """
        found, looked = node_settings(self.files, env)
        missing = [k for k in self.secrets if k not in found]
        if missing:
            raise ConfigError(
                f"Kafka secret setting(s) {', '.join(missing)} not found on this node (looked in "
                f"{', '.join(looked)}): give every Ray node the same --kafka-config file at the same path, "
                f"or {SECRETS_ENV} in the environment Ray runs on (docs/CLUSTER.md, 'Secrets for Ray actors')"
            )
        secrets = {k: found[k] for k in self.secrets}
        return KafkaConfig(self.kafka.bootstrap_servers, {**self.kafka.client_settings, **secrets})


def node_settings(
    files: KafkaFiles = NO_FILES, env: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """The Kafka client settings this node holds, and where they were looked for: the settings file's
    `[kafka.client_settings]` < the librdkafka properties file < `$RLSTREAM_KAFKA_CLIENT_SETTINGS`
    (`env`, default this process's environment), the driver's precedence."""
    found: dict[str, str] = {}
    looked: list[str] = []
    if files.config is not None:
        section = read_file(files.config).get(KafkaConfig.section, {})
        client = section.get("client_settings", {}) if isinstance(section, Mapping) else {}
        found.update({str(k): str(v) for k, v in (client if isinstance(client, Mapping) else {}).items()})
        looked.append(f"[kafka.client_settings] of {files.config}")
    if files.properties is not None:
        found.update(read_client_properties(files.properties))
        looked.append(str(files.properties))
    settings = from_env(KafkaConfig, os.environ if env is None else env).get("client_settings", {})
    found.update({str(k): str(v) for k, v in settings.items()})
    looked.append(f"${SECRETS_ENV}")
    return found, looked


def for_actors(kafka: KafkaConfig, files: KafkaFiles = NO_FILES) -> NodeKafka:
    """`kafka` as Ray actors may be handed it: its secrets left out, to be read on each node from `files`
    or the environment (`NodeKafka.resolve`)."""
    secrets = tuple(sorted(k for k in kafka.client_settings if is_secret(k)))
    public = {k: v for k, v in kafka.client_settings.items() if not is_secret(k)}
    return NodeKafka(KafkaConfig(kafka.bootstrap_servers, public), secrets, files)


def kafka_files(properties: str | Path | None = None, config: str | Path | None = None) -> KafkaFiles:
    """`KafkaFiles` of the paths a driver read its settings from (absolute: an actor's working directory differs)."""

    def absolute(path: str | Path | None) -> str | None:
        return None if path is None else str(Path(path).resolve())

    return KafkaFiles(absolute(properties), absolute(config))


def check_on_nodes(what: str, actors: Sequence[Any], checks: Sequence[Any]) -> None:
    """Wait for `checks`, each actor's check of its Kafka settings on its node (ObjectRefs); on the first
    that fails, kill `actors` and raise one ConfigError naming `what` and the actor's reason (a
    secret the node lacks, where it looked), before any of them connects."""
    import ray

    try:
        ray.get(list(checks))
    except ray.exceptions.RayTaskError as exc:
        for actor in actors:
            ray.kill(actor)
        cause = getattr(exc, "cause", None)
        raise ConfigError(f"{what}: {cause if cause is not None else exc}") from None
