"""Every clear a reassembler makes goes through the guarded clear (issue 30, item 1): the background staging
clear, the restored-staging clear, the refused-staging clear and the sweeper.

Whole steps over an in-memory Kafka and the fake TQ of tests/unit/fake_tq.py (TQ's controller apart
from its storage, one FIFO index pool for every partition, a clear in TQ's own steps). The worker is
frozen inside its clear while the rest of the job goes on: the key's next owner clears it and a
train put is handed its freed index. Frozen after the lookup, the clear's check sees the index
changed hands; frozen after that check, the lease (which saw the freeze) refuses the storage clear.
Either way the train row that took the index stays whole.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from workers.reassembler.faults import Faults
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group

from .steps import NAMES, TINY, Clock, finalized, make_broker, publish, steps, work, worker


class _Crash(Exception):
    pass


class _CrashAfterCommit(Faults):
    def after_commit(self) -> None:
        raise _Crash("killed after the commit, before the staging clear")


class _Job:
    """The fake TQ, a worker's store over it, and the rest of the job's own store."""

    def __init__(self) -> None:
        self.tq = FakeTQ()
        self.store, self.others = TQStore(), TQStore()
        self.store._tq = self.others._tq = self.tq
        self.broker, self.clock = make_broker(), Clock()
        self.taker: str | None = None

    def takes_over(self, key: str) -> None:
        """The key's next owner clears it; train puts follow until one is handed its index."""
        index = self.tq.where[STAGING, key]
        self.tq.kv_clear([key], STAGING)
        for n in range(64):
            name = f"t{n}_g0"
            self.others.put(TRAIN, [name], TensorDict({"x": torch.tensor([n])}, [1]), [{"group_id": f"t{n}"}])
            if self.tq.where[TRAIN, name] == index:
                self.taker = name
                return
        raise AssertionError("no train put was handed the freed index")

    def taker_row(self) -> list[int]:
        assert self.taker is not None, "the clear never reached the point the test freezes it at"
        return self.others.get(TRAIN, [self.taker])["x"].tolist()


def _background(job: _Job):
    w = worker(job.broker, job.store, clock=job.clock)
    key = publish(job.broker, job.store, "g1")[0].receipt.manifest[0].staging_key
    return w, key, lambda: steps(w, 2)


def _restored(job: _Job):
    dead = worker(job.broker, job.store, clock=job.clock, faults=_CrashAfterCommit())
    key = publish(job.broker, job.store, "g1")[0].receipt.manifest[0].staging_key
    with pytest.raises(_Crash):
        dead.step()
    dead.close()
    w = worker(job.broker, job.store, clock=job.clock)  # restores g1 closed, its staging not cleared
    return w, key, lambda: steps(w, 2)


def _refused(job: _Job):
    w = worker(job.broker, job.store, clock=job.clock)
    rollouts = publish(job.broker, job.store, "g1")
    steps(w, 2)
    # A retried publish of a closed group's rollout: staged again under the same keys, refused as late.
    stage_rollouts(job.store, rollouts[:1])
    job.broker.append(NAMES.receipts, partition_of(b"g1", 2), b"g1", rollouts[0].receipt.to_bytes())
    return w, rollouts[0].receipt.manifest[0].staging_key, lambda: steps(w, 2)


def _swept(job: _Job):
    w = worker(job.broker, job.store, clock=job.clock)
    orphan = make_group("orphan", 0, 1, shape=TINY)
    stage_rollouts(job.store, orphan)  # its publish failed: no receipt names these rows
    for (part, _), index in job.tq.where.items():
        if part == STAGING:
            job.tq.tags[index]["staged_at_ms"] = 0
    work(job.clock, w.config.staging_sweep_interval_s + 1, w._lease.tick)
    return w, orphan[0].receipt.manifest[0].staging_key, w.step


PATHS = {"background": _background, "restored": _restored, "refused": _refused, "swept": _swept}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_clear_frozen_after_its_lookup_leaves_the_index_its_key_gave_up_alone(path):
    job = _Job()
    w, key, run = PATHS[path](job)
    job.tq.on("mark", lambda _meta: job.takes_over(key))
    run()
    assert job.taker_row() == [int(job.taker[1:].split("_")[0])]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_clear_frozen_after_its_check_is_refused_by_the_lease_that_saw_the_freeze(path):
    job = _Job()
    w, key, run = PATHS[path](job)

    def frozen(_keys):
        job.clock.now += 30.0  # SIGSTOPped past the session timeout (6 s): its partitions moved on
        job.takes_over(key)

    job.tq.on("keys", frozen)
    run()
    assert job.taker_row() == [int(job.taker[1:].split("_")[0])]
    w.close()


def test_a_refused_background_clear_aborts_the_step_and_a_later_one_clears_what_is_still_its_own():
    job = _Job()
    w, key, _ = _background(job)
    job.tq.on("keys", lambda _keys: setattr(job.clock, "now", job.clock.now + 30.0))
    steps(w, 4)  # refused, aborted and rebuilt; membership confirmed; the restore clears the staging
    assert finalized(job.broker) == ["g1"]
    assert job.store.list(STAGING) == {}


def _stores_reachable(root) -> dict[str, TQStore]:
    """Every TQStore reachable from `root` (attributes, slots, containers, bound methods, closures), by path."""
    found: dict[str, TQStore] = {}
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [("worker", root)]
    while todo:
        path, obj = todo.pop()
        if isinstance(obj, TQStore):
            found[path] = obj
            continue
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None)):
            continue
        seen.add(id(obj))
        module = type(obj).__module__
        if isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, list | tuple | set | frozenset):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):  # a bound method
            todo.append((f"{path}.__self__", obj.__self__))
        elif callable(obj) and getattr(obj, "__closure__", None):
            todo += [(f"{path}.<closure>", c.cell_contents) for c in obj.__closure__]
        elif module.split(".")[0] in {"workers", "streams", "tests"}:
            fields = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    fields[slot] = getattr(obj, slot)
            todo += [(f"{path}.{k}", v) for k, v in fields.items()]
    return found


def test_every_store_a_worker_built_the_normal_way_hands_out_asks_the_lease_before_clearing():
    # The clearer, the sweeper, the task manager (restores, rebuilds) and the step (finalize, the
    # abandoned rows, restored staging) all clear through the store they were handed: built from the
    # bare one, a clear would skip the lease and delete by a stale lookup after a freeze.
    job = _Job()
    w = worker(job.broker, job.store, clock=job.clock)
    found = _stores_reachable(w)
    handed = {"clearer": w._clearer._store, "sweeper": w._sweeper._store, "tasks": w._tasks.store, "step": w.store}
    assert all(isinstance(s, TQStore) for s in handed.values()) and len(found) >= len(handed)
    unguarded = sorted(path for path, s in found.items() if s._clear_guard != w._lease.refusal)
    assert unguarded == []
    assert all(s._deadline_s is not None for s in found.values())  # and each call has its deadline
    w.close()
