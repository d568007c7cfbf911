"""What a worker and a pool of worker processes report to their sensors: fences, exits by how, restarts by
the spare or a new process, processes running (no broker: the in-memory Kafka and stand-in processes)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from workers.reassembler.errors import WorkerFenced
from workers.reassembler.pool import FENCED_EXIT, Pool, RestartPolicy, SpareSupply
from workers.reassembler.worker import ReassemblerWorker
from workers.telemetry.prometheus import PrometheusPoolSensor, PrometheusReassemblerSensor

from .steps import GROUP, Clock, CommitFault, RecordingStore, make_broker, publish, steps, worker


def _worker(broker, store, sensor, *, clock, faults=None, **settings) -> ReassemblerWorker:
    w = worker(broker, store, clock=clock, faults=faults, **settings)
    w.sensor = sensor  # fences are read by the worker itself, at the moment it meets one
    return w


def test_a_fenced_producer_is_reported_each_time_also_the_fence_that_stops_the_worker():
    broker, store, clock = make_broker(), RecordingStore(), Clock()
    r = CollectorRegistry()
    w = _worker(broker, store, PrometheusReassemblerSensor(r, prefix="t"), clock=clock,
                faults=CommitFault(clock, broker, seconds=1.0, times=2))  # fmt: skip
    publish(broker, store, "g1")
    w.step()
    assert r.get_sample_value("rlstream_reassembler_fenced_total", {"prefix": "t", "what": "producer"}) == 1
    with pytest.raises(WorkerFenced):
        w.step()
    assert r.get_sample_value("rlstream_reassembler_fenced_total", {"prefix": "t", "what": "producer"}) == 2
    assert r.get_sample_value("rlstream_reassembler_fenced_total", {"prefix": "t", "what": "member"}) == 0


def test_a_fenced_static_member_is_reported():
    broker, store, clock = make_broker(), RecordingStore(), Clock()
    r = CollectorRegistry()
    w = _worker(broker, store, PrometheusReassemblerSensor(r, prefix="t"), clock=clock, static_membership=True)
    publish(broker, store, "g1")
    steps(w, 2)
    broker.fenced_members.add(GROUP)
    w.step()
    assert r.get_sample_value("rlstream_reassembler_fenced_total", {"prefix": "t", "what": "member"}) == 1
    assert r.get_sample_value("rlstream_reassembler_fenced_total", {"prefix": "t", "what": "producer"}) == 0


class Proc:
    """A stand-in for a `subprocess.Popen` the pool polls: alive until the test sets its return code."""

    pids = iter(range(5000, 6000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None
        self.stdin = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self.returncode = -signum

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def _until(holds: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not holds():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_pool_reports_crashes_fences_stops_and_restarts_by_the_spare_then_by_a_new_process():
    r = CollectorRegistry()
    spares: list[Proc] = []
    started: list[Proc] = []

    def spawn(worker_id: str) -> Proc:
        started.append(Proc())
        return started[-1]

    def spawn_spare() -> Proc:
        spares.append(Proc())
        return spares[-1]

    # A restart the usual way waits 0.05 s; the spare takes over only the first crash (one spare at a time).
    pool = Pool(log=lambda _: None, stop_grace_s=1, poll_s=0.01, spawn=spawn,
                restart=RestartPolicy(initial_s=0.05, max_s=0.05),
                spares=SpareSupply(spawn_spare, lambda proc, wid: None),
                sensor=PrometheusPoolSensor(r, prefix="t"))  # fmt: skip
    first = {"w-0": Proc(), "w-1": Proc(), "w-2": Proc()}
    for worker_id, proc in first.items():
        pool.add(worker_id, proc)
    waiting = threading.Thread(target=pool.wait, daemon=True)

    def get(name: str, **labels: str) -> float | None:
        return r.get_sample_value(name, {"prefix": "t", **labels})

    def restarts(worker: str, by: str) -> float | None:
        return get("rlstream_pool_worker_restarts_total", worker=worker, by=by)

    def exits(worker: str, how: str) -> float | None:
        return get("rlstream_pool_worker_exits_total", worker=worker, how=how)

    # Each worker's series exist at 0 from its first start: a rate of 0 is data.
    assert {exits(w, h) for w in first for h in ("crashed", "fenced", "stopped", "failed")} == {0}
    waiting.start()
    try:
        _until(lambda: len(spares) == 1 and get("rlstream_pool_spare_ready") == 1, "a spare ready")
        assert get("rlstream_pool_workers_running") == 3
        first["w-0"].returncode = -signal.SIGKILL
        _until(lambda: restarts("w-0", "spare") == 1, "w-0's id taken by the spare")
        pool.procs["w-0"].returncode = 3  # the spare, now w-0, crashes soon after: a crash loop, a new process
        _until(lambda: restarts("w-0", "process") == 1, "w-0 restarted as a new process")
        first["w-1"].returncode = FENCED_EXIT
        _until(lambda: exits("w-1", "fenced") == 1, "w-1's fenced exit")
        _until(lambda: get("rlstream_pool_workers_running") == 2, "two workers left running")
    finally:
        pool.forward(signal.SIGTERM)
        waiting.join(timeout=10)
    assert exits("w-0", "crashed") == 2 and restarts("w-0", "spare") == 1 and restarts("w-0", "process") == 1
    assert exits("w-1", "fenced") == 1 and restarts("w-1", "spare") == restarts("w-1", "process") == 0
    assert exits("w-0", "stopped") == 1 and exits("w-2", "stopped") == 1, "the forwarded stop ends both"
    assert exits("w-2", "crashed") == 0 and exits("w-1", "failed") == 0
    assert pool.restarts == {"w-0": 2}, "the sensor counts what the pool does"
