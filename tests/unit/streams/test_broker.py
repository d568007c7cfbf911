"""The local broker's bookkeeping without a broker: only its own processes are signalled, an
interrupted start leaves no JVM behind, pid records go when the broker does, and a start on
formatted storage resumes it on its old ports (or says why it cannot)."""

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import streams.broker
from streams.broker import BrokerConfig, BrokerError, read_handle, start_broker, stop_broker
from streams.jars import jars_dir
from streams.kraft_dir import server_properties, write_node_files
from streams.pids import PID_DIR_ENV, pid_alive, reap, record_pid


def _sleeper(*args: str) -> subprocess.Popen:
    """A process whose command line carries `args`, once it does: between fork and exec it still shows
    the parent's, and a loaded machine widens that window enough for a check to read it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])
    deadline = time.monotonic() + 30
    while b"time.sleep(120)" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the sleeper never exec'd"
        time.sleep(0.01)
    return proc


def _recorded(data_dir, proc) -> None:
    (data_dir / "broker.pid").write_text(f"{proc.pid}\n")
    (data_dir / "bootstrap.servers").write_text("127.0.0.1:1\n")
    record_pid("kafka-broker", proc.pid)


@pytest.fixture
def pid_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(PID_DIR_ENV, str(tmp_path / "pids"))
    return tmp_path / "pids"


def test_a_recorded_pid_that_is_no_broker_any_more_is_never_signalled(tmp_path, pid_dir):
    other = _sleeper()  # the pid was reused by something else
    try:
        _recorded(tmp_path, other)
        assert read_handle(tmp_path) is None
        assert stop_broker(tmp_path, timeout_s=5) is False
        time.sleep(0.2)
        assert other.poll() is None  # untouched
        assert not (tmp_path / "broker.pid").exists() and list(pid_dir.iterdir()) == []
    finally:
        other.kill()
        other.wait()


def test_a_recorded_broker_is_stopped_and_its_pid_record_removed(tmp_path, pid_dir):
    broker = _sleeper("kafka.Kafka", str(tmp_path / "server.properties"))
    try:
        _recorded(tmp_path, broker)
        assert read_handle(tmp_path).pid == broker.pid
        assert stop_broker(tmp_path, timeout_s=5) is True
        assert not pid_alive(broker.pid)  # stop_broker reaped it too
        assert not (tmp_path / "broker.pid").exists() and list(pid_dir.iterdir()) == []
    finally:
        broker.kill()
        broker.wait()


def _fake_java(tmp_path, pids) -> BrokerConfig:
    """A 'java' that reports 17, formats storage at once and, as the broker, never answers."""
    java = tmp_path / "java"
    java.write_text(
        f"#!{sys.executable}\n"
        "import sys, time, os\n"
        "if '-version' in sys.argv: sys.exit(print('openjdk version \"17.0.9\"', file=sys.stderr))\n"
        f"if 'kafka.tools.StorageTool' in sys.argv: sys.exit(open({str(pids) + '.formats'!r}, 'a').write('f\\n') * 0)\n"
        f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(120)\n"
    )
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    cache = tmp_path / "cache"
    libs = jars_dir(cache)
    libs.mkdir(parents=True)
    (libs / ".complete").write_text("ok\n")
    return BrokerConfig(data_dir=tmp_path / "data", cache_dir=cache, java=str(java), start_timeout_s=60)


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, TimeoutError])
def test_an_interrupted_start_stops_the_jvm_it_launched(tmp_path, pid_dir, monkeypatch, interruption):
    launched = tmp_path / "launched"
    config = _fake_java(tmp_path, launched)

    def interrupted(bootstrap, timeout_s=2.0, settings=None):
        while not launched.exists():  # the 'JVM' runs
            time.sleep(0.05)
        raise interruption()

    monkeypatch.setattr(streams.broker, "broker_answers", interrupted)
    with pytest.raises(interruption):
        start_broker(config, log=lambda m: None)
    pid = int(launched.read_text())
    reap(pid)
    assert not pid_alive(pid)
    assert read_handle(config.data_dir) is None and not (config.data_dir / "broker.pid").exists()
    assert list(pid_dir.iterdir()) == []


def test_a_start_that_times_out_stops_the_jvm_and_says_so(tmp_path, pid_dir, monkeypatch):
    launched = tmp_path / "launched"
    config = _fake_java(tmp_path, launched)
    config = BrokerConfig(**{**config.__dict__, "start_timeout_s": 1.0, "stop_timeout_s": 5.0})
    with pytest.raises(BrokerError, match="did not answer metadata requests within 1s"):
        start_broker(config, log=lambda m: None)
    pid = int(launched.read_text())
    reap(pid)
    assert not pid_alive(pid) and list(pid_dir.iterdir()) == []


def test_not_being_allowed_to_signal_the_broker_is_a_broker_error(tmp_path, monkeypatch):
    broker = _sleeper("kafka.Kafka")
    try:
        _recorded(tmp_path, broker)

        real_kill = os.kill

        def refuse(pid, sig):
            if sig != 0:
                raise PermissionError(1, "Operation not permitted")
            return real_kill(pid, sig)

        monkeypatch.setattr(os, "kill", refuse)  # as for a broker of another user
        with pytest.raises(BrokerError, match=f"not allowed to stop the broker .*pid {broker.pid}"):
            stop_broker(tmp_path, timeout_s=1)
    finally:
        monkeypatch.undo()
        broker.kill()
        broker.wait()


def _stored(config: BrokerConfig, port: int, controller_port: int) -> None:
    """The data directory of a broker that ran on these ports and was stopped."""
    data = config.data_dir.resolve()
    write_node_files(data, server_properties(data, port, controller_port))
    (data / "kraft-logs").mkdir()
    (data / "kraft-logs" / "meta.properties").write_text("cluster.id=kept\nnode.id=1\nversion=1\n")


def _interrupt_once_launched(monkeypatch, launched) -> None:
    def interrupted(bootstrap, timeout_s=2.0, settings=None):
        while not launched.exists():
            time.sleep(0.05)
        raise KeyboardInterrupt()

    monkeypatch.setattr(streams.broker, "broker_answers", interrupted)


def test_a_start_on_formatted_storage_resumes_it_on_its_ports_and_fresh_formats_anew(tmp_path, pid_dir, monkeypatch):
    launched = tmp_path / "launched"
    config = _fake_java(tmp_path, launched)
    port = streams.broker.free_port()
    _stored(config, port, streams.broker.free_port())
    _interrupt_once_launched(monkeypatch, launched)
    with pytest.raises(KeyboardInterrupt):
        start_broker(config, log=lambda m: None)
    props = (config.data_dir / "server.properties").read_text()
    assert f"PLAINTEXT://127.0.0.1:{port}," in props  # the same port as before
    assert not (tmp_path / "launched.formats").exists()  # not formatted again
    assert (config.data_dir / "kraft-logs" / "meta.properties").exists()

    launched.unlink()
    fresh = BrokerConfig(**{**config.__dict__, "fresh": True})
    with pytest.raises(KeyboardInterrupt):
        start_broker(fresh, log=lambda m: None)
    assert (tmp_path / "launched.formats").read_text() == "f\n"  # wiped, then formatted
    assert not (config.data_dir / "kraft-logs").exists()  # (the fake format tool writes nothing)


def test_a_resume_whose_port_is_taken_says_so_and_launches_nothing(tmp_path, pid_dir):
    launched = tmp_path / "launched"
    config = _fake_java(tmp_path, launched)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _stored(config, port, streams.broker.free_port())
        taken = (
            f"port {port} on 127.0.0.1 is in use .*the Kafka storage in .* was started on it; free it, or pass --fresh"
        )
        with pytest.raises(BrokerError, match=taken):
            start_broker(config, log=lambda m: None)
    assert not launched.exists()


def test_a_resume_on_another_port_than_its_storage_is_refused(tmp_path, pid_dir):
    config = _fake_java(tmp_path, tmp_path / "launched")
    _stored(config, 9101, 9102)
    other = BrokerConfig(**{**config.__dict__, "port": 9200})
    with pytest.raises(BrokerError, match="was started on port 9101, not 9200; omit the port to resume it"):
        start_broker(other, log=lambda m: None)
