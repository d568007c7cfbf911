"""A pool of worker processes: stop signals reach every child, each exit is reported when it
happens, a crashed child starts again under its id after a growing delay (never after a stop),
stragglers are killed, and children do not outlive the process that started them."""

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

import workers.reassembler.run as run
from streams.config import KafkaConfig
from streams.pids import die_with_parent, pid_alive
from streams.tq import TQConfig
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.pool import FENCED_EXIT, Pool, RestartPolicy, exit_status
from workers.reassembler.run import run_pool

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
    # The stop comes before w-0's restart is due: the restart is cancelled, and its exit is the pool's.
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=log, warn=log) == 3
    assert time.monotonic() - started < 15
    assert any(line.startswith("[w-0] worker process") and "died with exit code 3 after" in line for line in lines)
    assert not any("restarted as" in line for line in lines)
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


def test_the_restart_delay_doubles_from_one_second_up_to_thirty():
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.delay(10_000) == 30  # no overflow however long the series
    assert RestartPolicy(initial_s=0.5, max_s=3).delay(4) == 3
    with pytest.raises(ValueError, match="crashes_in_a_row must be >= 1"):
        policy.delay(0)


def _stop_when(lines: list[str], done: Callable[[str], bool]) -> Callable[[str], None]:
    """A log that keeps the lines and stops the pool (SIGTERM to this process) at the line where `done` holds."""

    def log(line: str) -> None:
        lines.append(line)
        if done(line):
            signal.raise_signal(signal.SIGTERM)

    return log


def _stop_once(holds: Callable[[], bool], timeout_s: float = 20.0) -> threading.Thread:
    """SIGTERM to the main thread (the pool) once `holds()`, or after timeout_s."""

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not holds() and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_crashed_child_starts_again_under_its_id_and_a_stable_run_resets_the_schedule(
    monkeypatch, tmp_path, sigterm_outside_the_pool
):
    starts = tmp_path / "starts"
    # w-0 records each start; runs 1 and 2 crash at once, run 3 after a stable 3 s, run 4 stays.
    _children(
        monkeypatch,
        f"open({str(starts)!r}, 'a').write(worker + '\\n')\n"
        f"run = open({str(starts)!r}).read().split().count(worker)\n"
        "if worker == 'w-0' and run <= 2: sys.exit(3)\n"
        "if worker == 'w-0' and run == 3: time.sleep(3.0); os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(20)",
    )
    lines, warnings = [], []
    policy = RestartPolicy(initial_s=0.2, max_s=5.0, stable_s=2.0)
    watcher = _stop_once(lambda: starts.exists() and starts.read_text().split().count("w-0") == 4)
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=lines.append, warn=warnings.append, restart=policy) == 0
    watcher.join()
    assert starts.read_text().split().count("w-0") == 4 and starts.read_text().split().count("w-1") == 1
    assert len(warnings) == 3 and all(w.startswith("[w-0] worker process ") for w in warnings)
    assert "died with exit code 3" in warnings[0] and "restarting it in 0.2s (restart 1)" in warnings[0]
    assert "restarting it in 0.4s (restart 2)" in warnings[1]
    # Killed by a signal nobody forwarded, after a stable run: the schedule starts over.
    assert "died with exit code 137" in warnings[2] and "restarting it in 0.2s (restart 3)" in warnings[2]
    assert sum("restarted as pid" in line for line in lines) == 3
    assert lines[-1] == "worker processes restarted 3 time(s): w-0 3"
    assert sigterm_outside_the_pool == []


def test_a_child_that_keeps_crashing_is_restarted_at_a_bounded_rate_while_its_sibling_runs_on(
    monkeypatch, tmp_path, sigterm_outside_the_pool
):
    starts = tmp_path / "starts"
    _children(
        monkeypatch,
        f"open({str(starts)!r}, 'a').write(worker + '\\n')\nif worker == 'w-0': os._exit(1)\ntime.sleep(20)",
    )
    warnings = []
    stop = threading.Timer(4.0, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM))
    stop.start()
    try:
        code = run_pool(KAFKA, CONFIG, TQ, 2, log=lambda _: None, warn=warnings.append,
                        restart=RestartPolicy(initial_s=0.1, max_s=0.4))  # fmt: skip
    finally:
        stop.cancel()
    delays = [float(w.split("restarting it in ")[1].split("s ")[0]) for w in warnings]
    # 0.1 + 0.2 + 0.4 + 0.4 + ... within 4 s: a handful of restarts (fewer when starts are slow), never a spin.
    assert 3 <= len(delays) <= 12 and delays == [0.1, 0.2] + [0.4] * (len(delays) - 2)
    started = starts.read_text().split()
    # w-0's first start plus each restart done; the stop may find it crashed (restart cancelled) or starting.
    assert started.count("w-1") == 1 and len(delays) <= started.count("w-0") <= len(delays) + 1
    assert code in (0, 1)  # w-0's last exit: its crash, or the forwarded stop it died of while starting
    assert sigterm_outside_the_pool == []


def test_a_stop_never_restarts_a_child_whatever_its_exit(monkeypatch, sigterm_outside_the_pool):
    # On the forwarded SIGTERM the child exits 5, as if its shutdown failed: reported, not restarted.
    _children(monkeypatch, "signal.signal(signal.SIGTERM, lambda *_: os._exit(5))\ntime.sleep(20)")
    lines, warnings = [], []
    stop = threading.Timer(1.0, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM))
    stop.start()
    try:
        assert run_pool(KAFKA, CONFIG, TQ, 2, log=lines.append, warn=warnings.append) == 5
    finally:
        stop.cancel()
    assert warnings == [] and not any("restarted" in line for line in lines)


def test_a_fenced_child_is_not_restarted(monkeypatch, sigterm_outside_the_pool):
    _children(monkeypatch, f"if worker == 'w-0': sys.exit({FENCED_EXIT})\ntime.sleep(20)")
    lines, warnings = [], []
    log = _stop_when(lines, lambda line: "fenced" in line)
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=log, warn=warnings.append) == FENCED_EXIT
    assert warnings == []
    assert any(line.startswith("[w-0]") and "not restarted" in line for line in lines)


def test_the_pool_counts_restarts_per_worker_and_retries_a_failed_spawn():
    calls = []

    def spawn(worker_id):
        calls.append(worker_id)
        if len(calls) == 1:
            raise OSError(11, "Resource temporarily unavailable")
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(0)"])

    warnings = []
    pool = Pool(log=lambda _: None, warn=warnings.append, stop_grace_s=5, poll_s=0.05, spawn=spawn,
                restart=RestartPolicy(initial_s=0.05, max_s=0.1))  # fmt: skip
    pool.add("a", subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"]))
    assert pool.wait() == 0  # crashed, a spawn failed, then the restarted child exited cleanly
    assert calls == ["a", "a"] and pool.restarts == {"a": 1}
    assert "restarting the worker process failed" in warnings[1] and "next try in 0.1s" in warnings[1]


# A child that may be the pool's spare: its document says so, and its worker id comes on the next line.
SPARE_CHILD = (
    "import json, os, signal, sys, time\n"
    "d = json.loads(sys.stdin.buffer.readline())\n"
    "worker = d['reassembler']['worker_id']\n"
    "if d['standby']:\n"
    "    line = sys.stdin.buffer.readline()\n"
    "    if not line.strip(): sys.exit(0)\n"
    "    worker = json.loads(line)['worker_id']\n"
    "open({starts!r}, 'a').write(f\"{{worker}} {{os.getpid()}}\\n\")\n"
    "if worker == 'w-0' and open({starts!r}).read().count('w-0 ') == 1: sys.exit(3)\n"
    "time.sleep(20)\n"
)


def test_a_first_crash_hands_the_worker_id_to_the_warm_spare_at_once(monkeypatch, tmp_path, sigterm_outside_the_pool):
    starts = tmp_path / "starts"
    monkeypatch.setattr(run, "CHILD_ARGS", ("-c", SPARE_CHILD.format(starts=str(starts))))
    lines, warnings = [], []
    # A restart the usual way would wait 30 s: only the spare can be w-0's second run in time.
    policy = RestartPolicy(initial_s=30.0)
    took_over = []

    def log(line):
        lines.append(line)
        if "took over" in line:
            took_over.append(time.monotonic())

    watcher = _stop_once(lambda: len(took_over) == 1 and sum("spare worker process started" in x for x in lines) == 2)
    started = time.monotonic()
    assert run_pool(KAFKA, CONFIG, TQ, 2, log=log, warn=warnings.append, restart=policy, keep_spare=True) == 0
    watcher.join()
    assert took_over and took_over[0] - started < 15, lines
    runs = [line.split() for line in starts.read_text().splitlines()]
    assert [r[0] for r in runs].count("w-0") == 2 and [r[0] for r in runs].count("w-1") == 1
    # The spare's pid is the one that became w-0.
    spare_pid = next(x.split()[-1] for x in lines if x.startswith("spare worker process started as pid"))
    assert [r[1] for r in runs if r[0] == "w-0"][1] == spare_pid
    assert "handing its id to the spare (restart 1)" in warnings[0]
    assert f"[w-0] spare pid {spare_pid} took over (restart 1)" in lines
    assert sigterm_outside_the_pool == []


class FakeProc:
    """A stand-in for a `subprocess.Popen` the pool polls: alive until the test sets its return code."""

    pids = iter(range(1000, 2000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None
        self.stdin = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.returncode = -signum

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def test_the_spare_takes_over_from_each_worker_that_dies_in_turn_not_only_the_first():
    from workers.reassembler.pool import SpareSupply

    spares: list[FakeProc] = []
    promoted: list[tuple[int, str]] = []
    cold: list[str] = []

    def spawn_spare() -> FakeProc:
        spares.append(FakeProc())
        return spares[-1]

    def spawn(worker_id: str) -> FakeProc:
        cold.append(worker_id)
        return FakeProc()

    # A cold restart would wait 30 s: within the deadlines below only the spare can take over.
    pool = Pool(log=lambda _: None, stop_grace_s=1, poll_s=0.01, spawn=spawn, restart=RestartPolicy(initial_s=30.0),
                spares=SpareSupply(spawn_spare, lambda proc, wid: promoted.append((proc.pid, wid))))  # fmt: skip
    first = {"w-0": FakeProc(), "w-1": FakeProc()}
    for worker_id, proc in first.items():
        pool.add(worker_id, proc)
    waiting = threading.Thread(target=pool.wait, daemon=True)
    waiting.start()

    def until(holds: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5
        while not holds():
            assert time.monotonic() < deadline, (promoted, cold, len(spares))
            time.sleep(0.01)

    try:
        until(lambda: len(spares) == 1)
        first["w-0"].returncode = -signal.SIGKILL
        until(lambda: len(promoted) == 1 and len(spares) == 2)  # promoted, and a fresh spare started
        first["w-1"].returncode = -signal.SIGKILL  # another worker, later: the fresh spare takes over again
        until(lambda: len(promoted) == 2 and len(spares) == 3)
    finally:
        pool.forward(signal.SIGTERM)
        waiting.join(timeout=10)
    assert promoted == [(spares[0].pid, "w-0"), (spares[1].pid, "w-1")]
    assert cold == [] and pool.restarts == {"w-0": 1, "w-1": 1}
    assert pool.procs == {"w-0": spares[0], "w-1": spares[1]}


class _Exited:
    """A child process that has exited with `code`, for a pool on a virtual runtime."""

    def __init__(self, pid: int, code: int):
        self.pid, self.returncode = pid, code

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        pass

    def kill(self) -> None:
        pass


def test_a_pool_on_a_virtual_runtime_waits_out_a_restart_delay_in_virtual_time():
    from tests.unit.manual_runtime import ManualRuntime

    runtime = ManualRuntime(0.0)
    restarted_at = []

    def spawn(worker_id):
        restarted_at.append(runtime.now)
        return _Exited(2, 0)

    pool = Pool(log=lambda _: None, warn=lambda _: None, stop_grace_s=5, poll_s=0.5, spawn=spawn,
                restart=RestartPolicy(initial_s=4.0), runtime=runtime)  # fmt: skip
    pool.add("a", _Exited(1, 3))
    started = time.monotonic()
    assert pool.wait() == 0
    assert restarted_at == [4.0] and set(runtime.slept) == {0.5}, "the delay was not the runtime's"
    assert time.monotonic() - started < 5.0, "the pool waited in real time"
