"""Kafka client configuration: where the cluster is and the client settings passed through.

Passed in explicitly, never read from the environment here; `streams.settings` builds it from a
file, `RLSTREAM_KAFKA_*` variables and flags. Its repr hides secret-looking settings so it can be
logged.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from schemas.errors import InvalidArgument
from streams.errors import ConfigError
from streams.settings import Settings

# librdkafka's own log lines go through Python logging under this name, never straight to stderr.
CLIENT_LOGGER = "rlstream.kafka"
# librdkafka's settings whose values are secrets (its CONFIGURATION.md, 2.x). It flags a few more
# as sensitive whose values are no secret: a path (ssl.key.location), a public certificate
# (ssl.ca.pem) or a user name (sasl.username). sasl.oauthbearer.config can carry credentials.
SECRET_SETTINGS = frozenset(
    {
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.client.credentials.client.secret",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.password",
    }
)
# Names of their shape a later librdkafka may add: a password, a passphrase, a secret, a private key as PEM.
_SECRET_ENDINGS = (".password", ".passphrase", ".secret", ".key.pem")


def is_secret(setting: str) -> bool:
    """Whether a client setting's value is a secret: never printed, refused on a command line and in
    what a Ray actor is handed. librdkafka's `SECRET_SETTINGS`, and names ending as theirs do
    (`.password`, `.passphrase`, `.secret`, `.key.pem`); a path, a certificate, a URL or a user name
    (ssl.ca.pem, sasl.oauthbearer.token.endpoint.url, sasl.username) is not one.
    """
    name = setting.lower().strip()
    return name in SECRET_SETTINGS or name.endswith(_SECRET_ENDINGS)


def shown_key(pair: str) -> str:
    """What a message may show of a malformed `key=value` setting: the key at most, never a value."""
    key = pair.partition("=")[0] if "=" in pair else re.split(r"[:\s]", pair.strip(), maxsplit=1)[0]
    return key.strip()[:40]


def malformed_setting(pair: str) -> str:
    """Why `pair` is no `key=value` setting, naming its key only (its value may be a secret)."""
    key = shown_key(pair)
    if not key:
        return "a setting with an empty key is not of the form KEY=VALUE"
    return f"{key!r}... is not of the form KEY=VALUE"


class KafkaConfig(Settings, frozen=True, kw_only=False):
    section = "kafka"

    bootstrap_servers: Annotated[str, Meta(min_length=1, description="Kafka bootstrap servers, host:port[,...]")]
    client_settings: Annotated[
        dict[str, str], Meta(description="extra librdkafka settings for every client (SASL, TLS, ...)")
    ] = {}

    def __repr__(self) -> str:
        shown = {k: ("***" if is_secret(k) else v) for k, v in self.client_settings.items()}
        return f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, client_settings={shown!r})"

    __str__ = __repr__

    def __reduce__(self):
        # Pickle is how Ray hands an actor or task its arguments, and Ray keeps them (task specs for
        # retries, the GCS for restarts): a secret pickled is a secret recorded. Refused on the
        # caller, before anything is sent; rlstream's own wire formats are msgpack, never pickle.
        carried = sorted(k for k in self.client_settings if is_secret(k))
        if carried:
            raise InvalidArgument(
                f"a KafkaConfig holding secret setting(s) {', '.join(carried)} is not pickled: Ray (or whatever "
                "pickles it) would keep the secret with what it sends. Hand a Ray actor "
                "workers.actors.kafka_secrets.for_actors(kafka) instead: it reads its secrets on its node"
            )
        return super().__reduce__()

    def common(self) -> dict[str, object]:
        # Brokers closing idle connections is routine; librdkafka would log each one.
        conf: dict[str, object] = {
            "bootstrap.servers": self.bootstrap_servers,
            "log.connection.close": False,
            "logger": logging.getLogger(CLIENT_LOGGER),
        }
        conf.update(self.client_settings)
        return conf

    def admin(self) -> dict[str, object]:
        return self.common()

    def producer(self, *, transactional_id: str | None = None, **overrides: object) -> dict[str, object]:
        """Idempotent producer settings; transactional when an id is given."""
        conf = self.common()
        # murmur2 is the Java clients' partitioner: keyed records land where Kafka Streams or a
        # Java producer would put them, which co-partitioning across clients depends on.
        conf.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "compression.type": "lz4",
                "partitioner": "murmur2_random",
            }
        )
        if transactional_id is not None:
            conf["transactional.id"] = transactional_id
        conf.update(overrides)
        return conf

    def consumer(self, group_id: str, *, read_committed: bool = True, **overrides: object) -> dict[str, object]:
        """Manual-commit consumer settings; offsets move only through transactions or explicit commits."""
        conf = self.common()
        conf.update(
            {
                "group.id": group_id,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            }
        )
        conf.update(overrides)
        return conf


def parse_client_settings(pairs: list[str] | tuple[str, ...] | None) -> dict[str, str]:
    """Turn repeated `key=value` command-line settings into a dict, naming a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"client setting: {malformed_setting(pair)}")
        out[key.strip()] = value.strip()
    return out


def read_client_properties(path: str | Path) -> dict[str, str]:
    """librdkafka settings from a `.properties` file (`key=value` lines; `#` and `!` start comments).

    Values are taken verbatim (no Java backslash escapes), as librdkafka tools read such files. An
    error names the file, the line and at most the key, never a value.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Kafka client properties {path}: {getattr(exc, 'strerror', None) or exc}") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"Kafka client properties {path} line {n}: {malformed_setting(line)}")
        out[key.strip()] = value.strip()
    return out


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (0600 from its creation on, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
