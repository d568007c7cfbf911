"""Kafka secrets for Ray actors (issue 30, item 10): what an actor is handed carries none; it reads them on its node."""

from __future__ import annotations

import json
import pickle

import pytest
from ray import cloudpickle

from schemas.errors import InvalidArgument
from streams.config import KafkaConfig
from streams.errors import ConfigError
from workers.actors.kafka_secrets import KafkaFiles, NodeKafka, for_actors, kafka_files
from workers.actors.reassembler import DataPlaneConfig, RolloutReassemblerActor
from workers.reassembler.config import ReassemblerConfig, default_actor_config

SECRET = "hunter2-0c5e9f"
KAFKA = KafkaConfig(
    "b:9093",
    {"security.protocol": "SASL_SSL", "sasl.username": "run1", "sasl.password": SECRET, "ssl.key.password": SECRET},
)
ENV = "RLSTREAM_KAFKA_CLIENT_SETTINGS"


def test_what_an_actor_is_handed_has_no_secret_only_the_names_to_read_on_its_node():
    node = for_actors(KAFKA)
    assert node.kafka.client_settings == {"security.protocol": "SASL_SSL", "sasl.username": "run1"}
    assert node.secrets == ("sasl.password", "ssl.key.password")
    for pickled in (pickle.dumps(node), cloudpickle.dumps(node)):  # as Ray serializes arguments
        assert SECRET.encode() not in pickled and b"run1" in pickled


def test_kafka_settings_carrying_a_secret_cannot_be_made_into_what_an_actor_is_handed():
    with pytest.raises(InvalidArgument, match="sasl.password, ssl.key.password") as err:
        NodeKafka(KAFKA)
    assert SECRET not in str(err.value)


def test_the_actor_reads_the_secrets_on_its_node_settings_file_then_properties_then_environment(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(f"[kafka.client_settings]\n'sasl.password' = 'from-toml'\n'ssl.key.password' = '{SECRET}'\n")
    props = tmp_path / "user.properties"
    props.write_text(f"bootstrap.servers=elsewhere:1\nsasl.password={SECRET}\n")
    node = for_actors(KAFKA, kafka_files(props, toml))
    assert node.resolve(env={}).client_settings == KAFKA.client_settings
    env = {ENV: json.dumps({"sasl.password": "from-env"})}
    resolved = node.resolve(env=env)
    assert resolved.client_settings["sasl.password"] == "from-env" and resolved.bootstrap_servers == "b:9093"
    only_env = for_actors(KAFKA).resolve(env={ENV: json.dumps({"sasl.password": "p", "ssl.key.password": "k"})})
    assert only_env.client_settings["ssl.key.password"] == "k"


def test_a_secret_the_node_lacks_is_one_error_naming_it_and_where_it_was_looked_for(tmp_path):
    props = tmp_path / "user.properties"
    props.write_text("sasl.password=only-this-one\n")
    with pytest.raises(ConfigError) as err:
        for_actors(KAFKA, KafkaFiles(properties=str(props))).resolve(env={})
    message = str(err.value)
    assert "ssl.key.password" in message and "sasl.password," not in message
    assert str(props) in message and ENV in message and "only-this-one" not in message


def test_an_actor_refuses_kafka_settings_that_carry_a_secret_and_checks_what_its_node_has(tmp_path):
    actor = RolloutReassemblerActor(DataPlaneConfig(), default_actor_config())
    config = ReassemblerConfig(prefix="t", worker_id="w0")
    with pytest.raises(InvalidArgument, match="Ray records"):
        actor.run_worker(KAFKA, config)
    props = tmp_path / "user.properties"
    props.write_text(f"sasl.password={SECRET}\nssl.key.password={SECRET}\n")
    names = actor.check_kafka(for_actors(KAFKA, kafka_files(props)))
    assert names == sorted(KAFKA.client_settings)


def test_kafka_settings_carrying_a_secret_are_refused_where_ray_would_pickle_them_on_the_caller():
    # Ray pickles an actor's arguments on the caller, into task specs it keeps: refused there, before
    # anything is recorded, whichever method of whichever actor they were passed to.
    for dumps in (pickle.dumps, cloudpickle.dumps):
        with pytest.raises(InvalidArgument, match="sasl.password, ssl.key.password") as err:
            dumps(KAFKA)
        assert SECRET not in str(err.value) and "for_actors" in str(err.value)
        with pytest.raises(InvalidArgument):
            dumps({"nested": [KAFKA]})
    public = for_actors(KAFKA).kafka
    assert pickle.loads(pickle.dumps(public)) == public and cloudpickle.loads(cloudpickle.dumps(public)) == public
