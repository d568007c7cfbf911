"""What ``sampler_kwargs.rlstream`` builds: the consumer's defaults in a verl deployment."""

from __future__ import annotations

import json

import pytest

from streams.errors import ConfigError
from tests.unit.memory_store import InMemoryStore
from workers.adapters.verl_rollout import rollout_options
from workers.adapters.verl_settings import consumer_from_options, kafka_from_options
from workers.trainer.policies import ready_first


def test_lost_rows_are_dead_lettered_not_handed_back_unless_the_user_says_so():
    """A hand-back goes to rollout.regenerate, which nothing reads in a verl deployment."""
    options = {"bootstrap_servers": "localhost:1", "prefix": "p"}
    default = consumer_from_options(options, InMemoryStore(), ready_first())
    chosen = consumer_from_options({**options, "hand_back_lost_rows": True}, InMemoryStore(), ready_first())
    try:
        assert default.config.hand_back_lost_rows is False
        assert chosen.config.hand_back_lost_rows is True
    finally:
        default.close()
        chosen.close()


SECRET = "hunter2-verl-7f1"
ENV = "RLSTREAM_KAFKA_CLIENT_SETTINGS"


def _verl_config(**rlstream):
    """verl's full config as its actors get it (an omegaconf DictConfig), with `sampler_kwargs.rlstream`."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"trainer": {"v1": {"sampler": {"sampler_kwargs": {"rlstream": rlstream}}}}})


def test_a_secret_in_verls_config_is_refused_naming_it_and_where_it_goes_instead(monkeypatch):
    # verl hands its whole config to Ray actors (its TaskRunner, the agent-loop workers): Ray would
    # record the password with them.
    monkeypatch.delenv(ENV, raising=False)
    config = _verl_config(
        bootstrap_servers="b:9093", client_settings={"sasl.username": "run1", "sasl.password": SECRET}
    )
    with pytest.raises(ConfigError) as err:
        kafka_from_options(rollout_options(config))
    message = str(err.value)
    assert "sampler_kwargs.rlstream.client_settings" in message and "sasl.password" in message
    assert "kafka_config" in message and ENV in message and SECRET not in message


def test_verls_kafka_settings_take_their_secrets_on_the_node_from_a_properties_file_or_the_environment(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(ENV, raising=False)
    props = tmp_path / "user.properties"
    props.write_text(f"sasl.password={SECRET}\nsasl.username=from-file\n")
    options = {
        "bootstrap_servers": "b:9093",
        "client_settings": {"security.protocol": "SASL_SSL", "sasl.username": "run1"},
        "kafka_config": str(props),
    }
    kafka = kafka_from_options(dict(options))
    # The node's secret, under the settings verl's config names (those win where both say).
    assert kafka.client_settings == {"security.protocol": "SASL_SSL", "sasl.username": "run1", "sasl.password": SECRET}
    monkeypatch.setenv(ENV, json.dumps({"sasl.password": "from-env"}))
    assert kafka_from_options(dict(options)).client_settings["sasl.password"] == "from-env"
    no_file = {k: v for k, v in options.items() if k != "kafka_config"}
    assert kafka_from_options(no_file).client_settings["sasl.password"] == "from-env"


def test_the_replay_buffers_consumer_takes_its_secret_on_the_node_too(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    props = tmp_path / "user.properties"
    props.write_text(f"sasl.password={SECRET}\n")
    options = {"bootstrap_servers": "localhost:1", "prefix": "p", "kafka_config": str(props)}
    consumer = consumer_from_options(options, InMemoryStore(), ready_first())
    try:
        assert consumer._clients.kafka.client_settings == {"sasl.password": SECRET}
    finally:
        consumer.close()
    with pytest.raises(ConfigError, match="sasl.password"):
        consumer_from_options({**options, "client_settings": {"sasl.password": SECRET}}, InMemoryStore(), ready_first())
