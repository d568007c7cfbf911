"""A group with no valid row: handed back when its own staged rows were lost, dead-lettered when its input
earned it (`staging_lost.py`).

A row destroyed under its own key (a stale clear by index of another reassembler, frozen after its
checks, landing on the index the row took since: DESIGN "Zombies") is a loss like TQ lost with the job:
the key is still mapped, with the group's own tags, but the row reads as missing. The explorer's seed
16 (zombie mix) dead-lettered such a group `inconsistent_group` and its prompt was never trained.
"""

from __future__ import annotations

import dataclasses

import torch

from schemas import deadletter as dl
from schemas.regenerate import STAGING_LOST
from schemas.state import HANDED_BACK
from streams.tq import STAGING, TQStore
from tests.unit.fake_tq import FakeTQ, _drive
from tests.unit.memory_store import InMemoryStore
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group

from .fixtures import record
from .test_task import TIMEOUT_MS, TINY, make_task, step

ONE_CALL = dataclasses.replace(TINY, calls=(1, 1))


def _tq_store() -> tuple[FakeTQ, TQStore]:
    tq = FakeTQ()
    store = TQStore()
    store._tq = tq
    return tq, store


def _stale_clear_destroys(tq: FakeTQ, store: TQStore, stage) -> None:
    """Seed 16's interleaving: a clear of another group's staging passes its checks, then its process
    freezes before the storage request leaves; meanwhile the keys' next owner clears them and `stage`
    puts a row that takes the freed index; the frozen request then lands on that index."""
    store.put(STAGING, ["old-r0/c0"], _row(), [{"group_id": "old", "rollout_id": "old-r0"}])
    stale = tq.kv_retrieve_meta(["old-r0/c0"], STAGING)
    tq.kv_clear(["old-r0/c0"], STAGING)  # the next owner's clear: the index is freed
    stage()
    assert tq.owner[stale.global_indexes[0]][0] == STAGING, "the staged row did not take the freed index"
    _drive(tq.storage_manager.clear_data(stale))  # the frozen worker wakes: storage cleared by index


def _row():
    from tensordict import TensorDict

    return TensorDict({"x": torch.tensor([1])}, batch_size=[1])


def test_a_group_whose_one_received_rollouts_row_a_stale_clear_destroyed_is_handed_back_not_dead_lettered():
    # Seed 16: rollout 0's receipt was garbage (never decoded, `missing_receipt`); rollout 1's row was
    # destroyed by a zombie's clear. The key is in TQ under its own group, its row unreadable.
    tq, store = _tq_store()
    task = make_task(store)
    rollouts = make_group("g", 0, 1, shape=ONE_CALL)
    _stale_clear_destroys(tq, store, lambda: stage_rollouts(store, rollouts[1:]))
    (key,) = [c.staging_key for c in rollouts[1].receipt.manifest]
    assert set(store.tags(STAGING, [key])) == {key}, "the controller still maps the destroyed row's key"
    task.intake(record(10, rollouts[1].receipt.to_bytes()), 5_000)
    commit = step(task, store, now_ms=5_000 + TIMEOUT_MS + 1)
    assert commit.dead_letters == () and commit.finalized == ()
    (regen,) = commit.regenerate
    assert (regen.group_id, regen.new_group_id, regen.reason) == ("g", "g~r1", STAGING_LOST)
    assert commit.state[-1].outcome == HANDED_BACK


def _staged_group():
    """A store holding group "g" staged whole, a task reading it, its rollouts and their staging keys."""
    store = InMemoryStore()
    rollouts = make_group("g", 0, 1, shape=ONE_CALL)
    stage_rollouts(store, rollouts)
    return store, make_task(store), rollouts, [c.staging_key for r in rollouts for c in r.receipt.manifest]


def _receive(task, rollouts) -> None:
    for offset, r in enumerate(rollouts, start=10):
        task.intake(record(offset, r.receipt.to_bytes()), 5_000)


def test_a_complete_group_whose_rows_read_as_missing_under_their_own_keys_is_handed_back():
    # Rows TQ still maps under the group's own keys but reports missing on the read (cleared or being
    # cleared by someone else's request): lost, whatever the count of keys still mapped.
    store, task, rollouts, keys = _staged_group()
    store.mid_clear.keys.update(keys)
    assert set(store.tags(STAGING, keys)) == set(keys)
    _receive(task, rollouts)
    commit = step(task, store)
    assert [r.group_id for r in commit.regenerate] == ["g"] and commit.dead_letters == ()


def test_a_group_whose_own_rows_were_read_but_are_not_rlstream_rows_is_still_dead_lettered():
    # The rows are there and were read: lacking a field every staged call has, they are the group's
    # input, not a loss. Handing the group back would regenerate it for a fault of its publisher.
    store, task, rollouts, keys = _staged_group()
    tags = store.tags(STAGING, keys)
    for k in keys:
        store.put(STAGING, [k], _row(), [tags[k]])
    _receive(task, rollouts)
    commit = step(task, store)
    assert commit.regenerate == ()
    assert {d.error_kind for d in commit.dead_letters} == {dl.INCONSISTENT_GROUP}


def test_a_group_whose_rows_a_stale_mark_left_being_cleared_is_handed_back_not_fetched_again_forever():
    # Seeds 47, 390 and 174 (zombie mix): a restored-staging clear frozen at its clearing mark woke
    # after the keys' next owner had released their indexes and a later group's rows took them; the
    # mark made those rows not ready for good. TQ named one such row per get, the fetch gave up after
    # three gets (`StagingUnstable`), and every rebuilt step fetched the same rows again.
    tq, store = _tq_store()
    task = make_task(store)
    rollouts = make_group("g", 0, 1, shape=dataclasses.replace(TINY, calls=(2, 2)))
    stage_rollouts(store, rollouts)
    keys = [c.staging_key for r in rollouts for c in r.receipt.manifest]
    assert len(keys) >= 3
    _drive(tq._mark_clearing_in_controller(tq.kv_retrieve_meta(keys, STAGING)))
    for offset, r in enumerate(rollouts, start=10):
        task.intake(record(offset, r.receipt.to_bytes()), 5_000)
    commit = step(task, store)
    assert [r.group_id for r in commit.regenerate] == ["g"] and commit.dead_letters == ()
