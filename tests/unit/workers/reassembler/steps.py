"""Whole reassembler steps with no broker, the helpers: an in-memory Kafka and store, a runtime whose
clock the test moves, and the faults several test files inject (objects passed in, as the drills do).
"""

from __future__ import annotations

import threading

from schemas.finalized import FinalizedGroup
from schemas.state import PROGRESS_KEY, GroupState, decode_state_entry
from streams.partitioner import partition_of
from streams.tq import TRAIN
from tests.unit.manual_runtime import ManualRuntime
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.faults import Faults
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames

from .fake_kafka import FakeBroker

TINY = SyntheticShape(group_size=2, calls=(1, 2), prompt_len=(2, 4), answer_len=(1, 3), observation_len=(1, 2))
NAMES = TopicNames("t")
GROUP = "reassemblers.t"


class Clock(ManualRuntime):
    """The worker's runtime: a monotonic clock the test moves (`now`), this process's wall clock, and the
    lease's watch ticking only when the test ticks it (`w._lease.tick`, or `tick()`)."""


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
    """A worker over `broker` and `store`; `clock` (a `Clock`, or any runtime) is its runtime."""
    config = ReassemblerConfig(prefix="t", worker_id="w0", consumer_group=GROUP, **settings)
    clients = broker.clients()
    return ReassemblerWorker(None, store, config, faults=faults or Faults(), clients=clients, runtime=clock or Clock())


def finalized(broker) -> list[str]:
    return [FinalizedGroup.from_bytes(m.value()).group_id for m in broker.records(NAMES.finalized)]


def state_entries(broker) -> list[GroupState]:
    return [decode_state_entry(m.value()) for m in broker.records(NAMES.state) if m.key() != PROGRESS_KEY]


def steps(w: ReassemblerWorker, n: int) -> None:
    for _ in range(n):
        w.step()
    w._clearer.settle()


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


def work(clock: Clock, seconds: float, tick) -> None:
    """`seconds` of the clock spent working: the lease's watch ticks through them, so it is no freeze."""
    for _ in range(int(seconds * 10)):
        clock.now += 0.1
        tick()


def frozen_at_first_put(clock: Clock):
    """A worker frozen past its session at its first put of g1 (refused, aborted), whose group has not
    told it of its expulsion yet (`members_notice` False); returns the broker, the store and the worker."""
    broker, store = make_broker(), RecordingStore()
    broker.members_notice = False  # the heartbeat that would reveal the expulsion is not answered yet
    faults = FreezeAtPut(clock, broker, seconds=10.0)
    w = worker(broker, store, clock=clock, faults=faults)
    faults.tick = w._lease.tick
    publish(broker, store, "g1")
    w.step()  # froze at its put: refused, aborted
    assert faults.frozen and store.puts() == []
    return broker, store, w
