"""verl's own partitions as the replay buffer finds them: prompts verl must dispatch again, rows of a dead run."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.unit.memory_store import InMemoryStore
from workers.adapters.verl_partitions import FAILED_PROMPT_TAG, TRAIN, Refills, sweep_rlstream_rows
from workers.trainer.intake import ConsumerCounts


def _put(store: InMemoryStore, partition: str, tags: dict[str, dict]) -> None:
    keys = list(tags)
    fields = TensorDict({"x": torch.zeros(len(keys), 1)}, batch_size=[len(keys)])
    store.put(partition, keys, fields, [tags[k] for k in keys])


class Dispatch:
    """verl's refill_fn: how many prompts it was asked for, each call."""

    def __init__(self, fails: bool = False):
        self.calls: list[int] = []
        self._fails = fails

    def __call__(self, n: int) -> int:
        if self._fails:  # as verl's _next_train_batch when n is not a multiple of gen_batch_size
            raise ValueError(f"num_prompts ({n}) must be a positive multiple of gen_batch_size (8)")
        self.calls.append(n)
        return n


def test_each_prompt_marked_failure_is_dispatched_again_once_and_taken_off_verls_partition():
    store, counts, dispatch = InMemoryStore(), ConsumerCounts(), Dispatch()
    _put(
        store,
        TRAIN,
        {
            "u1": {"is_prompt": True, "status": "failure", "global_steps": 2},
            "u2": {"is_prompt": True, "status": "pending", "global_steps": 2},
            "u3": {"is_prompt": True, "status": "failure", "global_steps": 2},
        },
    )
    refills = Refills(store, counts, dispatch)
    assert refills.settle() == 2 and dispatch.calls == [2]
    assert set(store.list(TRAIN)) == {"u2"}, "a pending prompt is verl's, left alone"
    assert refills.settle() == 0 and dispatch.calls == [2]


def test_groups_the_consumer_counts_lost_are_dispatched_again_but_not_those_handed_back():
    store, counts, dispatch = InMemoryStore(), ConsumerCounts(lost=1), Dispatch()
    refills = Refills(store, counts, dispatch)  # lost before the buffer was built: not of this run
    counts.lost += 3
    counts.missing_rows += 1
    counts.handed_back += 1  # rollout.regenerate's readers make that one again
    assert refills.settle() == 2 and dispatch.calls == [2]
    refills.excuse()  # a group of a dead run, lost now
    counts.lost += 2
    assert refills.settle() == 1 and dispatch.calls == [2, 1] and refills.dispatched == 3


def test_without_a_refill_function_nothing_is_dispatched_and_the_failed_prompts_still_go():
    store, counts = InMemoryStore(), ConsumerCounts()
    _put(store, TRAIN, {"u1": {"is_prompt": True, "status": "failure"}})
    refills = Refills(store, counts, None)
    counts.lost += 1
    assert refills.settle() == 0 and store.list(TRAIN) == {}


def test_a_dispatch_verl_cannot_make_is_an_error_naming_the_setting_not_a_crash(caplog):
    """Raising would crash verl on the same losses after every restart (re-read past the checkpoint)."""
    store, counts = InMemoryStore(), ConsumerCounts()
    refills = Refills(store, counts, Dispatch(fails=True))
    counts.lost += 1
    assert refills.settle() == 0 and refills.dispatched == 0
    assert any("sync_refill_failed_groups=true" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert refills.settle() == 0 and len([r for r in caplog.records if r.levelname == "ERROR"]) == 1


def test_failed_prompts_stay_owed_when_verl_fails_to_dispatch():
    store, counts = InMemoryStore(), ConsumerCounts()
    _put(store, TRAIN, {"u1": dict(FAILED_PROMPT_TAG)})

    def ray_down(n: int) -> None:
        raise RuntimeError("the rollout actors are gone (the test)")

    with pytest.raises(RuntimeError):
        Refills(store, counts, ray_down).settle()
    assert set(store.list(TRAIN)) == {"u1"}, "still owed"
    dispatch = Dispatch()
    assert Refills(store, counts, dispatch).settle() == 1 and dispatch.calls == [1]


def test_the_sweep_clears_only_rows_rlstream_put_into_verls_partition():
    store = InMemoryStore()
    _put(store, TRAIN, {"g1_0": {"rlstream_group_id": "g1"}, "u9": {"is_prompt": True, "status": "pending"}})
    assert sweep_rlstream_rows(store, TRAIN) == 1
    assert set(store.list(TRAIN)) == {"u9"}


def test_a_failed_prompt_the_agent_loop_marks_in_sync_mode_is_dispatched_again():
    """The agent loop's put creates the key when verl's has gone: its tag alone must read as a failed prompt."""
    store, dispatch = InMemoryStore(), Dispatch()
    _put(store, TRAIN, {"u1": dict(FAILED_PROMPT_TAG)})
    assert Refills(store, ConsumerCounts(), dispatch).settle() == 1 and dispatch.calls == [1]
