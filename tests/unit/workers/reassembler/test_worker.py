"""Whole reassembler steps with no broker: the worker over an in-memory Kafka and store, with faults injected.

Each step runs for real (poll, finalize, settle, prepare, commit, post-commit); Kafka is
`fake_kafka.FakeBroker`, TQ an `InMemoryStore`, time a clock the test moves, and faults are objects
the test passes in, as the drills do (helpers in `steps.py`). Fences: `test_worker_fencing.py`; TQ
failing or slow: `test_worker_tq.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.faults import Faults
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group

from .fake_kafka import FakeBroker
from .steps import (
    EXPERTS,
    GROUP,
    NAMES,
    TINY,
    Clock,
    CommitFault,
    FreezeAtPut,
    RecordingStore,
    finalized,
    make_broker,
    publish,
    state_entries,
    steps,
    work,
    worker,
)


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
    revoke = threading.Thread(target=w._tasks.on_revoke, args=(w._consumer, w._consumer.assignment()))
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
