"""The trainer's fetch path over `TQStore`: select's lookup (`tags`) is the only one before materialize's data.

TQ is replaced by a fake (tests/unit/fake_tq.py) with its KV calls and its habit of giving the locations
of cleared rows to the next rows put; it counts round trips (a synchronous call, or one coroutine run
on its loop). Every test runs on rows of the packed layout (put through the store) and of the previous one (one
TQ field per tensor field, put by TQ's own API): a packed row is checked by the key it carries, a
row of the previous layout by a lookup sent once its data has arrived.
"""

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import TQStore
from tests.unit.fake_tq import FakeTQ

P = "rlstream.train"


@pytest.fixture
def tq():
    return FakeTQ()


@pytest.fixture
def store(tq):
    s = TQStore()
    s._tq = tq
    return s


@pytest.fixture(params=["packed", "per-field"])
def layout(request):
    return request.param


@pytest.fixture
def put(tq, store, layout):
    def put(keys: list[str], first: int) -> None:
        n = len(keys)
        values = torch.arange(first, first + n)
        fields = TensorDict({"x": values, "y": values * 10}, batch_size=[n])
        tags = [{"i": first + i} for i in range(n)]
        if layout == "packed":
            store.put(P, keys, fields, tags)
        else:  # TQ's own put: rows of the previous layout
            tq.kv_batch_put(keys, P, fields, tags)

    return put


KEYS = [f"g1_g{i}" for i in range(4)]


def test_a_get_of_the_keys_tags_found_reads_and_checks_them_in_one_round_trip(tq, store, put, layout):
    put(KEYS, 0)
    assert store.tags(P, KEYS) == {k: {"i": i} for i, k in enumerate(KEYS)}
    tq.round_trips = 0
    rows = store.get(P, KEYS)
    assert rows["x"].tolist() == [0, 1, 2, 3] and tq.round_trips == 1
    # A second materialize of the same batch (other fields, say) goes the same way.
    assert store.get(P, KEYS, select=["y"])["y"].tolist() == [0, 10, 20, 30] and tq.round_trips == 2


def test_a_get_without_tags_before_it_looks_the_keys_up_once_in_the_same_round_trip_as_the_data(tq, store, put, layout):
    put(KEYS, 0)
    tq.round_trips = 0
    assert store.get(P, KEYS[:2], select=["x"])["x"].tolist() == [0, 1]
    # The packed row's key is its check; a row of the previous layout is looked up again after the read.
    assert tq.lookups == (1 if layout == "packed" else 2) and tq.round_trips == 1


def test_rows_cleared_after_tags_are_missing_even_when_other_rows_took_their_locations(tq, store, put, layout):
    put(KEYS, 0)
    store.tags(P, KEYS)
    tq.kv_clear(KEYS, P)  # someone else's clear: the store cannot know
    put([f"other_g{i}" for i in range(4)], 100)  # reuses the cleared rows' locations
    with pytest.raises(MissingKeysError) as err:
        store.get(P, KEYS)
    assert err.value.missing == KEYS


def test_rows_put_again_after_tags_are_fetched_where_they_are_now(tq, store, put, layout):
    put(KEYS, 0)
    store.tags(P, KEYS)
    tq.kv_clear(KEYS, P)
    put([f"other_g{i}" for i in range(4)], 100)
    put(KEYS, 50)
    assert store.get(P, KEYS)["x"].tolist() == [50, 51, 52, 53]


def test_rows_cleared_between_lookup_and_fetch_are_named_missing(tq, store, put, monkeypatch):
    put(KEYS, 0)
    lookup = tq._meta

    def then_cleared(keys, partition_id):
        monkeypatch.setattr(tq, "_meta", lookup)  # once: the clear's own lookup goes through
        meta = lookup(keys, partition_id)
        tq.kv_clear(KEYS[1:2], P)
        return meta

    monkeypatch.setattr(tq, "_meta", then_cleared)
    with pytest.raises(MissingKeysError) as err:
        store.get(P, KEYS)
    assert err.value.missing == KEYS[1:2]


def test_a_clear_through_the_store_forgets_what_tags_found(tq, store, put, layout):
    put(KEYS, 0)
    store.tags(P, KEYS)
    store.clear(P, KEYS[:1])
    put(KEYS[:1], 7)
    tq.round_trips = 0
    assert store.get(P, KEYS)["x"].tolist() == [7, 1, 2, 3] and tq.round_trips == 1  # no check of stale places


def test_tags_of_keys_some_absent_cost_a_lookup_and_a_reverse_lookup_never_a_list_of_the_partition(tq, store, put):
    # select's check and the reassembler's look for an earlier attempt's rows both ask about keys that
    # may be absent; a list would read every key of the partition each time.
    put(KEYS, 0)
    put([f"other_g{i}" for i in range(64)], 100)
    tq.calls.clear()
    asked = [KEYS[2], "gone_g0", KEYS[0], "gone_g1"]
    assert store.tags(P, asked) == {KEYS[2]: {"i": 2}, KEYS[0]: {"i": 0}}
    assert tq.calls == {"meta": 1, "keys": 1}
    tq.calls.clear()
    assert store.tags(P, ["gone_g0"]) == {} and tq.calls == {"meta": 1}
