"""Broker lifecycle: start, status, stop with nothing left behind, and a port already in use."""

import socket
import subprocess

import pytest

from streams.broker import BrokerConfig, BrokerError, broker_status, start_broker, stop_broker


def _java_pids_for(data_dir) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"{data_dir}/server.properties"], capture_output=True, text=True)
    return out.stdout.split()


def test_start_status_stop_leaves_no_java_process(tmp_path):
    handle = start_broker(BrokerConfig(data_dir=tmp_path))
    try:
        status = broker_status(tmp_path)
        assert status.running and status.ready
        assert status.bootstrap_servers == handle.bootstrap_servers
        assert _java_pids_for(tmp_path) == [str(handle.pid)]
    finally:
        assert stop_broker(tmp_path) is True
    assert _java_pids_for(tmp_path) == []
    assert broker_status(tmp_path).running is False
    assert stop_broker(tmp_path) is False


def test_port_in_use_fails_with_clear_message(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} on 127.0.0.1 is in use"):
            start_broker(BrokerConfig(data_dir=tmp_path, port=port))
    assert _java_pids_for(tmp_path) == []
