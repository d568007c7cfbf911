"""The trainer's fetch path over `TQStore`: select's lookup (`tags`) is the only one before materialize's data.

TQ is replaced by a fake with its KV calls and its habit of giving the locations of cleared rows to
the next rows put; it counts round trips (a synchronous call, or one coroutine run on its loop).
Every test runs on rows of the packed layout (put through the store) and of the previous one (one
TQ field per tensor field, put by TQ's own API): a packed row is checked by the key it carries, a
row of the previous layout by a lookup sent once its data has arrived.
"""

import asyncio

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import TQStore

P = "rlstream.train"


class FakeMeta:
    def __init__(self, indexes: list[int], tags: list[dict], fields: list[str]):
        self.global_indexes, self.custom_meta, self.field_names = indexes, tags, fields
        self.size, self.is_ready = len(indexes), True

    def select_fields(self, names: list[str]) -> "FakeMeta":
        return FakeMeta(self.global_indexes, self.custom_meta, [f for f in self.field_names if f in names])


class FakeTQ:
    """TQ's module and client in one: rows by location, locations of cleared rows reused first."""

    class StorageKeyNotFoundError(KeyError):
        pass

    def __init__(self):
        self.where: dict[tuple[str, str], int] = {}
        self.rows: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
        self.free: list[int] = []
        self.round_trips = self.lookups = 0

    def get_client(self):
        return self

    def kv_batch_put(self, keys, partition_id, fields, tags):
        for i, key in enumerate(keys):
            if (partition_id, key) not in self.where:
                self.where[partition_id, key] = self.free.pop(0) if self.free else len(self.rows) + len(self.free)
            self.rows[self.where[partition_id, key]] = ({n: fields.get(n)[i] for n in fields.keys()}, tags[i])  # noqa: SIM118

    def kv_clear(self, keys, partition_id):
        for key in keys:
            if (at := self.where.pop((partition_id, key), None)) is not None:
                del self.rows[at]
                self.free.append(at)

    def kv_list(self, partition_id):
        return {partition_id: {k: self.rows[at][1] for (p, k), at in self.where.items() if p == partition_id}}

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        self.round_trips += 1
        meta = self._meta(keys, partition_id)
        return self._data(meta if select_fields is None else meta.select_fields(select_fields))

    def _meta(self, keys, partition_id) -> FakeMeta:
        self.lookups += 1
        at = [self.where[partition_id, k] for k in keys if (partition_id, k) in self.where]
        fields = sorted(self.rows[at[0]][0]) if at else []
        return FakeMeta(at, [self.rows[i][1] for i in at], fields)

    def _data(self, meta: FakeMeta) -> TensorDict:
        if any(i not in self.rows for i in meta.global_indexes):
            raise self.StorageKeyNotFoundError("gone")
        out = {}
        for f in meta.field_names:
            rows = [self.rows[i][0][f] for i in meta.global_indexes]
            # As TQ's get: 0-dim rows stacked, others rebuilt as a jagged nested tensor.
            dense = all(r.dim() == 0 for r in rows)
            out[f] = torch.stack(rows) if dense else torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        return TensorDict(out, batch_size=[meta.size])

    def kv_retrieve_meta(self, keys, partition_id, create=False):
        self.round_trips += 1
        return self._meta(keys, partition_id)

    def get_data(self, metadata):
        self.round_trips += 1
        return self._data(metadata)

    async def async_kv_retrieve_meta(self, keys, partition_id, create=False):
        return self._meta(keys, partition_id)

    async def async_get_data(self, metadata):
        return self._data(metadata)

    def _run_coroutine(self, coro):
        self.round_trips += 1
        return asyncio.run(coro)


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
