"""The pipelined step (issue 33): the next step's poll and staging read overlap this step's build, put
and transaction, and an abort, a revoke or the lease refusing a put never lets a prefetched read reach
a transaction on the strength of what was thrown away.

Whole steps over the in-memory Kafka and store, on a runtime whose background jobs run only when the
test runs them or their result is asked for (`ManualRuntime(deferred=True)`), so "the prefetch ran
while the step committed" and "the prefetch never ran" are decided by the test, not by a scheduler.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, KafkaException

from schemas.finalized import FinalizedGroup
from streams.partitioner import partition_of
from streams.tq import STAGING
from workers.reassembler.faults import Faults
from workers.rollout.synthetic import make_group

from .steps import GROUP, NAMES, TINY, Clock, RecordingStore, finalized, make_broker, publish, work, worker


class ReadingStore(RecordingStore):
    """A RecordingStore that also logs staging reads, and runs a test's action when a group's rows are read."""

    def __init__(self) -> None:
        super().__init__()
        self.during_read: dict[str, list] = {}  # staging key -> actions run (once) when its tags are read

    def tags(self, partition, keys):
        self.events.append(("tags", partition, tuple(keys)))
        for key in keys:
            for action in self.during_read.pop(key, []):
                action()
        return super().tags(partition, keys)

    def get(self, partition, keys, select=None):
        self.events.append(("get", partition, tuple(keys)))
        return super().get(partition, keys, select)

    def when_read(self, rollouts, action) -> None:
        """Run `action` when the rows of `rollouts`' group are first looked up."""
        self.during_read.setdefault(_keys(rollouts)[0], []).append(action)

    def reads_of(self, rollouts) -> int:
        """Staging gets that fetched rows of `rollouts`."""
        keys = set(_keys(rollouts))
        return sum(1 for kind, part, ks in self.events if kind == "get" and part == STAGING and keys & set(ks))


def _keys(rollouts) -> list[str]:
    return [c.staging_key for r in rollouts for c in r.receipt.manifest]


def _append(broker, rollouts, ts_ms: int | None = None) -> None:
    """Append receipts stamped `ts_ms` (now by default: a group they leave incomplete is not due yet)."""
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    for r in rollouts:
        key = r.receipt.group_id.encode()
        broker.append(NAMES.receipts, partition_of(key, 2), key, r.receipt.to_bytes(), ts)


def _on_partition(partition: int, *, skip: set[str] = frozenset(), start: int = 0) -> str:
    """A group id whose receipts land on receipts partition `partition` (of 2)."""
    return next(
        g for i in range(start, 1000) if (g := f"g{i}") not in skip and partition_of(g.encode(), 2) == partition
    )


class AtCommit(Faults):
    """Runs `action` inside each open transaction, just before its commit."""

    def __init__(self, action):
        self.action = action

    def before_commit(self) -> None:
        self.action()


def test_the_next_steps_staging_read_runs_while_this_step_commits_and_the_next_step_does_not_wait():
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    g1 = publish(broker, store, "g1")
    g2 = make_group("g2", 0, 1, shape=TINY)
    from workers.rollout.publisher import stage_rollouts

    stage_rollouts(store, g2)
    _append(broker, g2[:1])
    # g2's last receipt lands while step 1 reads g1's rows: g2 completes in the middle of step 1.
    store.when_read(g1, lambda: _append(broker, g2[1:]))
    seen_at_commit = []
    # Whatever background work is due runs inside step 1's transaction, as a thread would meanwhile.
    w = worker(
        broker, store, clock=runtime, faults=AtCommit(lambda: (runtime.run_background(), seen_at_commit.append(1)))
    )
    w.step()
    assert finalized(broker) == ["g1"]
    assert store.reads_of(g2) == 1, "g2's rows were read while step 1 committed"
    timeouts_before = len(w._consumer.timeouts)
    w.step()
    assert finalized(broker) == ["g1", "g2"]
    assert store.reads_of(g2) == 1, "step 2 read no rows of its own: the prefetch had them"
    assert w._consumer.timeouts[timeouts_before] == 0.0, "with its rows read already, step 2 waited for no receipt"


class FailCommitOnce(Faults):
    """The first transaction's commit fails with an abortable error (a request that timed out)."""

    def __init__(self):
        self.failed = False

    def before_commit(self) -> None:
        if not self.failed:
            self.failed = True
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "commit timed out", txn_requires_abort=True))


def test_an_aborted_step_drops_the_next_steps_prefetch_and_the_next_step_reads_its_rows_again():
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    g1 = publish(broker, store, "g1")
    g2 = []
    store.when_read(g1, lambda: g2.extend(publish(broker, store, "g2")))
    faults = FailCommitOnce()
    w = worker(broker, store, clock=runtime, faults=faults)
    w.step()
    assert faults.failed and finalized(broker) == []
    runtime.run_background()  # a prefetch still queued would run now
    assert store.reads_of(g2) == 0, "the aborted step's prefetch was dropped before it read anything"
    w.step()  # rebuilt from the commit: g1 and g2 are read again from their receipts, and their rows
    assert sorted(finalized(broker)) == ["g1", "g2"]
    assert store.reads_of(g2) == 1
    w.step()
    records = [FinalizedGroup.from_bytes(m.value()).group_id for m in broker.records(NAMES.finalized)]
    assert sorted(records) == ["g1", "g2"], "each group finalized once"


def test_a_revoke_before_the_next_step_drops_the_prefetch_of_the_partitions_it_takes():
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    a = _on_partition(0)
    b = _on_partition(1)
    ga = publish(broker, store, a)
    gb = []
    store.when_read(ga, lambda: gb.extend(publish(broker, store, b)))
    w = worker(broker, store, clock=runtime)
    w.step()  # finalizes a; b completed meanwhile and its read was started
    assert finalized(broker) == [a] and w._prefetch.pending
    broker.revoke(GROUP, {1})  # b's partition moves to another member before the next step
    w.step()
    runtime.run_background()
    assert finalized(broker) == [a]
    assert 1 not in w._tasks
    assert store.reads_of(gb) == 0, "the revoked partition's prefetch was never read"
    assert not any(s.startswith(b) for keys in store.puts() for s in keys), "no row of b was put"


def test_a_revoke_delivered_by_the_overlapped_poll_ends_the_step_before_any_put():
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    a, b = _on_partition(0), _on_partition(1)
    ga = publish(broker, store, a)
    publish(broker, store, b)
    # While the step reads its rows, partition 0 is taken from the member: its next poll (the
    # overlapped one) revokes it.
    store.when_read(ga, lambda: broker.revoke(GROUP, {0}))
    w = worker(broker, store, clock=runtime)
    w.step()
    assert store.puts() == [] and finalized(broker) == [], "the step ended uncommitted, nothing put"
    assert 0 not in w._tasks and (GROUP, NAMES.receipts, 0) not in broker.offsets
    w.step()
    assert finalized(broker) == [b], "the partition kept finalizes its group in the next step"
    assert not any(s.startswith(a) for keys in store.puts() for s in keys)


class FreezeAtPutOf(Faults):
    """At the first put of `group`'s rows the process is stopped for `seconds` and the group expels it."""

    def __init__(self, clock: Clock, broker, group: str, seconds: float = 10.0):
        self.clock, self.broker, self.group, self.seconds = clock, broker, group, seconds
        self.frozen = False

    def before_put(self, put: int, sample_ids) -> None:
        if not self.frozen and any(s.startswith(f"{self.group}_g") for s in sample_ids):
            self.frozen = True
            self.clock.now += self.seconds
            self.broker.kick(GROUP)


def test_the_lease_refusing_the_overlapped_put_drops_the_following_prefetch():
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    g1 = publish(broker, store, "g1")
    g2, g3 = [], []
    store.when_read(g1, lambda: g2.extend(publish(broker, store, "g2")))
    faults = FreezeAtPutOf(runtime, broker, "g2")
    w = worker(broker, store, clock=runtime, faults=faults)
    w.step()  # g1; g2's read started
    assert finalized(broker) == ["g1"]
    store.when_read(g2, lambda: g3.extend(publish(broker, store, "g3")))
    w.step()  # takes g2's prefetch, starts g3's, then freezes at g2's put: refused, aborted
    assert faults.frozen and finalized(broker) == ["g1"]
    assert not any(s.startswith(("g2_", "g3_")) for keys in store.puts() for s in keys)
    runtime.run_background()
    assert store.reads_of(g3) == 0, "g3's prefetch went with the aborted step"
    for _ in range(4):  # the rebalance, the confirmation, then g2 and g3
        w.step()
    records = [FinalizedGroup.from_bytes(m.value()).group_id for m in broker.records(NAMES.finalized)]
    assert sorted(records) == ["g1", "g2", "g3"], "each group finalized once, after the confirmation"


def test_a_group_that_takes_a_receipt_after_its_rows_were_read_waits_for_a_read_of_all_of_them():
    broker, store = make_broker(), ReadingStore()
    runtime = Clock(deferred=True, wall_now_ms=1_000_000)
    from workers.rollout.publisher import stage_rollouts

    g = make_group("g1", 0, 1, shape=TINY)
    stage_rollouts(store, g)
    _append(broker, g[:1], runtime.wall_now_ms)
    w = worker(broker, store, clock=runtime, group_timeout_s=1.0)
    w.step()  # g1 opened, not due yet
    runtime.wall_now_ms += 2_000  # past its deadline: ready with one receipt of two
    # Its second receipt arrives while the step reads the first one's rows.
    store.when_read(g, lambda: _append(broker, g[1:], runtime.wall_now_ms))
    w.step()
    assert finalized(broker) == [], "not finalized from a read that missed a receipt"
    w.step()
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.group_id == "g1" and record.valid_row_count == 2 and record.rejection_reasons == (None, None)


def test_a_prefetched_group_that_took_a_receipt_since_is_not_taken_from_the_prefetch():
    broker, store = make_broker(), ReadingStore()
    runtime = Clock(deferred=True, wall_now_ms=1_000_000)
    from workers.rollout.publisher import stage_rollouts

    g = make_group("g1", 0, 1, shape=TINY)
    stage_rollouts(store, g)
    _append(broker, g[:1], runtime.wall_now_ms)
    w = worker(broker, store, clock=runtime, group_timeout_s=1.0)
    w.step()
    runtime.wall_now_ms += 2_000
    (due,) = w._tasks.ready(runtime.wall_now_ms)
    w._prefetch.start([due], w._tasks.epoch)
    w._poll(0.0)  # nothing new: the prefetch still stands for it
    assert w._prefetch.take(w._tasks) is not None
    w._prefetch.start([due], w._tasks.epoch)
    _append(broker, g[1:], runtime.wall_now_ms)
    w._poll(0.0)  # its second receipt: the read no longer covers the group
    assert w._prefetch.take(w._tasks) is None


def test_a_prefetch_reads_what_its_groups_claimed_when_it_started_not_what_they_took_since():
    """The read runs on another thread while the next poll may add receipts to its groups: it works
    from the claims taken when it started, never by walking the groups (whose dicts change under it)."""
    broker, store = make_broker(), ReadingStore()
    runtime = Clock(deferred=True, wall_now_ms=1_000_000)
    from workers.rollout.publisher import stage_rollouts

    g = make_group("g1", 0, 1, shape=TINY)
    stage_rollouts(store, g)
    _append(broker, g[:1], runtime.wall_now_ms)
    w = worker(broker, store, clock=runtime, group_timeout_s=1.0)
    w.step()
    runtime.wall_now_ms += 2_000
    (due,) = w._tasks.ready(runtime.wall_now_ms)
    w._prefetch.start([due], w._tasks.epoch)
    _append(broker, g[1:], runtime.wall_now_ms)
    w._poll(0.0)  # the group takes its second receipt before the read has run
    assert len(due.receipts) == 2
    runtime.run_background()
    looked_up = {k for kind, part, keys in store.events if kind == "tags" and part == STAGING for k in keys}
    assert looked_up == set(_keys(g[:1])), "the read looked up the claims of when it started"


def _read_past_max_poll_interval(runtime, w, broker):
    """A staged read of 61 s (the lease's watch ticking through it: work, not a freeze), past the 60 s
    max.poll.interval: librdkafka has left the group meanwhile and the group has rebalanced."""

    def act():
        work(runtime, 61, w._lease.tick)
        broker.kick(GROUP)

    return act


def _finalized_once(broker, w, expected: list[str], steps: int = 8) -> None:
    for _ in range(steps):
        w.step()
    records = [FinalizedGroup.from_bytes(m.value()).group_id for m in broker.records(NAMES.finalized)]
    assert sorted(records) == expected, "each group finalized once, after the rejoin"


def test_a_read_past_max_poll_interval_puts_nothing_though_the_overlapped_poll_shows_no_rebalance_yet():
    """The overlapped poll must not renew a lease the read ran out: its poll can return before the
    revoke (librdkafka hands out its MAX_POLL_EXCEEDED error first), so every put would be a non-member's."""
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    gs = [publish(broker, store, f"g{i}") for i in range(4)]
    w = worker(broker, store, clock=runtime, max_poll_records=1000)
    broker.members_notice = False  # the rebalance is not delivered by the next poll
    store.when_read(gs[0], _read_past_max_poll_interval(runtime, w, broker))
    w.step()
    assert store.puts() == [], "no train row put by a worker that has left its group"
    assert finalized(broker) == []
    broker.members_notice = True
    _finalized_once(broker, w, [f"g{i}" for i in range(4)])


def test_a_step_that_ran_out_of_the_poll_interval_in_its_read_finalizes_fewer_groups_next(caplog):
    """Else the rebuilt step reads as many groups again and runs out of time again, forever."""
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    gs = [publish(broker, store, f"g{i}") for i in range(4)]
    w = worker(broker, store, clock=runtime, max_poll_records=1000)
    store.when_read(gs[0], _read_past_max_poll_interval(runtime, w, broker))
    with caplog.at_level(logging.WARNING, logger="rlstream.reassembler"):
        w.step()
    assert store.puts() == [] and finalized(broker) == []
    assert w._step.groups == 2, "a step of 4 groups that ran out of time: the next ones take half"
    assert any("a step of 4 group(s) ran past 75% of max_poll_interval_ms" in r.getMessage() for r in caplog.records)
    _finalized_once(broker, w, [f"g{i}" for i in range(4)])


def test_a_group_the_next_steps_poll_completes_is_finalized_by_that_step_not_held_for_the_one_after():
    """Latency (issue 33 item 3): a receipt that completes a group during a step's commit is taken by
    the next step's poll; that step finalizes it with its prefetched groups instead of only
    starting its read, which would hold it for the whole step."""
    broker, store, runtime = make_broker(), ReadingStore(), Clock(deferred=True)
    g1 = publish(broker, store, "g1")
    g2, g3 = [], []
    store.when_read(g1, lambda: g2.extend(publish(broker, store, "g2")))  # before the overlapped poll
    w = worker(
        broker,
        store,
        clock=runtime,
        faults=AtCommit(lambda: g3 or (runtime.run_background(), g3.extend(publish(broker, store, "g3")))),
    )
    w.step()
    assert finalized(broker) == ["g1"]
    assert store.reads_of(g2) == 1 and store.reads_of(g3) == 0, "g2 prefetched; g3 came after the overlapped poll"
    w.step()
    late = "g3, completed by this step's poll, is not held for the next"
    assert sorted(finalized(broker)) == ["g1", "g2", "g3"], late
    assert store.reads_of(g2) == 1, "g2's rows came from the prefetch"
    assert store.reads_of(g3) == 1, "g3's rows were read by the step itself"
    w.step()
    assert sorted(finalized(broker)) == ["g1", "g2", "g3"], "each group finalized once"


def test_a_prefetched_group_that_took_a_receipt_since_is_read_again_whole_beside_the_prefetch():
    """The prefetch still serves one group; another, due by its deadline when the read started, took its
    last receipt since: the step reads that one again itself and builds it from all its rows, not
    from what the prefetch saw of it."""
    broker, store = make_broker(), ReadingStore()
    runtime = Clock(deferred=True, wall_now_ms=1_000_000)
    from workers.rollout.publisher import stage_rollouts

    due = make_group(_on_partition(0), 0, 1, shape=TINY)
    stage_rollouts(store, due)
    _append(broker, due[:1], runtime.wall_now_ms)
    w = worker(broker, store, clock=runtime, group_timeout_s=1.0)
    w.step()  # opened, not due yet
    runtime.wall_now_ms += 2_000
    other = publish(broker, store, _on_partition(1, skip={due[0].receipt.group_id}))
    w._poll(0.0)
    ready = w._tasks.ready(runtime.wall_now_ms)
    assert len(ready) == 2
    w._prefetch.start(ready, w._tasks.epoch)
    runtime.run_background()  # read with one receipt of the due group's two
    _append(broker, due[1:], runtime.wall_now_ms)
    w.step()
    records = {
        FinalizedGroup.from_bytes(m.value()).group_id: FinalizedGroup.from_bytes(m.value())
        for m in broker.records(NAMES.finalized)
    }
    assert set(records) == {due[0].receipt.group_id, other[0].receipt.group_id}
    assert store.reads_of(other) == 1, "the other group's rows came from the prefetch"
    assert store.reads_of(due) == 2, "the changed group was read again"
    record = records[due[0].receipt.group_id]
    assert record.valid_row_count == 2 and record.rejection_reasons == (None, None)
