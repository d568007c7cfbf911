"""A secured local broker (SASL_SSL, SCRAM-SHA-512, StandardAuthorizer): who gets in and what ACLs allow.

One broker for the module, started with `security="sasl_ssl"`; a pipeline user is created with
prefixed ACLs the way `rlstream broker user add` does, and its client settings are read back from
the properties file it gets, as `--kafka-config` reads them.
"""

from __future__ import annotations

import gc
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from streams import security
from streams.admin import TopicSpec, create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.errors import TopicError
from streams.tq import TRAIN
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from workers.cli.options import resolve_kafka
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker

PREFIX = f"sec{uuid.uuid4().hex[:6]}"
USER = "pipeline"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    data_dir = Path(tmp_path_factory.mktemp("kafka-sasl"))
    with LocalBroker(BrokerConfig(data_dir=data_dir, security=security.SASL_SSL)) as b:
        yield b
        gc.collect()  # clients in reference cycles go while the broker can still answer them


@pytest.fixture(scope="module")
def admin(secured) -> KafkaConfig:
    return KafkaConfig(secured.bootstrap_servers, secured.client_settings())


@pytest.fixture(scope="module")
def user_file(secured, admin) -> Path:
    """A user allowed topics, groups and transactional ids under PREFIX only: its properties file."""
    files = security.SecurityFiles.of(secured.handle.data_dir)
    password = security.new_password()
    security.add_user(admin, USER, password, security.Grant((PREFIX,), (PREFIX,), (PREFIX,)))
    settings = security.client_settings(files, USER, password)
    return security.write_client_file(files.user_client(USER), admin.bootstrap_servers, settings, about="test")


@pytest.fixture(scope="module")
def user(user_file) -> KafkaConfig:
    return resolve_kafka(None, (), None, required=True, kafka_config=user_file)


def _refusal(conf: dict, timeout_s: float = 20.0) -> KafkaError:
    """The first error a client with `conf` reports; it must also fail a metadata request."""
    seen: list[KafkaError] = []
    client = AdminClient({**conf, "error_cb": seen.append, "socket.connection.setup.timeout.ms": 2000})
    deadline = time.monotonic() + timeout_s
    while not seen and time.monotonic() < deadline:
        client.poll(0.2)
    assert seen, f"no error reported within {timeout_s:.0f}s"
    with pytest.raises(KafkaException):
        client.list_topics(timeout=1)
    return seen[0]


def test_the_broker_refuses_clients_without_valid_credentials(secured, admin, user):
    address = secured.bootstrap_servers
    # Plaintext, and TLS without a login: the listener speaks SASL over TLS only.
    tls_only = {"security.protocol": "SSL", "ssl.ca.location": admin.client_settings["ssl.ca.location"]}
    for conf in ({}, tls_only):
        error = _refusal({"bootstrap.servers": address, **conf})
        assert error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._SSL), error
    error = _refusal({**user.admin(), "sasl.password": "not-the-password"})
    assert error.code() == KafkaError._AUTHENTICATION, error
    # With the right password the same settings get in: the refusals above are about credentials.
    assert AdminClient(user.admin()).list_topics(timeout=30).brokers
    assert AdminClient(admin.admin()).list_topics(timeout=30).brokers
    # The admin password is in 0600 files only, not in the broker's log.
    files = security.SecurityFiles.of(secured.handle.data_dir)
    assert admin.client_settings["sasl.password"] not in secured.handle.log_path.read_text(errors="replace")
    for path in (files.admin_client, files.secrets, files.keystore, secured.handle.data_dir / "server.properties"):
        assert path.stat().st_mode & 0o077 == 0, path


def test_acls_bound_a_user_to_its_prefixes(user):
    create_topics(user, [TopicSpec(f"{PREFIX}.own", 1)])
    with pytest.raises(TopicError, match="[Aa]uthoriz"):
        create_topics(user, [TopicSpec(f"other{PREFIX}.topic", 1)])
    allowed = Producer(user.producer(transactional_id=f"{PREFIX}.tx"))
    allowed.init_transactions(60)
    refused = Producer(user.producer(transactional_id=f"other.{PREFIX}.tx"))
    with pytest.raises(KafkaException) as info:
        refused.init_transactions(60)
    assert info.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED


def test_a_reassembler_finalizes_groups_as_a_user_bound_by_prefixed_acls(user, tq_store):
    names = setup_topics(user, PREFIX, partitions=1)
    groups = publish_groups(user, tq_store, names, 4, prefix=f"{PREFIX}-g")
    config = ReassemblerConfig(prefix=PREFIX, worker_id="w0", consumer_group=f"{PREFIX}.reassemblers")
    worker = ReassemblerWorker(user, tq_store, config)
    try:
        drive([worker], lambda: len(finalized_records(user, names)) >= len(groups), timeout_s=120)
    finally:
        worker.close()
    assert sorted(r.group_id for r in finalized_records(user, names)) == sorted(groups)
    tq_store.clear(TRAIN, [f"{gid}_g{i}" for gid in groups for i in range(8)])


class _Recording:
    """`real` (a module or class) with every `dumps` it makes noted in `made`."""

    def __init__(self, real, made: list[bytes]):
        self._real, self._made = real, made

    def __getattr__(self, name):
        return getattr(self._real, name)

    def dumps(self, *args, **kwargs):
        data = self._real.dumps(*args, **kwargs)
        self._made.append(bytes(data))
        return data


class _Serialized:
    """Everything Ray serializes in this process while installed. `ray._private.serialization` packs each
    argument of a task or actor creation, and each `ray.put`, with msgpack (`MessagePackSerializer.dumps`:
    str, bytes, numbers, lists and dicts of them, as they are) and pickles what msgpack cannot take
    (its module's `pickle.dumps`, pickle5): both are noted. A probe put through each shows the hooks
    see what they claim to."""

    def __init__(self, monkeypatch):
        import ray
        from ray._private import serialization

        self.made: list[bytes] = []
        monkeypatch.setattr(serialization, "pickle", _Recording(serialization.pickle, self.made))
        monkeypatch.setattr(
            serialization, "MessagePackSerializer", _Recording(serialization.MessagePackSerializer, self.made)
        )
        marker = uuid.uuid4().hex
        ray.get(ray.put({"msgpack-probe": marker}))  # a dict of str: msgpack only
        ray.get(ray.put(KafkaConfig(f"pickle-probe-{marker}:1")))  # an object: pickled
        assert b"msgpack-probe" in self.all() and f"pickle-probe-{marker}".encode() in self.all()

    def all(self) -> bytes:
        return b"".join(self.made)


def test_a_reassembler_ray_actor_reads_its_password_on_its_node_and_ray_never_carries_it(
    user, user_file, tq_store, monkeypatch
):
    import ray

    from workers.actors.kafka_secrets import for_actors, kafka_files
    from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors, start_worker
    from workers.reassembler.config import default_actor_config

    password = user.client_settings["sasl.password"]
    prefix = f"{PREFIX}a"
    names = setup_topics(user, prefix, partitions=1)
    groups = publish_groups(user, tq_store, names, 3, prefix=f"{prefix}-g")
    serialized = _Serialized(monkeypatch)
    (actor,) = create_rollout_reassembler_actors(DataPlaneConfig(), default_actor_config(), num_workers=1)
    try:
        files = kafka_files(user_file)  # the same path on every node: here, one node
        assert "sasl.password" in ray.get(actor.check_kafka.remote(for_actors(user, files)), timeout=60)
        config = ReassemblerConfig(prefix=prefix, worker_id="a0", consumer_group=f"{prefix}.reassemblers")
        # Handed the KafkaConfig with its password: refused on the caller, where Ray would pickle it.
        with pytest.raises(Exception) as refused:
            actor.run_worker.remote(user, config)
        chain = f"{refused.value} {refused.value.__cause__}"
        assert "sasl.password" in chain and "is not pickled" in chain and password not in chain
        run = start_worker(actor, user, config, files)
        wait = time.monotonic() + 120
        while len(finalized_records(user, names)) < len(groups):
            assert time.monotonic() < wait, "the actor finalized nothing as the user"
            time.sleep(0.5)
        actor.stop_worker.remote()
        assert ray.get(run, timeout=60)["finalized"] == len(groups)
    finally:
        ray.kill(actor)
    # What Ray serialized for the actor's creation and its calls: the user's name and address, never the password.
    made = serialized.all()
    assert user.bootstrap_servers.encode() in made and b"sasl.username" in made
    assert password.encode() not in made
    assert sorted(r.group_id for r in finalized_records(user, names)) == sorted(groups)
    tq_store.clear(TRAIN, [f"{gid}_g{i}" for gid in groups for i in range(8)])


class VerlLikeWorker:
    """Built as verl builds its TaskRunner and agent-loop workers: from verl's whole config, whose
    `sampler_kwargs.rlstream` holds rlstream's Kafka settings; lists the run's topics as the user."""

    def __init__(self, config):
        from workers.adapters.verl_rollout import rollout_options
        from workers.adapters.verl_settings import kafka_from_options

        self._kafka = kafka_from_options(rollout_options(config))

    def topics(self, prefix: str) -> list[str]:
        metadata = AdminClient(self._kafka.admin()).list_topics(timeout=30)
        return sorted(t for t in metadata.topics if t.startswith(prefix))


def test_verls_rlstream_settings_reach_a_ray_actor_without_the_password_which_it_reads_on_its_node(
    user, user_file, tq_session, monkeypatch
):
    import sys

    import ray
    from omegaconf import OmegaConf
    from ray import cloudpickle

    from streams.config import is_secret

    password = user.client_settings["sasl.password"]
    prefix = f"{PREFIX}v"
    names = setup_topics(user, prefix, partitions=1)
    rlstream = {
        "bootstrap_servers": user.bootstrap_servers,
        "client_settings": {k: v for k, v in user.client_settings.items() if not is_secret(k)},
        "kafka_config": str(user_file),  # the same path on every node: here, one node
    }
    config = OmegaConf.create({"trainer": {"v1": {"sampler": {"sampler_kwargs": {"rlstream": rlstream}}}}})
    serialized = _Serialized(monkeypatch)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's actor class travels with it
    actor = ray.remote(VerlLikeWorker).remote(config)
    try:
        assert names.receipts in ray.get(actor.topics.remote(prefix), timeout=60)  # logged in as the user
    finally:
        ray.kill(actor)
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    made = serialized.all()
    assert user.bootstrap_servers.encode() in made and str(user_file).encode() in made
    assert password.encode() not in made
