"""Settings defined once: defaults, bounds, file < environment < flags, and the child-process transport."""

import json
from typing import Annotated, Literal

import pytest
from msgspec import Meta

from streams import settings
from streams.config import KafkaConfig, is_secret, parse_client_settings
from streams.errors import ConfigError
from streams.pids import PID_DIR_ENV, forget_pid, record_pid
from streams.settings import Settings


class Demo(Settings, frozen=True):
    section = "demo"

    rate: Annotated[float, Meta(gt=0, le=100, description="groups per second")] = 8.0
    workers: Annotated[int, Meta(ge=1, description="how many")] = 2
    mode: Annotated[Literal["a", "b"], Meta(description="which mode")] = "a"
    name: str | None = None


def test_defaults_then_file_then_environment_then_flags():
    assert settings.load(Demo, env={}) == Demo()
    file = {"demo": {"rate": 1.5, "workers": 3}}
    env = {"RLSTREAM_DEMO_WORKERS": "4", "RLSTREAM_OTHER_WORKERS": "9"}
    got = settings.load(Demo, file=file, env=env, overrides={"mode": "b", "rate": None})
    assert (got.rate, got.workers, got.mode) == (1.5, 4, "b")


def test_a_value_out_of_bounds_names_the_field_and_where_it_came_from():
    with pytest.raises(ConfigError, match=r"RLSTREAM_DEMO_RATE.*>\s*0.*\$\.rate"):
        settings.load(Demo, env={"RLSTREAM_DEMO_RATE": "-1"})
    with pytest.raises(ConfigError, match=r"flags.*\$\.mode"):
        settings.load(Demo, env={}, overrides={"mode": "c"})


def test_an_unknown_setting_in_a_file_is_an_error_not_ignored(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[demo]\nrat = 3\n")
    with pytest.raises(ConfigError, match="rat"):
        settings.load(Demo, file=path, env={})


def test_toml_and_json_files_and_a_broken_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[demo]\nworkers = 7\n")
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"demo": {"workers": 5}}))
    assert settings.load(Demo, file=toml, env={}).workers == 7
    assert settings.load(Demo, file=js, env={}).workers == 5
    js.write_text("{not json")
    with pytest.raises(ConfigError, match=r"c\.json: not valid JSON"):
        settings.load(Demo, file=js, env={})
    with pytest.raises(ConfigError, match="missing.toml"):
        settings.load(Demo, file=tmp_path / "missing.toml", env={})


def test_fields_carry_their_doc_default_and_bounds():
    by_name = {f.name: f for f in settings.fields_of(Demo)}
    assert by_name["rate"].doc == "groups per second"
    assert by_name["rate"].default == 8.0
    assert by_name["rate"].bounds == "> 0, <= 100"
    assert by_name["workers"].flag == "--workers"


def test_child_transport_round_trips_secrets_without_printing_them():
    kafka = KafkaConfig("b:9092", {"sasl.password": "hunter2", "security.protocol": "SASL_SSL"})
    assert settings.decode(KafkaConfig, settings.encode(kafka)) == kafka
    assert "hunter2" not in repr(kafka) and "hunter2" not in str(kafka)
    assert "SASL_SSL" in repr(kafka)
    with pytest.raises(ConfigError, match="parent process"):
        settings.decode(KafkaConfig, b'{"bootstrap_servers": ""}')


def test_secret_settings_are_recognised():
    assert is_secret("sasl.password") and is_secret("ssl.key.password") and is_secret("sasl.oauthbearer.client.secret")
    assert not is_secret("ssl.key.location") and not is_secret("security.protocol")


def test_client_settings_parse_and_a_malformed_one_is_named():
    assert parse_client_settings(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="'nope'"):
        parse_client_settings(["nope"])


def test_librdkafka_logs_go_through_python_logging():
    assert KafkaConfig("b:1").common()["logger"].name == "rlstream.kafka"


def test_pid_files_only_when_a_directory_is_configured(tmp_path, monkeypatch):
    monkeypatch.delenv(PID_DIR_ENV, raising=False)
    record_pid("x", 123)
    monkeypatch.setenv(PID_DIR_ENV, str(tmp_path / "pids"))
    record_pid("kafka-broker", 4242)
    assert (tmp_path / "pids" / "kafka-broker-4242.pid").read_text().strip() == "4242"


def test_dict_settings_come_from_the_environment_as_json_merged_over_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[kafka]\nbootstrap_servers = 'f:1'\n[kafka.client_settings]\n"
        "'security.protocol' = 'SASL_SSL'\n'sasl.password' = 'from-file'\n"
    )
    env = {"RLSTREAM_KAFKA_CLIENT_SETTINGS": '{"sasl.password": "from-env", "client.id": "e"}'}
    got = settings.load(KafkaConfig, file=cfg, env=env)
    assert got.client_settings == {"security.protocol": "SASL_SSL", "sasl.password": "from-env", "client.id": "e"}
    # Flags (-X) are merged over both by the same path, key by key.
    got = settings.load(KafkaConfig, file=cfg, env=env, overrides={"client_settings": {"client.id": "flag"}})
    assert got.client_settings == {"security.protocol": "SASL_SSL", "sasl.password": "from-env", "client.id": "flag"}


@pytest.mark.parametrize("value", ['{"sasl.password": hunter2}', '["hunter2"]'])
def test_a_bad_json_setting_in_the_environment_names_the_variable_never_the_value(value):
    with pytest.raises(ConfigError, match="RLSTREAM_KAFKA_CLIENT_SETTINGS") as info:
        settings.load(
            KafkaConfig, env={"RLSTREAM_KAFKA_BOOTSTRAP_SERVERS": "b:1", "RLSTREAM_KAFKA_CLIENT_SETTINGS": value}
        )
    assert "hunter2" not in str(info.value)


def test_numbers_and_booleans_in_client_settings_become_text(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[kafka]\nbootstrap_servers = 'f:1'\n[kafka.client_settings]\n"
        "'linger.ms' = 5\n'enable.ssl.certificate.verification' = false\n'retry.backoff.max.ms' = 1.5\n"
    )
    got = settings.load(KafkaConfig, file=cfg, env={"RLSTREAM_KAFKA_CLIENT_SETTINGS": '{"socket.nagle.disable": true}'})
    assert got.client_settings == {
        "linger.ms": "5",
        "enable.ssl.certificate.verification": "false",
        "retry.backoff.max.ms": "1.5",
        "socket.nagle.disable": "true",
    }


@pytest.mark.parametrize(
    "name",
    [
        "ssl.key.pem",
        "ssl.key.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "https.client.key.pem",
        "ssl.keystore.password",
        "sasl.password",
        "sasl.oauthbearer.client.credentials.client.secret",
        "SASL.PASSWORD",
    ],
)
def test_librdkafkas_secret_settings_and_names_of_their_shape_are_redacted(name):
    assert is_secret(name)
    assert "hunter2" not in repr(KafkaConfig("b:1", {name: "hunter2"}))


@pytest.mark.parametrize(
    "name",
    [
        "ssl.key.location",
        "ssl.keystore.location",
        "sasl.oauthbearer.client.id",
        "security.protocol",
        "client.id",
        "sasl.username",
        # Certificates are public, and where a secret lives is no secret (librdkafka's CONFIGURATION.md).
        "ssl.ca.pem",
        "ssl.certificate.pem",
        "https.ca.pem",
        "sasl.oauthbearer.token.endpoint.url",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.file",
        "sasl.kerberos.keytab",
    ],
)
def test_where_a_secret_is_who_someone_is_or_a_public_certificate_is_not_secret(name):
    assert not is_secret(name)
    assert "hunter2" in repr(KafkaConfig("b:1", {name: "hunter2"}))


@pytest.mark.parametrize("pair", ["=hunter2", " =hunter2", "sasl.password:hunter2"])
def test_a_malformed_client_setting_never_echoes_a_value(pair):
    with pytest.raises(ConfigError) as info:
        parse_client_settings([pair])
    assert "hunter2" not in str(info.value)


def test_a_pid_file_is_removed_when_its_process_is_forgotten(tmp_path, monkeypatch):
    monkeypatch.setenv(PID_DIR_ENV, str(tmp_path / "pids"))
    record_pid("kafka-broker", 4242)
    record_pid("kafka-broker", 4243)
    forget_pid("kafka-broker", 4242)
    forget_pid("kafka-broker", 999)  # never recorded: nothing happens
    assert [p.name for p in (tmp_path / "pids").iterdir()] == ["kafka-broker-4243.pid"]
    monkeypatch.delenv(PID_DIR_ENV)
    forget_pid("kafka-broker", 4243)  # no directory configured: a no-op
    assert (tmp_path / "pids" / "kafka-broker-4243.pid").exists()
