"""`--kafka-config FILE` (librdkafka properties) on every Kafka verb: precedence, and secrets kept off argv."""

import pytest
from click.testing import CliRunner

import streams.admin
import workers.reassembler.run
from streams.tq import TQConfig
from workers.cli.main import cli, main
from workers.reassembler.run import child_process

SECRET = "hunter2-props"


@pytest.fixture
def props(tmp_path):
    path = tmp_path / "client.properties"
    path.write_text(
        "# written by rlstream broker user add\n"
        "bootstrap.servers=props:9093\n"
        "security.protocol=SASL_SSL\n"
        "sasl.mechanisms=SCRAM-SHA-512\n"
        "sasl.username=alice\n"
        f"sasl.password={SECRET}\n"
        "client.id=from-props\n"
    )
    path.chmod(0o600)
    return path


@pytest.fixture
def listed(monkeypatch):
    seen = []
    monkeypatch.setattr(streams.admin, "list_topics", lambda kafka: seen.append(kafka) or {})
    return seen


def _main(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_properties_file_gives_the_cluster_and_its_client_settings(props, listed, capsys, monkeypatch):
    monkeypatch.delenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("RLSTREAM_KAFKA_CLIENT_SETTINGS", raising=False)
    code, out = _main(capsys, "topics", "list", "--kafka-config", str(props))
    assert code == 0, out
    assert listed[0].bootstrap_servers == "props:9093"
    assert listed[0].client_settings == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "alice",
        "sasl.password": SECRET,
        "client.id": "from-props",
    }
    assert SECRET not in out


def test_config_file_then_properties_then_environment_then_flags(props, listed, capsys, monkeypatch, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[kafka]\nbootstrap_servers = 'toml:1'\n[kafka.client_settings]\n"
        "'client.id' = 'toml'\n'linger.ms' = 7\n'sasl.username' = 'toml-user'\n"
    )
    monkeypatch.setenv("RLSTREAM_KAFKA_CLIENT_SETTINGS", '{"sasl.username": "env-user", "acks": "1"}')
    monkeypatch.delenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", raising=False)
    argv = ["topics", "list", "--config", str(toml), "--kafka-config", str(props), "-X", "acks=all"]
    code, out = _main(capsys, *argv)
    assert code == 0, out
    kafka = listed[0]
    assert kafka.bootstrap_servers == "props:9093"  # the properties file is over --config's [kafka]
    settings = kafka.client_settings
    assert (settings["linger.ms"], settings["client.id"]) == ("7", "from-props")  # toml < properties
    assert settings["sasl.username"] == "env-user"  # properties < environment
    assert settings["acks"] == "all"  # environment < -X
    assert settings["sasl.password"] == SECRET

    monkeypatch.setenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    assert _main(capsys, *argv)[0] == 0
    assert listed[1].bootstrap_servers == "env:9092"
    assert _main(capsys, *argv, "--bootstrap-servers", "flag:9092")[0] == 0
    assert listed[2].bootstrap_servers == "flag:9092"


def test_a_malformed_properties_file_is_one_line_without_its_values(tmp_path, capsys):
    bad = tmp_path / "bad.properties"
    bad.write_text(f"bootstrap.servers=b:1\nsasl.password {SECRET}\n")
    code, out = _main(capsys, "topics", "list", "--kafka-config", str(bad))
    assert code != 0 and "line 2" in out and "sasl.password" in out
    assert SECRET not in out and len(out.strip().splitlines()) == 1


def test_the_properties_file_without_an_address_and_none_elsewhere_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", raising=False)
    path = tmp_path / "c.properties"
    path.write_text(f"sasl.password={SECRET}\n")
    code, out = _main(capsys, "demo", "--kafka-config", str(path))
    assert code == 2 and "bootstrap.servers in --kafka-config" in out and SECRET not in out


def test_every_kafka_verb_takes_kafka_config():
    verbs = [
        ["topics", "list"],
        ["topics", "create"],
        ["reassemble"],
        ["demo"],
        ["smoke"],
        ["lag"],
        ["tail", "t"],
        ["replay", "t", "--to", "x"],
        ["inspect", "group", "g"],
        ["deadletter", "redrive"],
        ["refinalize"],
    ]
    for argv in verbs:
        assert "--kafka-config" in CliRunner().invoke(cli, [*argv, "--help"]).output, argv


def test_a_worker_pool_started_from_a_properties_file_keeps_the_password_off_child_argv(props, capsys, monkeypatch):
    pools = []

    def run_pool(kafka, config, tq, workers, **kw):
        pools.append((kafka, config, tq))
        return 0

    monkeypatch.setattr(workers.reassembler.run, "run_pool", run_pool)
    code, out = _main(capsys, "reassemble", "--kafka-config", str(props), "--workers", "2", "--prefix", "p")
    assert code == 0, out
    kafka, config, tq = pools[0]
    assert kafka.client_settings["sasl.password"] == SECRET and SECRET not in out
    argv, document = child_process(kafka, config, TQConfig(address="auto"))
    assert SECRET not in " ".join(argv) and str(props) not in " ".join(argv)
    assert SECRET.encode() in document  # the child gets it on stdin
    assert SECRET not in repr(kafka)
