"""docker/k8s/, checked without a cluster.

Core resources against the Kubernetes schemas that kubernetes-validate ships; the Strimzi and KubeRay
custom resources against their CRDs' schemas vendored in crds/ (see crds/README.md). Both strictly:
an unknown field is an error, as it is for `kubectl apply` (field validation `Strict`). Then what
ties the files together and to the code: the topics are `workers/topics.py`'s, the KafkaUser's ACLs
allow what the pipeline does, the reassembler finds Kafka, its credentials and Ray where Strimzi
and KubeRay put them, and its command parses with the rlstream CLI.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from streams.config import KafkaConfig
from streams.kraft_dir import OFFSETS_RETENTION_MINUTES
from streams.settings import load
from tests.unit.docker.cli_args import parse_rlstream
from workers.reassembler.config import ReassemblerConfig
from workers.topics import TopicNames, pipeline_topics

K8S = Path(__file__).resolve().parents[3] / "docker" / "k8s"
CRDS = Path(__file__).resolve().parent / "crds"
NAMESPACE = "rlstream"
PREFIX = "rlstream"  # the topic prefix the manifests run the pipeline under
# Kubernetes versions the core resources are validated against: the oldest the operators' releases
# in docs/CLUSTER.md support, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "latest")
CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "Deployment", "PodDisruptionBudget"}
CUSTOM_KINDS = {"Kafka", "KafkaNodePool", "KafkaTopic", "KafkaUser", "RayCluster"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@cache
def _docs() -> tuple[tuple[str, dict], ...]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    return tuple(out)


def _docs_of(kind: str) -> list[dict]:
    return [copy.deepcopy(doc) for _, doc in _docs() if doc["kind"] == kind]


def _one(kind: str) -> dict:
    (doc,) = _docs_of(kind)
    return doc


def _id(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# --- schemas ---------------------------------------------------------------------------------------


def test_the_manifests_hold_exactly_the_expected_kinds():
    """So a resource of a kind neither check below knows cannot slip through unvalidated."""
    assert {doc["kind"] for _, doc in _docs()} == CORE_KINDS | CUSTOM_KINDS


def test_names_and_namespaces():
    for file, doc in _docs():
        meta = doc["metadata"]
        assert DNS_SUBDOMAIN.match(meta["name"]) and len(meta["name"]) <= 253, (file, meta["name"])
        if doc["kind"] != "Namespace":
            assert meta.get("namespace") == NAMESPACE, (file, meta["name"])


def _kv():
    return pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate is in the dev extra")


def _k8s_validate(doc: dict, version: str) -> None:
    kv = _kv()
    if version == "latest":
        version = str(kv.latest_version())
    kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in _docs() if d["kind"] in CORE_KINDS], ids=_id)
def test_core_resources_match_the_kubernetes_schemas(doc, version):
    _k8s_validate(doc, version)


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda d: d["spec"].update(replicas="four"), id="wrong-type"),
        pytest.param(lambda d: _container(d).update(imagePulPolicy="Always"), id="typo"),
        pytest.param(lambda d: _container(d).pop("name"), id="missing-name"),
    ],
)
def test_the_core_check_rejects_a_broken_deployment(breakage):
    kv = _kv()
    doc = _one("Deployment")
    breakage(doc)
    with pytest.raises(kv.ValidationError):
        _k8s_validate(doc, "latest")


def _strict(schema: dict) -> dict:
    """An OpenAPI v3 structural schema as JSON Schema, with unknown fields refused where the API server prunes them."""
    out = dict(schema)
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if isinstance(out.get("not"), dict):
        out["not"] = _strict(out["not"])
    return out


@cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    group, version = api_version.split("/")
    path = CRDS / f"{kind.lower()}-{group.split('.')[0]}-{version}.json"
    assert path.exists(), f"no vendored CRD schema for {api_version} {kind} (expected {path.name})"
    crd = json.loads(path.read_text())
    assert (crd["group"], crd["kind"], crd["version"]) == (group, kind, version)
    schema = _strict(crd["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _crd_validate(doc: dict) -> None:
    validator = _crd_validator(doc["apiVersion"], doc["kind"])
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        raise AssertionError(
            "\n".join(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}" for e in errors)
        )


@pytest.mark.parametrize("doc", [d for _, d in _docs() if d["kind"] in CUSTOM_KINDS], ids=_id)
def test_custom_resources_match_their_crd_schemas(doc):
    _crd_validate(doc)


@pytest.mark.parametrize(
    ("kind", "breakage"),
    [
        pytest.param(
            "KafkaUser",
            lambda d: d["spec"]["authorization"]["acls"][0]["resource"].update(type="topics"),
            id="acl-resource-type",
        ),  # fmt: skip
        pytest.param(
            "KafkaUser",
            lambda d: d["spec"]["authorization"]["acls"][2]["operations"].append("Commit"),
            id="acl-operation",
        ),  # fmt: skip
        pytest.param("KafkaUser", lambda d: d["spec"]["authentication"].update(type="scram-sha-256"), id="auth-type"),
        pytest.param("KafkaTopic", lambda d: d["spec"].update(partition=12), id="unknown-field"),
        pytest.param("Kafka", lambda d: d["spec"]["kafka"]["listeners"][0].update(type="interal"), id="listener-type"),
        pytest.param("KafkaNodePool", lambda d: d["spec"].update(roles=["broker", "zookeeper"]), id="node-role"),
        pytest.param(
            "RayCluster",
            lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePulPolicy="Always"),
            id="pod-template-typo",
        ),
        pytest.param("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="0"), id="wrong-type"),
    ],
)
def test_the_crd_check_rejects_a_broken_resource(kind, breakage):
    doc = _docs_of(kind)[0]
    _crd_validate(doc)
    breakage(doc)
    with pytest.raises(AssertionError):
        _crd_validate(doc)


# --- what ties the manifests together -------------------------------------------------------------


def _kafka() -> dict:
    return _one("Kafka")


def _tls_listener() -> dict:
    (listener,) = [x for x in _kafka()["spec"]["kafka"]["listeners"] if x["tls"]]
    return listener


def test_kafka_is_kraft_on_three_nodes_with_scram_tls_and_acls():
    kafka = _kafka()
    pools = _docs_of("KafkaNodePool")
    for doc in [*pools, *_docs_of("KafkaTopic"), *_docs_of("KafkaUser")]:
        assert doc["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"], _id(doc)
    roles = {role for pool in pools for role in pool["spec"]["roles"]}
    assert roles == {"controller", "broker"}
    assert sum(p["spec"]["replicas"] for p in pools if "broker" in p["spec"]["roles"]) >= 3
    assert sum(p["spec"]["replicas"] for p in pools if "controller" in p["spec"]["roles"]) % 2 == 1
    assert [x for x in kafka["spec"]["kafka"]["listeners"] if not x["tls"]] == [], "no plaintext listener"
    assert _tls_listener()["authentication"]["type"] == "scram-sha-512"
    assert kafka["spec"]["kafka"]["authorization"]["type"] == "simple"
    config = kafka["spec"]["kafka"]["config"]
    assert config["min.insync.replicas"] == 2 and config["default.replication.factor"] == 3
    assert config["transaction.state.log.min.isr"] == 2 and config["transaction.state.log.replication.factor"] == 3
    assert config["auto.create.topics.enable"] is False
    assert config["offsets.retention.minutes"] == OFFSETS_RETENTION_MINUTES  # as long as the records (issue 30)


def test_the_topics_are_the_pipelines():
    topics = {t["spec"]["topicName"]: t for t in _docs_of("KafkaTopic")}
    for name, t in topics.items():
        assert t["metadata"]["name"] == name
    partitions = topics[TopicNames(PREFIX).receipts]["spec"]["partitions"]
    expected = pipeline_topics(TopicNames(PREFIX), partitions, replication_factor=3)
    assert sorted(topics) == sorted(s.name for s in expected)
    for spec in expected:
        got = topics[spec.name]["spec"]
        assert (got["partitions"], got["replicas"]) == (spec.partitions, spec.replication_factor), spec.name
        assert {k: str(v) for k, v in got.get("config", {}).items()} == dict(spec.config), spec.name


def _allowed(resource_type: str, name: str, operation: str) -> bool:
    """Whether the KafkaUser's ACLs allow `operation` on the resource (Kafka's semantics, deny rules first)."""

    def matches(acl: dict) -> bool:
        res = acl["resource"]
        if res["type"] != resource_type or not ({operation, "All"} & set(acl["operations"])):
            return False
        if res.get("patternType", "literal") == "prefix":
            return name.startswith(res["name"])
        return res.get("name") in (name, "*")

    acls = _one("KafkaUser")["spec"]["authorization"]["acls"]
    if any(matches(a) for a in acls if a.get("type", "allow") == "deny"):
        return False
    return any(matches(a) for a in acls if a.get("type", "allow") == "allow")


def test_the_user_may_do_what_the_pipeline_does_under_its_prefix_only():
    from streams.consumer import _throwaway_consumer_group

    reassembler = _reassembler_settings()
    for topic in (t["spec"]["topicName"] for t in _docs_of("KafkaTopic")):
        for op in ("Describe", "Read", "Write"):
            assert _allowed("topic", topic, op), (topic, op)
    assert _allowed("topic", TopicNames(PREFIX).replay("incident-1"), "Create"), "`rlstream replay` creates its topic"
    # The reassemblers' group and transactional ids, the trainer's group, and the throwaway groups of
    # the readers (streams/consumer.py, workers/reassembler/changelog.py): under `rlstream` only
    # because the prefix is `rlstream`.
    groups = [reassembler.consumer_group, f"{PREFIX}.trainer", _throwaway_consumer_group(), "rlstream-changelog-0"]
    for group in groups:
        assert _allowed("group", group, "Read"), group
    assert _allowed("transactionalId", reassembler.transactional_id, "Write")
    assert _allowed("transactionalId", reassembler.transactional_id, "Describe")
    # ... and nothing outside the prefix.
    assert not _allowed("topic", "other.rollout.receipts", "Read")
    assert not _allowed("group", "reassemblers", "Read")
    assert not _allowed("transactionalId", "reassemblers.w1", "Write")
    assert not _allowed("cluster", "kafka-cluster", "Alter")


def _container(doc: dict | None = None) -> dict:
    """The reassembler container of `doc` (default: of the Deployment in the manifests)."""
    (container,) = (doc or _one("Deployment"))["spec"]["template"]["spec"]["containers"]
    return container


def _resolved_env(password: str = "Pa55wordFromStrimzi") -> dict[str, str]:
    """The reassembler container's environment as the kubelet would make it (Secret values stubbed)."""
    container = _container()
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        (cm,) = [c for c in _docs_of("ConfigMap") if c["metadata"]["name"] == source["configMapRef"]["name"]]
        env.update(cm["data"])
    user = _one("KafkaUser")["metadata"]["name"]
    for var in container["env"]:
        if "valueFrom" in var:
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"] == {"name": user, "key": "password"}, "Strimzi's Secret of the KafkaUser"
                env[var["name"]] = password
            else:
                assert ref["fieldRef"]["fieldPath"] == "metadata.name"
                env[var["name"]] = "rlstream-reassembler-5d9f7c-abcde"
        else:  # $(VAR) expands variables defined earlier only; an undefined one stays as written
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
    return env


def _reassembler_settings() -> ReassemblerConfig:
    prefix = parse_rlstream(_container()["args"]).params["prefix"]
    return load(ReassemblerConfig, env=_resolved_env(), overrides={"prefix": prefix})


def test_the_reassembler_reaches_kafka_with_the_strimzi_credentials():
    kafka, listener = _kafka(), _tls_listener()
    env = _resolved_env()
    cfg = load(KafkaConfig, env=env)
    assert cfg.bootstrap_servers == f"{kafka['metadata']['name']}-kafka-bootstrap.{NAMESPACE}.svc:{listener['port']}"
    settings = cfg.client_settings
    assert settings["security.protocol"] == "SASL_SSL"
    assert settings["sasl.mechanism"] == listener["authentication"]["type"].upper()
    assert settings["sasl.username"] == _one("KafkaUser")["metadata"]["name"]
    assert settings["sasl.password"] == "Pa55wordFromStrimzi", "the password must be expanded from the Secret"
    assert "Pa55wordFromStrimzi" not in repr(cfg)
    # The CA file lies in a volume holding ca.crt of Strimzi's cluster CA Secret.
    ca = Path(settings["ssl.ca.location"])
    (mount,) = [m for m in _container()["volumeMounts"] if ca.parent == Path(m["mountPath"])]
    (volume,) = [v for v in _one("Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == f"{kafka['metadata']['name']}-cluster-ca-cert"
    assert {"key": "ca.crt", "path": ca.name} in volume["secret"]["items"]


def test_the_password_reaches_no_command_line():
    container = _container()
    assert not any("$(" in str(a) or "password" in str(a).lower() for a in container["args"])
    assert "-X" not in container["args"] and "--kafka-setting" not in container["args"]


def test_the_reassembler_settings():
    settings = _reassembler_settings()
    assert settings.prefix == PREFIX
    assert settings.consumer_group.startswith(f"{PREFIX}.")
    assert settings.transactional_id.startswith(f"{PREFIX}.")
    assert settings.worker_id == "rlstream-reassembler-5d9f7c-abcde", "the pod name: stable across container restarts"


def test_the_reassembler_command_parses_and_finds_ray_and_its_metrics_port():
    container = _container()
    parsed = parse_rlstream(container["args"])
    assert parsed.verb == ("reassemble",)
    assert parsed.params["workers"] == 1, "one worker process per pod: Kubernetes restarts it"
    ray = _one("RayCluster")
    head = f"{ray['metadata']['name']}-head-svc.{NAMESPACE}.svc:6379"  # KubeRay's head Service
    assert parsed.params["ray_address"] == head
    assert _resolved_env()["RAY_HEAD_ADDRESS"] == head, "docker/entrypoint.sh joins Ray here first"
    (port,) = container["ports"]
    assert port["containerPort"] == parsed.params["metrics_port"]
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]


def test_the_raycluster_head_hosts_transferqueue():
    ray = _one("RayCluster")
    head = ray["spec"]["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    assert head["template"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert container["args"] == ["ray-head"] and "command" not in container, "the image's entry point, ray-head mode"
    assert int(head["rayStartParams"]["num-cpus"]) >= 3, "TQ's controller and two storage units take a CPU each"
    images = {container["image"], _container()["image"]}
    images |= {c["image"] for g in ray["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1, "one image, so Ray and Python match on every node"
    assert all(g["replicas"] == 0 for g in ray["spec"]["workerGroupSpecs"])
