"""A reassembler over a TQ that fails, stalls or reads rows it is clearing, whole steps with no broker: the
step is aborted and rebuilt or the row counted missing, never the worker ended; every TQ call bounded."""

from __future__ import annotations

import time

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from streams.errors import RowsUnsettled, TQTimeout
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from tests.unit.memory_store import MidClear
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group
from workers.telemetry.sensors import ReassemblerStats

from .steps import (
    NAMES,
    TINY,
    RecordingStore,
    finalized,
    make_broker,
    publish,
    steps,
    worker,
)


class PickyStore(RecordingStore):
    """A store that cannot give one staged row as asked (a layout it cannot read, a field it lacks)."""

    def __init__(self, bad_key: str):
        super().__init__()
        self.bad_key = bad_key

    def get(self, partition, keys, select=None):
        if self.bad_key in keys:
            raise ValueError(f"row {self.bad_key!r} of {partition!r} cannot be read as asked")
        return super().get(partition, keys, select)


def test_a_staged_row_the_store_cannot_read_rejects_that_row_and_the_group_still_finalizes():
    broker = make_broker()
    rollouts = make_group("g1", 0, 1, shape=TINY)
    store = PickyStore(rollouts[1].receipt.manifest[0].staging_key)
    stage_rollouts(store, rollouts)
    for r in rollouts:
        broker.append(NAMES.receipts, partition_of(b"g1", 2), b"g1", r.receipt.to_bytes())
    steps(worker(broker, store), 2)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.valid_row_count == 1 and record.rejection_reasons[1] is not None


def test_a_staged_row_caught_mid_clear_is_a_missing_row_and_the_group_still_finalizes():
    # TQ marks a row before it deletes it: the tags lookup still finds it, the fetch then reads it as
    # not ready. That row is missing (it is going), never an error that crash-loops the worker.
    broker = make_broker()
    rollouts = make_group("g1", 0, 1, shape=TINY)
    going = rollouts[1].receipt.manifest[0].staging_key
    store = RecordingStore(mid_clear=MidClear([going]))
    stage_rollouts(store, rollouts)
    assert going in store.tags(STAGING, [going])
    for r in rollouts:
        broker.append(NAMES.receipts, partition_of(b"g1", 2), b"g1", r.receipt.to_bytes())
    steps(worker(broker, store), 2)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.valid_row_count == 1 and record.rejection_reasons[1] == "missing_staging_row"


class StalledPuts(RecordingStore):
    """The first `stalls` puts of training rows give up at TQ's call deadline."""

    def __init__(self, stalls: int = 1):
        super().__init__()
        self.stalls = stalls

    def put(self, partition, keys, fields, tags):
        if partition == TRAIN and self.stalls > 0:
            self.stalls -= 1
            raise TQTimeout(f"TQ put of {len(keys)} key(s) to {partition!r} did not finish within 12s")
        super().put(partition, keys, fields, tags)


def test_a_put_that_times_out_aborts_the_step_instead_of_ending_the_worker():
    broker, store = make_broker(), StalledPuts()
    stats = ReassemblerStats()
    w = worker(broker, store)
    w.sensor = stats
    publish(broker, store, "g1")
    w.step()
    assert finalized(broker) == [] and stats.aborts == 1
    steps(w, 3)  # rebuilt from what was committed: the same group again, put and committed once
    assert finalized(broker) == ["g1"]


def test_every_tq_call_of_a_worker_is_bounded_by_what_its_lease_leaves_a_put():
    tq = FakeTQ()
    tq_store = TQStore()
    tq_store._tq = tq
    broker = make_broker()
    publish(broker, tq_store, "g1")
    # 1 s between polls at most: a put allowed at 3/4 of it must land within the last quarter.
    w = worker(broker, tq_store, max_poll_interval_ms=1000, session_timeout_ms=1000)
    tq.hold_puts = 30.0  # TQ's controller stops answering puts
    started = time.monotonic()
    w.step()
    assert time.monotonic() - started < 10.0, "the step waited on TQ past its call deadline"
    assert tq.puts_cancelled == 1 and finalized(broker) == []
    tq.hold_puts = None
    steps(w, 3)
    assert finalized(broker) == ["g1"]
    assert sorted(tq_store.list(TRAIN)) == ["g1_g0", "g1_g1"]


class TagsTimeOut(RecordingStore):
    """The next tags lookup, once armed, gives up at TQ's call deadline."""

    armed = False

    def tags(self, partition, keys):
        if self.armed:
            self.armed = False
            raise TQTimeout(f"TQ lookup of {len(keys)} key(s) in {partition!r} did not finish within 12s")
        return super().tags(partition, keys)


def test_a_tq_timeout_after_the_commit_rebuilds_instead_of_ending_the_worker():
    broker, store = make_broker(), TagsTimeOut()
    w = worker(broker, store)
    rollouts = publish(broker, store, "g1")
    steps(w, 2)
    # The same receipt again: refused as a duplicate, its staged rows cleared after the commit,
    # once a lookup says they are its own; that lookup times out.
    broker.append(NAMES.receipts, partition_of(b"g1", 2), b"g1", rollouts[0].receipt.to_bytes())
    store.armed = True
    steps(w, 3)
    letters = [DeadLetter.from_bytes(m.value()) for m in broker.records(NAMES.deadletter)]
    assert [d.source_key for d in letters] == [b"g1"] and finalized(broker) == ["g1"]


def test_a_staged_row_a_stale_clear_deleted_is_a_missing_row_cleared_after_the_commit_and_the_partition_flows():
    # A row TQ still maps (its tags name the group) whose storage a stale clear deleted, an index of a
    # train row cleared by a trainer frozen after its lookup: the fetch reads it as missing, never a
    # crash loop; the group finalizes without it, its owner's clear releases the key, the next group flows.
    tq = FakeTQ()
    tq_store = TQStore()
    tq_store._tq = tq
    broker = make_broker()
    rollouts = publish(broker, tq_store, "g1")
    broken = rollouts[1].receipt.manifest[0].staging_key
    tq.stale_clear(STAGING, broken, looked_up_in=TRAIN)
    w = worker(broker, tq_store)
    steps(w, 2)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.valid_row_count == 1 and record.rejection_reasons[1] == "missing_staging_row"
    assert (STAGING, broken) not in tq.where  # released by the group's staging clear after its commit
    publish(broker, tq_store, "g2", seed=1)
    steps(w, 2)
    assert finalized(broker) == ["g1", "g2"]


class UnsettledReads(RecordingStore):
    """Staged rows that keep moving while read, for the next `times` gets (TQ's `RowsUnsettled`)."""

    times = 0

    def get(self, partition, keys, select=None):
        if self.times and partition == STAGING:
            self.times -= 1
            raise RowsUnsettled(f"rows of {len(keys)} key(s) of TQ partition {partition!r} kept moving")
        return super().get(partition, keys, select)


def test_staged_rows_that_keep_moving_abort_the_step_and_a_later_step_finalizes_the_group():
    # Nothing is known missing: not a placeholder row, not a hand-back, and not the worker's end.
    broker, store = make_broker(), UnsettledReads()
    stats = ReassemblerStats()
    w = worker(broker, store)
    w.sensor = stats
    publish(broker, store, "g1")
    store.times = 1
    steps(w, 3)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.group_id == "g1" and record.valid_row_count == 2 and stats.aborts >= 1


class UnsettledLookup(RecordingStore):
    """The next `times` lookups of staged rows' tags are unsettled (TQ's controller failed meanwhile)."""

    times = 0

    def tags(self, partition, keys):
        if self.times and partition == STAGING:
            self.times -= 1
            raise RowsUnsettled(f"TQ lookup of {len(keys)} key(s) in {partition!r}: which are present")
        return super().tags(partition, keys)


def test_a_lookup_of_staged_rows_tq_cannot_answer_now_aborts_the_step_and_a_later_one_finalizes():
    broker, store = make_broker(), UnsettledLookup()
    w = worker(broker, store)
    publish(broker, store, "g1")
    store.times = 1
    steps(w, 3)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.group_id == "g1" and record.valid_row_count == 2
