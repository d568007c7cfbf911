"""Whole reassembler steps with no broker: the worker over an in-memory Kafka and store, with faults injected.

Each step runs for real (poll, finalize, settle, prepare, commit, post-commit); Kafka is
`fake_kafka.FakeBroker`, TQ an `InMemoryStore`, time a clock the test moves, and faults are objects
the test passes in, as the drills do.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from schemas.state import PROGRESS_KEY, GroupState, decode_state_entry
from streams.errors import TQTimeout
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from tests.unit.memory_store import InMemoryStore, MidClear
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.errors import WorkerFenced
from workers.reassembler.faults import Faults
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.telemetry.sensors import ReassemblerStats
from workers.topics import TopicNames

from .fake_kafka import FakeBroker

TINY = SyntheticShape(group_size=2, calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))
NAMES = TopicNames("t")
GROUP = "reassemblers.t"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingStore(InMemoryStore):
    """An InMemoryStore that logs every put and clear, and can hold a clear back."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.events: list[tuple[str, str, tuple[str, ...]]] = []
        self.hold_next_clear: threading.Event | None = None
        self._clearing: dict[str, int] = {}
        self.overlapping_clears: list[str] = []
        self.clears_done = 0
        self.on_clear = lambda: None  # called as each clear starts
        self._lock = threading.Lock()

    def put(self, partition, keys, fields, tags):
        self.events.append(("put", partition, tuple(keys)))
        super().put(partition, keys, fields, tags)

    def clear(self, partition, keys):
        self.on_clear()
        with self._lock:
            for k in keys:
                self._clearing[k] = self._clearing.get(k, 0) + 1
                if self._clearing[k] > 1:
                    self.overlapping_clears.append(k)
            hold, self.hold_next_clear = self.hold_next_clear, None
        self.events.append(("clear", partition, tuple(keys)))
        if hold is not None:
            # Held for 2 s, long enough for an overlapping clear of the same keys to start meanwhile.
            hold.wait(2.0)
        super().clear(partition, keys)
        with self._lock:
            for k in keys:
                self._clearing[k] -= 1
            self.clears_done += 1

    def puts(self, partition=TRAIN) -> list[tuple[str, ...]]:
        return [keys for kind, part, keys in self.events if kind == "put" and part == partition]


def make_broker() -> FakeBroker:
    broker = FakeBroker()
    broker.create(NAMES.receipts, 2)
    broker.create(NAMES.state, 2)
    broker.create(NAMES.finalized, 1)
    broker.create(NAMES.deadletter, 1)
    return broker


EXPERTS = SyntheticShape(
    group_size=2, calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2), routed_experts_k=2
)


def publish(broker: FakeBroker, store, group_id: str, *, shape=TINY, seed=0) -> list:
    """Stage a group and append its receipts to its receipts partition, as the publisher does."""
    rollouts = make_group(group_id, 0, 1, shape=shape, seed=seed)
    stage_rollouts(store, rollouts)
    key = group_id.encode()
    for r in rollouts:
        broker.append(NAMES.receipts, partition_of(key, 2), key, r.receipt.to_bytes())
    return rollouts


def worker(broker, store, *, clock=None, faults=None, **settings) -> ReassemblerWorker:
    config = ReassemblerConfig(prefix="t", worker_id="w0", consumer_group=GROUP, **settings)
    clients = broker.clients()
    return ReassemblerWorker(None, store, config, faults=faults or Faults(), clients=clients, clock=clock or Clock())


def finalized(broker) -> list[str]:
    return [FinalizedGroup.from_bytes(m.value()).group_id for m in broker.records(NAMES.finalized)]


def state_entries(broker) -> list[GroupState]:
    return [decode_state_entry(m.value()) for m in broker.records(NAMES.state) if m.key() != PROGRESS_KEY]


def steps(w: ReassemblerWorker, n: int) -> None:
    for _ in range(n):
        w.step()
    w._clearer.settle()


def test_a_step_finalizes_a_complete_group_commits_it_with_its_offsets_and_clears_its_staging():
    broker, store = make_broker(), RecordingStore()
    rollouts = publish(broker, store, "g1")
    w = worker(broker, store)
    steps(w, 2)  # the second step records the staging as cleared
    assert finalized(broker) == ["g1"]
    assert set(store.list(TRAIN)) == {"g1_g0", "g1_g1"}
    assert store.list(STAGING) == {}
    part = partition_of(b"g1", 2)
    assert broker.offsets[(GROUP, NAMES.receipts, part)] == len(rollouts)


class FreezeAtPut(Faults):
    """Stops the clock's world: at put `at`, time jumps `seconds` (a SIGSTOP) and the group expels the
    member; then each later put first spends `then_build_s` (a slow build after waking)."""

    def __init__(self, clock: Clock, broker: FakeBroker, *, at: int = 0, seconds: float = 10.0, then_build_s=0.0):
        self.clock, self.broker, self.at, self.seconds, self.then_build_s = clock, broker, at, seconds, then_build_s
        self.frozen = False
        self.tick = lambda: None  # the worker's lease watch, ticking through a build that runs

    def before_put(self, put: int, sample_ids) -> None:
        if not self.frozen and put == self.at:
            self.frozen = True
            self.clock.now += self.seconds
            self.broker.kick(GROUP)
        elif self.frozen:
            for _ in range(int(self.then_build_s * 10)):
                self.clock.now += 0.1
                self.tick()


def test_a_worker_frozen_past_its_session_puts_nothing_until_the_broker_confirms_its_generation():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    broker.members_notice = False  # the heartbeat that would reveal the expulsion is not answered yet
    faults = FreezeAtPut(clock, broker, seconds=10.0, then_build_s=7.0)
    w = worker(broker, store, clock=clock, faults=faults)
    faults.tick = w._lease.tick
    publish(broker, store, "g1")
    w.step()  # froze at its put: refused, aborted
    assert faults.frozen and store.puts() == []
    publish(broker, store, "g2")
    # Awake, it polls prefetched records and builds for longer than a session timeout: still no put,
    # since the broker refuses the stale generation's confirmation.
    steps(w, 3)
    assert store.puts() == [] and finalized(broker) == []
    broker.members_notice = True  # the next poll hands the member its rebalance
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"]
    assert store.puts(), "a confirmed worker puts again"


def test_the_lease_is_asked_before_each_put_not_once_per_step():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    broker.members_notice = False
    # One group with routed experts, one without: two layouts, so two puts in one step.
    faults = FreezeAtPut(clock, broker, at=1, seconds=10.0)
    w = worker(broker, store, clock=clock, faults=faults, actor=_actor_with_router_replay())
    publish(broker, store, "g1", shape=EXPERTS)
    publish(broker, store, "g2")
    w.step()
    assert faults.frozen, "the step made no second put"
    assert len(store.puts()) == 1, "the put after the freeze was made"


def _actor_with_router_replay():
    import msgspec

    from workers.reassembler.config import default_actor_config

    return msgspec.structs.replace(default_actor_config(), router_replay_enabled=True)


def test_a_rollout_staged_without_routed_experts_does_not_crash_a_router_replay_worker():
    broker, store = make_broker(), RecordingStore()
    rollouts = make_group("g1", 0, 1, shape=EXPERTS)
    plain = make_group("g1", 0, 1, shape=TINY)
    # Rollout 1 staged as a publisher without router replay would: no routed_experts field.
    stage_rollouts(store, [rollouts[0]])
    stage_rollouts(store, [plain[1]])
    for r in (rollouts[0], plain[1]):
        broker.append(NAMES.receipts, partition_of(b"g1", 2), b"g1", r.receipt.to_bytes())
    w = worker(broker, store, actor=_actor_with_router_replay())
    steps(w, 2)
    (record,) = [FinalizedGroup.from_bytes(m.value()) for m in broker.records(NAMES.finalized)]
    assert record.group_id == "g1" and record.valid_row_count == 2


class CommitFault(Faults):
    """Before each of the first `times` commits, time passes (`seconds`) and the producer's epoch moves
    on: what the coordinator does to a transaction open past its timeout, or a twin's init does."""

    def __init__(self, clock: Clock, broker: FakeBroker, seconds: float, times: int = 1):
        self.clock, self.broker, self.seconds, self.times = clock, broker, seconds, times

    def before_commit(self) -> None:
        if self.times > 0:
            self.times -= 1
            self.clock.now += self.seconds
            self.broker.epochs[f"{GROUP}.w0"] += 1


def test_a_transaction_that_outlived_its_timeout_is_ridden_out_not_taken_for_a_live_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    # Twice in a row: a fence of a transaction open past its timeout is the coordinator's, never a twin's.
    w = worker(broker, store, clock=clock, faults=CommitFault(clock, broker, seconds=11.0, times=2))
    publish(broker, store, "g1")
    steps(w, 4)  # fenced at commit 11 s into a 10 s transaction: a new producer, the step again
    assert finalized(broker) == ["g1"]


def test_a_first_fence_within_the_timeout_is_ridden_out_and_a_second_soon_after_stops_the_worker_as_a_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    # A twin's init fences this worker, whose new producer fences the twin, which fences it back.
    w = worker(broker, store, clock=clock, faults=CommitFault(clock, broker, seconds=1.0, times=2))
    publish(broker, store, "g1")
    w.step()  # fenced 1 s into the transaction: once is ridden out
    with pytest.raises(WorkerFenced, match="another live worker"):
        w.step()  # fenced again soon after re-initialising: a live twin
    assert finalized(broker) == []


def test_fences_far_apart_are_each_ridden_out():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = CommitFault(clock, broker, seconds=1.0, times=1)
    w = worker(broker, store, clock=clock, faults=faults)
    publish(broker, store, "g1")
    steps(w, 3)
    clock.now += 3600.0
    faults.times = 1
    publish(broker, store, "g2")
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"]


class WokenZombie(Faults):
    """Frozen with its transaction open, past the transaction timeout and the session timeout: its
    partitions move and a successor starts under its worker id (whose producer fences this one)."""

    def __init__(self, clock: Clock, broker: FakeBroker, successor):
        self.clock, self.broker, self.successor, self.live = clock, broker, successor, None

    def before_commit(self) -> None:
        if self.live is None:
            self.clock.now += 11.0
            self.broker.kick(GROUP)
            self.live = self.successor()


def test_a_zombie_woken_past_its_transaction_timeout_is_the_twin_that_stops_not_the_live_worker():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = WokenZombie(clock, broker, lambda: worker(broker, store, clock=clock))
    zombie = worker(broker, store, clock=clock, faults=faults)
    publish(broker, store, "g1")
    # Fenced 11 s into a 10 s transaction: taken for the coordinator's abort, so the zombie
    # initialises a new producer, fencing the live worker.
    zombie.step()
    live = faults.live
    steps(live, 2)  # fenced once, soon into a transaction: it rides that out, fencing the zombie back
    with pytest.raises(WorkerFenced, match="another live worker"):
        steps(zombie, 3)  # fenced again after it re-initialised: the zombie is the twin that stops
    publish(broker, store, "g2")
    steps(live, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"]


def work(clock: Clock, seconds: float, tick) -> None:
    """`seconds` of the clock spent working: the lease's watch ticks through them, so it is no freeze."""
    for _ in range(int(seconds * 10)):
        clock.now += 0.1
        tick()


class SlowBuild(Faults):
    """A step that puts more than `fits` groups takes `seconds` of the clock: too big for the poll interval."""

    def __init__(self, clock: Clock, fits: int, seconds: float):
        self.clock, self.fits, self.seconds = clock, fits, seconds
        self.groups, self.charged = 0, False
        self.tick = lambda: None  # the worker's lease watch

    def before_put(self, put: int, sample_ids) -> None:
        if put == 0:
            self.groups, self.charged = 0, False
        self.groups += len({s.rsplit("_g", 1)[0] for s in sample_ids})
        if self.groups > self.fits and not self.charged:
            self.charged = True
            work(self.clock, self.seconds, self.tick)


def test_a_step_too_slow_for_the_poll_interval_is_shrunk_instead_of_aborted_forever():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = SlowBuild(clock, fits=2, seconds=50.0)
    w = worker(broker, store, clock=clock, faults=faults, max_poll_interval_ms=60_000)
    faults.tick = w._lease.tick
    groups = [f"g{i}" for i in range(8)]
    for i, g in enumerate(groups):
        publish(broker, store, g, seed=i)
    steps(w, 20)
    assert sorted(finalized(broker)) == sorted(groups)


def test_an_aborted_step_waits_for_the_background_clear_before_the_restore_clears_again():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = CommitFault(clock, broker, seconds=1.0, times=0)
    w = worker(broker, store, clock=clock, faults=faults)
    g1 = {c.staging_key for r in publish(broker, store, "g1") for c in r.receipt.manifest}
    store.hold_next_clear = threading.Event()
    w.step()  # commits g1; its staging clear runs in the background, held
    faults.times = 1
    publish(broker, store, "g2")
    # Fenced at its commit: the step aborts before its transaction records g1's staging as cleared,
    # so the restore leaves g1's staging to clear again. Never while the first clear still runs.
    steps(w, 3)
    assert [set(keys) for kind, _, keys in store.events if kind == "clear" and g1 & set(keys)] == [g1, g1]
    assert store.overlapping_clears == []
    assert sorted(finalized(broker)) == ["g1", "g2"]


def test_a_revoke_waits_for_the_background_clear_before_giving_its_partitions_up():
    # Under cooperative rebalancing the next owner restores a partition as soon as this worker gives
    # it up, and clears the same staging keys: two clears of one key must never overlap.
    broker, store = make_broker(), RecordingStore()
    w = worker(broker, store)
    publish(broker, store, "g1")
    held = store.hold_next_clear = threading.Event()
    w.step()  # commits g1; its staging clear runs in the background, held
    revoke = threading.Thread(target=w._on_revoke, args=(w._consumer, w._consumer.assignment()))
    revoke.start()
    revoke.join(0.5)
    returned_while_clearing = not revoke.is_alive()
    held.set()
    revoke.join(10)
    assert not returned_while_clearing, "the revoke gave its partitions up with their clear in flight"
    assert store.clears_done == 1 and not revoke.is_alive()


def test_a_zombie_clears_no_staging_until_the_broker_confirms_its_generation():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    broker.members_notice = False
    faults = FreezeAtPut(clock, broker, seconds=10.0)
    faults.frozen = True  # not in the first step
    w = worker(broker, store, clock=clock, faults=faults)
    lease_at_clear: list[str | None] = []
    store.on_clear = lambda: lease_at_clear.append(w._lease.refusal())
    publish(broker, store, "g1")
    steps(w, 1)  # g1 committed and its staging cleared; the next commit would record that
    faults.frozen = False
    publish(broker, store, "g2")
    # Frozen at its put: the abort's rebuild restores g1 as closed with its staging not recorded
    # cleared. Clearing it now would be a TQ write of a worker that may have lost the partition.
    steps(w, 3)
    assert lease_at_clear[1:] == [], "a worker whose lease refused cleared staging"
    broker.members_notice = True  # the next poll hands the member its rebalance
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"] and store.list(STAGING) == {}
    assert all(refusal is None for refusal in lease_at_clear), lease_at_clear
    assert {e.group_id for e in state_entries(broker) if e.staging_cleared} == {"g1", "g2"}


def test_config_refuses_a_group_timeout_at_or_above_the_closed_retention():
    from streams.errors import ConfigError

    with pytest.raises(ConfigError, match="group_timeout_s"):
        ReassemblerConfig(group_timeout_s=60.0, closed_retention_s=60.0)
    with pytest.raises(ConfigError, match="max_poll_interval_ms"):
        ReassemblerConfig(session_timeout_ms=10_000, max_poll_interval_ms=5_000)


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


def test_a_static_member_fenced_once_joins_again_but_fenced_twice_soon_after_stops_as_a_twin():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    w = worker(broker, store, clock=clock, static_membership=True)
    publish(broker, store, "g1")
    steps(w, 2)
    # The coordinator fenced the member id (its own retried join, after the coordinator stalled).
    broker.fenced_members.add(GROUP)
    w.step()
    publish(broker, store, "g2")
    steps(w, 3)
    assert sorted(finalized(broker)) == ["g1", "g2"], "a worker fenced once goes on"
    clock.now += 30.0  # within ten session timeouts of the first fence
    broker.fenced_members.add(GROUP)
    with pytest.raises(WorkerFenced, match="joined consumer group"):
        w.step()


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


class SlowDeadLetters(Faults):
    """A step of more than `fits` ready groups takes `seconds` of the clock even though it puts nothing
    (every group is dead-lettered), and the consumer leaves its group meanwhile (max.poll.interval)."""

    def __init__(self, clock: Clock, broker: FakeBroker, fits: int, seconds: float):
        self.clock, self.broker, self.fits, self.seconds = clock, broker, fits, seconds
        self.worker: ReassemblerWorker | None = None
        self.overran = 0

    def after_put(self) -> None:
        if self.worker._step.groups > self.fits:
            self.overran += 1
            work(self.clock, self.seconds, self.worker._lease.tick)
            self.broker.kick(GROUP)


def test_a_step_without_puts_that_overran_the_poll_interval_is_shrunk_too():
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    faults = SlowDeadLetters(clock, broker, fits=2, seconds=50.0)
    w = worker(broker, store, clock=clock, faults=faults, max_poll_interval_ms=60_000)
    faults.worker = w
    failed = dataclasses.replace(TINY, failure_rate=1.0)
    groups = [f"g{i}" for i in range(8)]
    for i, g in enumerate(groups):
        publish(broker, store, g, shape=failed, seed=i)
    steps(w, 20)  # each overrun fails at the commit (the member left its group), then is shrunk
    letters = {DeadLetter.from_bytes(m.value()).source_key.decode() for m in broker.records(NAMES.deadletter)}
    assert letters == set(groups) and faults.overran >= 1


def test_a_step_aborted_by_a_freeze_is_not_taken_for_a_slow_one(caplog):
    broker, store = make_broker(), RecordingStore()
    clock = Clock()
    broker.members_notice = False
    # Frozen for 50 s of a 60 s poll interval: past the 3/4 a slow step has, but none of it working.
    faults = FreezeAtPut(clock, broker, seconds=50.0)
    w = worker(broker, store, clock=clock, faults=faults, max_poll_interval_ms=60_000)
    publish(broker, store, "g1")
    with caplog.at_level(logging.WARNING, logger="rlstream.reassembler"):
        w.step()
    assert faults.frozen and store.puts() == []
    assert w._step.groups == w.config.max_poll_records, "a freeze shrank the step"
    assert [r.levelname for r in caplog.records if "frozen" in r.getMessage()] == ["WARNING"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "max_poll_interval" in r.getMessage()]


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
