"""A TQ index that changed hands: a row gone or foreign under its key reads as missing, and a clear never
deletes an index that changed hands since its lookup (issue 30, item 1).

TQ is the fake of tests/unit/fake_tq.py: a controller (keys -> global indexes, per partition) apart
from storage (rows by global index only), one FIFO pool of freed indexes for every partition, and a
clear in TQ's own steps (lookup, clearing mark, storage clear, release), between which a test steps
in as a frozen process would let the rest of the job go on.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from streams.errors import ClearRefused, MissingKeysError
from streams.tq import STAGING, TRAIN, TQStore, with_clear_guard
from tests.unit.fake_tq import FakeTQ
from tests.unit.manual_runtime import ManualRuntime
from workers.reassembler.lease import Lease


@pytest.fixture
def tq():
    return FakeTQ()


@pytest.fixture
def store(tq):
    s = TQStore()
    s._tq = tq
    return s


def _rows(*values: int) -> TensorDict:
    x = torch.tensor(values)
    return TensorDict({"x": x, "y": x * 10}, batch_size=[len(values)])


def _successor_clears_and_a_train_put_reuses(tq: FakeTQ, store: TQStore, key: str, train_key: str):
    """What the rest of the job does while a clear of `key` is frozen: its new owner clears it, and the
    next put (a train row, another partition) is handed its freed index."""

    def go(_):
        index = tq.where[STAGING, key]
        tq.kv_clear([key], STAGING)
        store.put(TRAIN, [train_key], _rows(7), [{"group_id": "g2"}])
        assert tq.where[TRAIN, train_key] == index, "the train row did not take the freed index"

    return go


# ----- reads: a row gone or foreign under its key -----------------------------------------------


def _stale_clear_deletes(tq: FakeTQ, store: TQStore, victim: str) -> None:
    """A clear whose lookup went stale, done in TQ's own steps: it deletes `victim`'s storage (the key
    that took the index) while the controller keeps `victim` mapped and ready."""
    store.put(STAGING, ["old/0"], _rows(1), [{}])
    stale = tq.kv_retrieve_meta(["old/0"], STAGING)
    tq.kv_clear(["old/0"], STAGING)  # cleared by its new owner meanwhile
    store.put(TRAIN, [victim], _rows(5), [{"group_id": "g"}])  # the freed index, to a train row
    assert tq.where[TRAIN, victim] == stale.global_indexes[0]
    tq._run_coroutine(tq.async_clear_samples(stale))  # the stale clear goes on: storage cleared by index


@pytest.mark.parametrize("located", [False, True], ids=["looked-up-by-get", "located-by-tags"])
def test_a_row_whose_storage_a_stale_clear_deleted_reads_as_missing_not_as_a_crash(tq, store, located):
    store.put(TRAIN, ["g_g1"], _rows(6), [{"group_id": "g"}])
    _stale_clear_deletes(tq, store, "g_g0")
    assert tq.where[TRAIN, "g_g0"] is not None and "g_g0" in store.list(TRAIN)  # the controller still maps it
    if located:
        assert set(store.tags(TRAIN, ["g_g0", "g_g1"])) == {"g_g0", "g_g1"}
    with pytest.raises(MissingKeysError) as err:
        store.get(TRAIN, ["g_g0", "g_g1"])
    assert err.value.missing == ["g_g0"]
    # The row next to it is read as usual, and the gone row again reads as missing (no crash either time).
    assert store.get(TRAIN, ["g_g1"])["x"].tolist() == [6]
    with pytest.raises(MissingKeysError):
        store.get(TRAIN, ["g_g0"])


def test_a_row_a_late_put_of_another_key_overwrote_reads_as_missing(tq, store):
    # Trigger (b): a put whose indexes were given, then the key cleared (its owner, or a retry racing
    # a clear) and the index handed to a train row, before the put's storage write lands.
    tq.on("put_located", lambda at: _reuse_before_write(tq, store))
    store.put(STAGING, ["r1/0"], _rows(1), [{"group_id": "g1"}])
    assert tq.where.get((STAGING, "r1/0")) is None and tq.where[TRAIN, "g2_g0"] is not None
    # Storage at the train row's index now holds r1/0's packed row: foreign to g2_g0.
    with pytest.raises(MissingKeysError) as err:
        store.get(TRAIN, ["g2_g0", "g2_g1"])
    assert err.value.missing == ["g2_g0"]


def _reuse_before_write(tq: FakeTQ, store: TQStore) -> None:
    tq.kv_clear(["r1/0"], STAGING)
    store.put(TRAIN, ["g2_g0", "g2_g1"], _rows(7, 8), [{"group_id": "g2"}] * 2)


def test_among_many_rows_only_the_gone_ones_are_named_missing(tq, store):
    keys = [f"g_g{i}" for i in range(1, 9)]
    store.put(TRAIN, keys, _rows(*range(1, 9)), [{"group_id": "g"}] * 8)
    _stale_clear_deletes(tq, store, "g_g0")
    with pytest.raises(MissingKeysError) as err:
        store.get(TRAIN, ["g_g3", "g_g0", *keys])
    assert err.value.missing == ["g_g0"]


def test_rows_that_only_moved_are_read_where_they_are_now(tq, store):
    store.put(TRAIN, ["a", "b"], _rows(1, 2), [{}, {}])

    def move_a(_):
        # After the get's lookup, before its read: `a` cleared and put again (at another index).
        tq.kv_clear(["a"], TRAIN)
        store.put(TRAIN, ["x"], _rows(9), [{}])  # takes a's old index
        store.put(TRAIN, ["a"], _rows(3), [{}])

    tq.on("read", move_a)
    assert store.get(TRAIN, ["a", "b"])["x"].tolist() == [3, 2]


# ----- clears: never an index that changed hands since the lookup --------------------------------


def test_a_clear_whose_lookup_went_stale_deletes_nothing_that_changed_hands(tq, store):
    store.put(STAGING, ["r1/0", "r1/1"], _rows(1, 2), [{}, {}])
    own = tq.where[STAGING, "r1/1"]
    # Frozen after its lookup, before it marks: the key changes hands meanwhile.
    tq.on("mark", _successor_clears_and_a_train_put_reuses(tq, store, "r1/0", "g2_g0"))
    store.clear(STAGING, ["r1/0", "r1/1"])
    assert store.get(TRAIN, ["g2_g0"])["x"].tolist() == [7]  # the new owner's row is whole
    assert "r1/1" not in store.list(STAGING)  # the key still its own was cleared
    assert tq.free == [own]  # and only its index went back to the pool


def _a_and_b_cleared_then_b_staged_again_at_as_old_index(tq: FakeTQ, store: TQStore, a: str, b: str):
    """The review's e2 interleaving, while a clear of [a, b] is frozen after its lookup: the keys' next
    owner clears both (freed first in first out: a's index, then b's), and b is staged again (a
    publisher's retry), taking a's old index. Every key of the stale lookup still names a key of the
    clear, only not the one each index was looked up for."""
    index_a = tq.where[STAGING, a]

    def go(_):
        tq.kv_clear([a, b], STAGING)
        store.put(STAGING, [b], _rows(22), [{"again": True}])
        assert tq.where[STAGING, b] == index_a, "b was not handed a's old index"

    return go


@pytest.mark.parametrize("asked", [["A", "B"], ["A", "absent", "B"]], ids=["all-present", "one-absent"])
def test_a_stale_clear_never_deletes_a_key_of_its_own_that_took_another_keys_index(tq, store, asked):
    # The check compares each index with the key it was looked up for, not with the set of keys: B
    # staged again at A's old index is not the row the stale lookup found for A.
    store.put(STAGING, ["A", "B"], _rows(1, 2), [{}, {}])
    tq.on("mark", _a_and_b_cleared_then_b_staged_again_at_as_old_index(tq, store, "A", "B"))
    store.clear(STAGING, asked)
    new_b = tq.where[STAGING, "B"]
    assert new_b in tq.rows and tq.rows[new_b]  # B's new row is whole in storage ...
    assert new_b not in tq.free and "B" in store.list(STAGING)  # ... and its index never released
    tq.kv_clear(["B"], STAGING)  # the stale mark left it being cleared: its owner's clear takes it
    assert store.list(STAGING) == {} and tq.rows == {}


def test_a_stale_clear_leaves_a_row_of_its_own_partition_that_took_the_index_alone(tq, store):
    store.put(STAGING, ["r1/0"], _rows(1), [{}])

    def reuse_in_staging(_):
        tq.kv_clear(["r1/0"], STAGING)
        store.put(STAGING, ["r2/0"], _rows(4), [{"group_id": "g2"}])

    tq.on("mark", reuse_in_staging)
    store.clear(STAGING, ["r1/0"])
    # Marked "being cleared" by the stale mark (a row not ready reads as missing); never deleted.
    assert tq.where[STAGING, "r2/0"] in tq.rows
    assert "r2/0" in store.list(STAGING)


def test_a_clear_frozen_after_its_check_gives_up_when_the_lease_saw_the_freeze(tq, store):
    clock = ManualRuntime(100.0)
    lease = Lease(6.0, 60.0, runtime=clock, watch=False)
    store.put(STAGING, ["r1/0"], _rows(1), [{}])
    successor = _successor_clears_and_a_train_put_reuses(tq, store, "r1/0", "g2_g0")

    def frozen_after_the_check(keys):
        clock.now += 30.0  # SIGSTOPped past the session timeout: its partitions moved on
        successor(keys)

    tq.on("keys", frozen_after_the_check)
    with pytest.raises(ClearRefused, match="frozen"):
        store.clear(STAGING, ["r1/0"], guard=lease.refusal)
    assert store.get(TRAIN, ["g2_g0"])["x"].tolist() == [7]


def test_a_guarded_store_asks_its_guard_before_every_clear_request(tq, store):
    asked = []
    guarded = with_clear_guard(store, lambda: asked.append(len(asked)) or None)
    store.put(STAGING, ["r1/0"], _rows(1), [{}])
    guarded.clear(STAGING, ["r1/0"])
    assert asked == [0, 1, 2]  # before the mark, the storage clear and the release
    assert "r1/0" not in store.list(STAGING)
    refusing = with_clear_guard(store, lambda: "the lease says no")
    store.put(STAGING, ["r1/1"], _rows(1), [{}])
    with pytest.raises(ClearRefused, match="the lease says no"):
        refusing.clear(STAGING, ["r1/1"])
    assert "r1/1" in store.list(STAGING)  # refused before its mark: nothing changed


def test_a_clear_is_one_round_trip_and_clears_the_keys_found(tq, store):
    store.put(STAGING, ["a", "b"], _rows(1, 2), [{}, {}])
    tq.round_trips = 0
    store.clear(STAGING, ["a", "nope", "b"])
    assert tq.round_trips == 1 and store.list(STAGING) == {} and tq.rows == {}
