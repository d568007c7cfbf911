"""A pool of worker processes: stop signals reach every child, each exit is reported when it
happens, stragglers are killed, and children do not outlive the process that started them."""

import signal
import subprocess
import sys
import threading
import time

import pytest

import workers.reassembler.run as run
from streams.config import KafkaConfig
from streams.pids import die_with_parent, pid_alive
from streams.tq import TQConfig
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import exit_status, run_pool

KAFKA = KafkaConfig("b:1")
CONFIG = ReassemblerConfig(worker_id="w")
TQ = TQConfig(address="10.0.0.1:6379")
# Each child learns its worker id from the document on stdin, then does what its id says.
CHILD = (
    "import json, os, signal, sys, time\n"
    "worker = json.loads(sys.stdin.buffer.read())['reassembler']['worker_id']\n"
    "{body}\n"
)


@pytest.fixture
def sigterm_outside_the_pool():
    """SIGTERMs this test process gets while no pool handler is in place (instead of dying of them)."""
    got = []
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append("outside the pool"))
    yield got
    signal.signal(signal.SIGTERM, previous)


def _children(monkeypatch, body: str) -> None:
    monkeypatch.setattr(run, "CHILD_ARGS", ("-c", CHILD.format(body=body)))


def test_a_child_that_dies_is_reported_at_once_and_a_signal_death_is_128_plus_n(monkeypatch, sigterm_outside_the_pool):
    _children(monkeypatch, "if worker == 'w-0': sys.exit(3)\ntime.sleep(20)")
    lines = []

    def log(line):
        lines.append(line)
        if " died " in line:  # only now stop the pool: w-1 must still be running
            signal.raise_signal(signal.SIGTERM)

    started = time.monotonic()
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=log) == 3
    assert time.monotonic() - started < 15
    assert any(line.startswith("[w-0] worker process") and line.endswith("died with exit code 3") for line in lines)
    assert any(
        line.startswith("[w-1] worker process") and line.endswith("stopped with exit code 143") for line in lines
    )
    assert sigterm_outside_the_pool == []


def test_a_stop_during_startup_reaches_every_child(monkeypatch, sigterm_outside_the_pool):
    # The first child stops its parent at once, while the second one is still being started.
    _children(monkeypatch, "if worker == 'w-0': os.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(20)")
    spawn = run.spawn_worker

    def slow_spawn(*args, **kwargs):
        proc = spawn(*args, **kwargs)
        time.sleep(1.0)
        return proc

    monkeypatch.setattr(run, "spawn_worker", slow_spawn)
    started = time.monotonic()
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=lambda _: None) == 0
    assert time.monotonic() - started < 15
    assert sigterm_outside_the_pool == []


def test_children_still_running_after_the_grace_period_are_killed(monkeypatch, sigterm_outside_the_pool):
    _children(monkeypatch, "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(20)")
    lines = []
    stop = threading.Timer(1.0, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM))
    stop.start()
    started = time.monotonic()
    try:
        assert run_pool(KAFKA, CONFIG, TQ, 1, log=lines.append, stop_grace_s=1.0) == 137
    finally:
        stop.cancel()
    assert time.monotonic() - started < 15
    assert any("killing 1 worker process(es)" in line for line in lines)
    assert lines[-1].startswith("[w-0] worker process") and lines[-1].endswith("exit code 137")


def test_pool_children_are_set_to_die_with_their_parent(monkeypatch):
    seen = []
    monkeypatch.setattr(run, "spawn_worker", lambda *a, **kw: seen.append(kw) or subprocess.Popen(["true"]))
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=lambda _: None) == 0
    assert [kw.get("preexec_fn") for kw in seen] == [die_with_parent, die_with_parent]


def test_a_child_set_to_die_with_its_parent_gets_sigterm_when_the_parent_goes():
    # PR_SET_PDEATHSIG fires when the thread that started the child ends: a thread stands in for the parent.
    procs = []
    starter = threading.Thread(
        target=lambda: procs.append(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=die_with_parent)
        )
    )
    starter.start()
    starter.join()
    try:
        assert procs[0].wait(timeout=10) == -signal.SIGTERM
    finally:
        procs[0].kill()
        procs[0].wait()
    assert not pid_alive(procs[0].pid)


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 3), (-15, 143), (-9, 137), (-2, 130)])
def test_exit_status_is_what_a_shell_reports(returncode, status):
    assert exit_status(returncode) == status
