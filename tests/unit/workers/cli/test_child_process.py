"""A worker child process gets its settings whole on stdin, never on its command line."""

import io
import subprocess
import sys

import pytest

import workers.reassembler.run
from streams.config import KafkaConfig
from streams.tq import TQConfig
from workers.cli.main import main
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import WorkerSpec, child_process, read_spec, spawn_worker

KAFKA = KafkaConfig(
    "broker-a:9093,broker-b:9093",
    {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "hunter2"},
)
CONFIG = ReassemblerConfig(
    prefix="run7",
    worker_id="w-1",
    consumer_group="reassemblers.run7",
    input_topic="run7.replay.x",
    group_timeout_s=12.5,
    max_open_groups=4321,
    max_poll_records=77,
    session_timeout_ms=9000,
    clear_staging=False,
)
TQ = TQConfig(address="10.0.0.1:6379", num_storage_units=3)


def test_the_argv_holds_no_setting_and_the_document_round_trips():
    argv, document = child_process(KAFKA, CONFIG, TQ, metrics_port=9100, log_json=True)
    assert argv == [sys.executable, "-m", "workers.cli.main", "reassemble", "--config-stdin"]
    line = " ".join(argv)
    for value in ("hunter2", "broker-a", "run7", "w-1", "4321", "12.5", "10.0.0.1", "9100"):
        assert value not in line
    spec = read_spec(document)
    assert spec == WorkerSpec(KAFKA, CONFIG, TQ, metrics_port=9100, log_json=True)
    assert spec.kafka.client_settings["sasl.password"] == "hunter2"
    assert "hunter2" not in repr(spec.kafka)


def test_a_spawned_child_reads_exactly_the_document_on_stdin():
    # The child echoes its stdin and argv instead of running a worker.
    echo = "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()); print(sys.argv, file=sys.stderr)"
    proc = spawn_worker(KAFKA, CONFIG, TQ, args=("-c", echo), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert read_spec(out) == WorkerSpec(KAFKA, CONFIG, TQ)
    assert b"hunter2" not in err


def test_the_child_verb_runs_the_worker_with_the_parents_settings(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(
        workers.reassembler.run, "run_worker", lambda kafka, config, tq, **kw: calls.append((kafka, config, tq))
    )
    _, document = child_process(KAFKA, CONFIG, TQ)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(document)))
    assert main(["reassemble", "--config-stdin"]) == 0, capsys.readouterr().err
    assert calls == [(KAFKA, CONFIG, TQ)]
    assert "hunter2" not in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--consumer-group", "g"], ["--bootstrap-servers", "b:1"]])
def test_the_child_verb_takes_no_other_flag(monkeypatch, capsys, extra):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(child_process(KAFKA, CONFIG, TQ)[1])))
    assert main(["reassemble", "--config-stdin", *extra]) == 2
    assert "--config-stdin takes its settings from stdin only" in capsys.readouterr().err


def test_a_garbled_document_is_a_config_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"kafka": {}}')))
    assert main(["reassemble", "--config-stdin"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlstream reassemble: worker settings from the parent process on stdin:")


def test_a_pool_hands_each_child_its_own_worker_id_and_metrics_port(monkeypatch, capfd):
    from workers.reassembler.run import run_pool

    show = (
        "import sys, json; d = json.loads(sys.stdin.buffer.read()); "
        "print(d['reassembler']['worker_id'], d['metrics_port'], d['kafka']['client_settings']['sasl.password'])"
    )
    monkeypatch.setattr(workers.reassembler.run, "CHILD_ARGS", ("-c", show))
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=lambda _: None, metrics_port=9100) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["w-1-0 9100 hunter2", "w-1-1 9101 hunter2"]


def test_a_child_logs_at_debug_level_when_its_parent_was_asked_to(monkeypatch, capsys):
    import logging

    monkeypatch.setattr(workers.reassembler.run, "run_worker", lambda *a, **kw: None)
    for debug, level in ((True, logging.DEBUG), (False, logging.INFO)):
        _, document = child_process(KAFKA, CONFIG, TQ, debug=debug)
        assert read_spec(document).debug is debug
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(document)))
        assert main(["reassemble", "--config-stdin"]) == 0, capsys.readouterr().err
        assert logging.getLogger("rlstream").level == level
