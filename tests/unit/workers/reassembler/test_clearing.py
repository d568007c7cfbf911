"""StagingClearer: the clear runs off the caller's thread, and `settle` waits for it and re-raises."""

import threading

import pytest

from streams.tq import STAGING
from tests.unit.memory_store import InMemoryStore
from tests.unit.workers.reassembler.test_task import make_task, received, step
from workers.reassembler.clearing import StagingClearer
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

TINY = SyntheticShape(group_size=2, calls=(1, 1), prompt_len=(2, 2), answer_len=(1, 1), observation_len=(1, 1))


class _GatedStore(InMemoryStore):
    """Its clear blocks until the gate opens, and records the thread it ran on."""

    def __init__(self):
        super().__init__()
        self.gate, self.threads = threading.Event(), []

    def clear(self, partition, keys):
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(10)
        super().clear(partition, keys)


def test_the_clear_runs_in_the_background_and_settle_waits_for_it():
    store = _GatedStore()
    rollouts = make_group("g", 0, 1, shape=TINY)
    stage_rollouts(store, rollouts)
    keys = [c.staging_key for r in rollouts for c in r.receipt.manifest]
    clearer = StagingClearer(store, STAGING)
    clearer.submit(keys)  # returns while the clear is blocked
    assert store.present(STAGING, keys) == set(keys)
    store.gate.set()
    clearer.settle()
    assert store.present(STAGING, keys) == set()
    assert store.threads and store.threads[0] != threading.current_thread().name
    clearer.close()


def test_a_failed_clear_surfaces_at_the_next_settle():
    class Failing(InMemoryStore):
        def clear(self, partition, keys):
            raise RuntimeError("TQ is gone")

    clearer = StagingClearer(Failing(), STAGING)
    clearer.submit(["k"])
    with pytest.raises(RuntimeError, match="TQ is gone"):
        clearer.settle()
    clearer.settle()  # reported once
    clearer.close()


def test_post_commit_can_hand_its_staging_keys_to_the_caller_to_clear_with_other_partitions():
    store = InMemoryStore()
    task = make_task(store)
    keys = received(task, store, "g")
    commit = step(task, store)
    staging_to_clear = ["other-partition-key"]
    task.post_commit(commit, staging_to_clear=staging_to_clear)
    # Not cleared here (the worker clears every partition's keys in one call), but handed over.
    assert store.present(STAGING, keys) == set(keys)
    assert sorted(staging_to_clear) == sorted(["other-partition-key", *keys])
    # Recorded all the same: the next step writes the entry cleared.
    assert [(s.group_id, s.staging_cleared) for s in task.prepare([], 6_000).state] == [("g", True)]
