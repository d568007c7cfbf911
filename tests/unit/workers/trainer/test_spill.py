"""Spilling TQ's rows into a checkpoint and putting chosen ones back (issue 24), against the in-memory store."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from streams.errors import MissingKeysError
from streams.tq import STAGING, TRAIN, TQStore
from tests.unit.fake_tq import FakeTQ
from tests.unit.memory_store import InMemoryStore
from workers.trainer.errors import SpillError
from workers.trainer.spill import SPILL_FILE, read_spill, spill_rows


def _stage(store: InMemoryStore) -> None:
    # Train rows of two lengths (jagged), staged calls of which one carries an extra field.
    for g, n in (("g0", 3), ("g1", 5)):
        ids = [f"{g}_g{i}" for i in range(2)]
        tokens = torch.nested.nested_tensor([torch.arange(n) + i for i in range(2)], layout=torch.jagged)
        fields = TensorDict({"input_ids": tokens, "total_reward": torch.tensor([0.5, 1.0])}, batch_size=[2])
        store.put(TRAIN, ids, fields, [{"group_id": g, "row": i} for i in range(2)])
    store.put(STAGING, ["g2-r0/c0"], TensorDict({"ids": torch.arange(4)[None]}, batch_size=[1]), [{"group_id": "g2"}])
    experts = TensorDict({"ids": torch.arange(2)[None], "routed": torch.ones(1, 2, 3, dtype=torch.uint8)}, [1])
    store.put(STAGING, ["g2-r1/c0"], experts, [{"group_id": "g2"}])


def _row(store, partition, key) -> dict:
    return {k: v[0] if v.is_nested else v[0] for k, v in store.get(partition, [key]).items()}


def test_spilled_rows_come_back_as_they_were_with_their_tags_and_only_those_asked_for(tmp_path):
    before = InMemoryStore()
    _stage(before)
    summary = spill_rows(before, tmp_path, binding="ckpt-3")
    assert summary.rows == {TRAIN: 4, STAGING: 2} and summary.gone == 0

    spill = read_spill(tmp_path, binding="ckpt-3")
    assert spill.keys(TRAIN) == {"g0_g0", "g0_g1", "g1_g0", "g1_g1"}
    after = InMemoryStore()
    assert spill.restore(after, TRAIN, ["g1_g1", "g0_g0", "nowhere"]) == 2
    assert spill.restore(after, STAGING, ["g2-r0/c0", "g2-r1/c0"]) == 2
    assert after.list(TRAIN).keys() == {"g1_g1", "g0_g0"}
    for partition, key in ((TRAIN, "g1_g1"), (TRAIN, "g0_g0"), (STAGING, "g2-r0/c0"), (STAGING, "g2-r1/c0")):
        want, got = _row(before, partition, key), _row(after, partition, key)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), (partition, key)
        assert after.tags(partition, [key]) == before.tags(partition, [key])


class _Vanishing(InMemoryStore):
    """Rows cleared between the list and the read, as a running pipeline clears them."""

    def __init__(self, gone: set[str]):
        super().__init__()
        self.gone = gone

    def get(self, partition, keys, select=None):
        missing = [k for k in keys if k in self.gone]
        if missing:
            raise MissingKeysError(partition, missing)
        return super().get(partition, keys, select)


def test_a_row_gone_while_the_spill_reads_is_left_out_not_guessed(tmp_path):
    store = _Vanishing({"g0_g1"})
    _stage(store)
    summary = spill_rows(store, tmp_path, binding="b")
    assert summary.rows[TRAIN] == 3 and summary.gone == 1
    assert "g0_g1" not in read_spill(tmp_path, binding="b").keys(TRAIN)


def test_a_spill_cut_short_missing_or_of_another_checkpoint_is_refused(tmp_path):
    store = InMemoryStore()
    _stage(store)
    spill_rows(store, tmp_path, binding="ckpt-3")
    with pytest.raises(SpillError, match="written for checkpoint 'ckpt-3', not 'ckpt-4'"):
        read_spill(tmp_path, binding="ckpt-4")
    path = tmp_path / SPILL_FILE
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 30, 9):
        path.write_bytes(whole[:cut])
        with pytest.raises(SpillError, match="cut short"):
            read_spill(tmp_path, binding="ckpt-3")
    path.unlink()
    with pytest.raises(SpillError, match="cannot read"):
        read_spill(tmp_path, binding="ckpt-3")


def test_a_row_a_stale_clear_deleted_under_its_key_is_left_out_and_the_spill_completes(tmp_path):
    # TQ still maps g0_g1 (ready, tagged) but its storage was deleted by a clear whose lookup went
    # stale: the spill reads it as gone, as a row cleared meanwhile, instead of failing the checkpoint.
    tq = FakeTQ()
    store = TQStore()
    store._tq = tq
    _stage(store)
    tq.stale_clear(TRAIN, "g0_g1", looked_up_in=STAGING)
    summary = spill_rows(store, tmp_path, binding="ckpt-4", partitions=(TRAIN,))
    assert summary.rows == {TRAIN: 3} and summary.gone == 1
    assert read_spill(tmp_path, binding="ckpt-4").keys(TRAIN) == {"g0_g0", "g1_g0", "g1_g1"}
