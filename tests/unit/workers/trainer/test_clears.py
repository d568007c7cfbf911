"""When a resolved record's rows leave TQ: once a commit names the record (plain), or a durable cut covers it."""

import torch
from tensordict import TensorDict

from tests.unit.memory_store import InMemoryStore
from workers.trainer.clears import RowClears
from workers.trainer.position import PartitionPosition


def _put(store: InMemoryStore, ids: list[str]) -> None:
    store.put("train", ids, TensorDict({"x": torch.zeros(len(ids), 2)}, batch_size=[len(ids)]), [{} for _ in ids])


def test_deferred_rows_stay_until_a_cut_covering_them_is_released():
    store = InMemoryStore()
    _put(store, ["a", "b", "c"])
    clears = RowClears(store, "train", deferred=True)
    clears.clear(["a"], 0, 5)
    cut = clears.cut
    clears.clear(["b"], 0, 6)
    assert store.present("train", ["a", "b", "c"]) == {"a", "b", "c"}
    assert clears.due_through(cut) and not clears.due_through(0)
    assert clears.release_through(cut) == 1
    assert store.present("train", ["a", "b", "c"]) == {"b", "c"}
    assert clears.kept_rows == 1


def test_without_checkpoints_rows_wait_for_a_commit_naming_their_record():
    store = InMemoryStore()
    _put(store, ["a", "b"])
    clears = RowClears(store, "train", deferred=False)
    clears.clear(["a"], 0, 5)
    clears.clear(["b"], 1, 9)
    assert store.present("train", ["a", "b"]) == {"a", "b"}  # nothing committed yet
    assert clears.held(0) == [5] and clears.held(1) == [9]
    assert clears.release_named(lambda part, offset: (part, offset) == (0, 5)) == 1
    assert store.present("train", ["a", "b"]) == {"b"} and clears.held(0) == []
    clears.drop(1)  # revoked: its next owner deals with the record's rows
    assert clears.release_named(lambda part, offset: True) == 0 and store.present("train", ["b"]) == {"b"}


def test_a_failed_clear_forgets_nothing():
    class Down(InMemoryStore):
        def clear(self, partition, keys):
            raise ConnectionError("TQ down")

    clears = RowClears(Down(), "train", deferred=False)
    clears.clear(["a"], 0, 5)
    try:
        clears.release_named(lambda part, offset: True)
    except ConnectionError:
        pass
    assert clears.held(0) == [5]


def test_a_commit_stops_at_a_held_record_and_names_it_resolved():
    position = PartitionPosition.from_commit(3)
    for offset in range(3, 8):
        position.read(offset)
    for offset in (3, 4, 6, 7):
        position.resolve(offset)
    # 5 is unresolved; 6 and 7 are resolved but their rows not cleared yet.
    offset, ranges = position.commit_point([5], held=[3, 4])
    assert (offset, ranges) == (3, [(3, 4), (6, 7)])
    position.committed = (offset, tuple(ranges))
    assert position.names(3) and position.names(7) and not position.names(5)
    assert position.commit_point([5]) == (5, [(6, 7)])  # rows gone: the offset passes them
    assert not PartitionPosition().names(0)  # nothing committed: nothing named
