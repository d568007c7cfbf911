"""A reassembler on a virtual runtime (`workers.runtime`), as issue 31's simulator runs one: every clock it
reads, sleep it sleeps and thread it starts is the runtime's, so a test (or a scheduler) decides when
time passes, when the lease's watch ticks and when the background staging clear runs."""

from __future__ import annotations

import threading
import time

import pytest

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from schemas.state import PROGRESS_KEY, PartitionProgress, decode_state_entry
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN
from tests.unit.manual_runtime import ManualRuntime

from .steps import GROUP, NAMES, RecordingStore, finalized, make_broker, publish, state_entries, steps, worker

WALL_MS = 1_700_000_000_000  # the virtual wall clock: no record may carry this process's own time


class Spy:
    """Calls of `time.time`, `time.monotonic` and `time.sleep` made by the reassembler's modules or by the
    real runtime (a default reached), and threads started at all, noted while installed (the calls
    still go through)."""

    def __init__(self, monkeypatch):
        self.clock_calls: list[str] = []
        self.threads: list[str] = []
        for name in ("time", "monotonic", "sleep"):
            real = getattr(time, name)
            monkeypatch.setattr(time, name, self._noting(name, real))
        start = threading.Thread.start

        def noted_start(thread):
            self.threads.append(thread.name)
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", noted_start)

    def _noting(self, name, real):
        import sys

        def call(*args):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("workers.reassembler") or caller == "workers.runtime":
                self.clock_calls.append(f"time.{name} from {caller}")
            return real(*args)

        return call


def test_a_worker_on_a_virtual_runtime_reads_no_clock_and_starts_no_thread_of_its_own(monkeypatch):
    broker, store = make_broker(), RecordingStore()
    runtime = ManualRuntime(wall_now_ms=WALL_MS, deferred=True)
    spy = Spy(monkeypatch)
    w = worker(broker, store, clock=runtime)
    publish(broker, store, "g1")
    steps(w, 2)
    runtime.tick()  # the lease's watch, as the runtime fires it
    w.close()
    assert finalized(broker) == ["g1"]
    assert spy.clock_calls == [] and spy.threads == []
    assert [p.name for p in runtime.periodics] == ["rlstream-lease"] and runtime.periodics[0].stopped


def test_records_and_state_carry_the_runtimes_wall_clock():
    broker, store = make_broker(), RecordingStore()
    runtime = ManualRuntime(wall_now_ms=WALL_MS)
    w = worker(broker, store, clock=runtime)
    publish(broker, store, "g1")
    broker.append(NAMES.receipts, partition_of(b"bad", 2), b"bad", b"not a receipt")
    steps(w, 2)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    (letter,) = [DeadLetter.from_bytes(m.value()) for m in broker.records(NAMES.deadletter)]
    progress = [decode_state_entry(m.value()) for m in broker.records(NAMES.state) if m.key() == PROGRESS_KEY]
    assert record.finalized_at_ms == WALL_MS and letter.time_ms == WALL_MS
    assert progress and all(isinstance(p, PartitionProgress) and p.time_ms == WALL_MS for p in progress)
    assert {e.finalized_at_ms for e in state_entries(broker) if e.finalized_at_ms} == {WALL_MS}


def test_the_background_clear_runs_when_the_runtime_runs_it_and_the_next_commit_waits_for_it():
    broker, store = make_broker(), RecordingStore()
    runtime = ManualRuntime(deferred=True)
    w = worker(broker, store, clock=runtime)
    keys = {c.staging_key for r in publish(broker, store, "g1") for c in r.receipt.manifest}
    w.step()  # committed g1; its staging clear is submitted, not run
    assert finalized(broker) == ["g1"] and set(store.list(STAGING)) == keys
    runtime.run_background()  # the scheduler runs it now: between two steps
    assert store.list(STAGING) == {} and store.clears_done == 1
    g2 = {c.staging_key for r in publish(broker, store, "g2") for c in r.receipt.manifest}
    w.step()  # commits g2 and records g1's staging cleared; g2's clear waits
    assert set(store.list(STAGING)) == g2 and store.clears_done == 1
    w.step()  # nothing ready: the step still waits for g2's clear before recording it cleared
    assert store.list(STAGING) == {} and store.clears_done == 2
    assert {e.group_id for e in state_entries(broker) if e.staging_cleared} == {"g1", "g2"}
    assert sorted(store.list(TRAIN)) == ["g1_g0", "g1_g1", "g2_g0", "g2_g1"]


def test_a_freeze_is_virtual_time_passing_without_a_tick():
    broker, store = make_broker(), RecordingStore()
    runtime = ManualRuntime()
    w = worker(broker, store, clock=runtime)
    w.step()  # joined, partitions assigned
    for _ in range(20):  # two seconds of a running worker: its watch ticks through them
        runtime.now += 0.1
        runtime.tick()
    assert w._lease.refusal() is None
    broker.members_notice = False  # the heartbeat that would reveal the expulsion is not answered yet
    runtime.now += 10.0  # the process stopped whole: no tick, the clock ran on, its session expired
    broker.kick(GROUP)
    runtime.tick()
    publish(broker, store, "g1")
    w.step()
    assert store.puts() == [] and finalized(broker) == [], "a worker frozen past its session put its rows"


@pytest.mark.parametrize("deferred", [False, True])
def test_a_close_settles_the_background_clear_on_either_executor(deferred):
    broker, store = make_broker(), RecordingStore()
    runtime = ManualRuntime(deferred=deferred)
    w = worker(broker, store, clock=runtime)
    publish(broker, store, "g1")
    w.step()
    w.close()
    assert store.list(STAGING) == {} and store.clears_done == 1
