"""The real runtime: the process's clocks, a periodic tick on a thread of its own that stops, and a
background thread that runs jobs in order and hands back what they raised."""

from __future__ import annotations

import threading
import time

import pytest

from workers.runtime import REAL_RUNTIME


def _until(holds, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not holds() and time.monotonic() < deadline:
        time.sleep(0.01)
    return holds()


def test_the_clocks_are_the_processes_own():
    before_ms, before = int(time.time() * 1000), time.monotonic()
    wall_ms, mono = REAL_RUNTIME.wall_ms(), REAL_RUNTIME.monotonic()
    assert before_ms <= wall_ms <= int(time.time() * 1000)
    assert before <= mono <= time.monotonic()


def test_a_periodic_tick_runs_on_its_own_named_thread_until_stopped():
    ticks: list[str] = []
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            ticks.append(threading.current_thread().name)

    periodic = REAL_RUNTIME.periodic(0.01, tick, name="test-tick")
    assert _until(lambda: len(ticks) >= 3), "the tick did not run"
    periodic.stop()
    assert _until(lambda: "test-tick" not in {t.name for t in threading.enumerate()}), "the thread outlived stop"
    with lock:
        after = len(ticks)
    assert set(ticks) == {"test-tick"}
    time.sleep(0.05)  # a stopped tick stays stopped: no condition to wait for, only its absence
    assert len(ticks) == after


def test_an_executor_runs_jobs_in_order_off_the_callers_thread_and_hands_back_their_errors():
    executor = REAL_RUNTIME.executor("test-bg")
    gate, order = threading.Event(), []
    first = executor.submit(lambda: (gate.wait(10), order.append(threading.current_thread().name)))
    second = executor.submit(lambda: order.append("second"))
    assert not first.done(), "the job ran on the caller's thread"
    gate.set()
    second.result(10)
    assert order[0].startswith("test-bg") and order[1] == "second"

    def fail() -> None:
        raise RuntimeError("TQ is gone")

    with pytest.raises(RuntimeError, match="TQ is gone"):
        executor.submit(fail).result(10)
    executor.shutdown(wait=True)
