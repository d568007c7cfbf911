"""Rows TQ cannot settle now (`RowsUnsettled`: they kept moving while read, or its controller failed while a
read was checked) are "not now" for the trainer, over the in-memory Kafka: the batch goes back and its
groups wait to be selected again, nothing is dead-lettered or handed back, and the loops around
materialize select again instead of raising into the framework (issue 30 review, item 5)."""

from __future__ import annotations

import pytest

from streams.errors import RowsUnsettled
from streams.tq import TRAIN
from tests.unit.workers.trainer.trainer_kafka import Pipeline, group
from workers.trainer.dataset import ExperienceDataset
from workers.trainer.spill import spill_rows
from workers.trainer.spill_read import read_spill


class Unsettled:
    """The pipeline's store with its next `times` gets of train rows unsettled."""

    def __init__(self, store, times: int = 1):
        self._store, self.times = store, times

    def get(self, partition, keys, select=None):
        if self.times and partition == TRAIN:
            self.times -= 1
            raise RowsUnsettled(f"rows of {len(keys)} key(s) of TQ partition {partition!r} kept moving")
        return self._store.get(partition, keys, select)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _pipeline(groups: int = 2) -> Pipeline:
    pipe = Pipeline()
    pipe.finalize([group(f"g{i}") for i in range(groups)])
    pipe.store = Unsettled(pipe.store)
    return pipe


def _select(consumer, n: int = 2):
    for _ in range(50):
        consumer.poll(0)
        meta = consumer.select(10, min_groups=n, max_groups=n, timeout_s=0.0)
        if meta is not None:
            return meta
    raise AssertionError("no batch")


def test_materialize_gives_an_unsettled_batch_back_and_its_groups_are_selected_again():
    pipe = _pipeline()
    consumer = pipe.consumer()
    meta = _select(consumer)
    with pytest.raises(RowsUnsettled):
        consumer.materialize(meta)
    again = _select(consumer)  # the same groups, waiting again: not dead-lettered, not handed back
    assert sorted(g.group_id for g in again.groups) == ["g0", "g1"]
    assert consumer.counts.lost == 0 and consumer.counts.missing_rows == 0
    consumer.materialize(again)
    consumer.ack(again)


def test_next_batch_waits_out_unsettled_rows():
    pipe = _pipeline()
    consumer = pipe.consumer()
    for _ in range(50):
        consumer.poll(0)
        batch = consumer.next_batch(2, timeout_s=0.0)
        if batch is not None:
            break
    assert batch is not None and sorted(g.group_id for g in batch.groups) == ["g0", "g1"]


def test_the_dataset_selects_again_after_an_unsettled_batch():
    pipe = _pipeline()
    consumer = pipe.consumer()
    for _ in range(5):
        consumer.poll(0)
    dataset = ExperienceDataset(consumer, version=lambda: 10, min_groups=2, max_groups=2, poll_s=0.0)
    batch = next(iter(dataset))
    assert sorted(batch.get_non_tensor("group_ids")) == ["g0", "g1"]


def test_a_spill_reads_unsettled_rows_again_and_keeps_them(tmp_path):
    pipe = _pipeline()
    summary = spill_rows(pipe.store, tmp_path, binding="b", partitions=(TRAIN,))
    assert summary.rows[TRAIN] == 4 and summary.gone == 0
    assert read_spill(tmp_path, binding="b").keys(TRAIN) == {"g0_g0", "g0_g1", "g1_g0", "g1_g1"}


class UnsettledLookup(Unsettled):
    """The pipeline's store with its next `times` lookups of train rows' tags unsettled (which are present
    is not known: TQ's controller failed during the reverse lookup)."""

    def get(self, partition, keys, select=None):
        return self._store.get(partition, keys, select)

    def tags(self, partition, keys):
        if self.times and partition == TRAIN:
            self.times -= 1
            raise RowsUnsettled(f"TQ lookup of {len(keys)} key(s) in {partition!r}: which are present")
        return self._store.tags(partition, keys)


def test_select_waits_out_a_lookup_tq_cannot_answer_now_and_hands_out_the_groups_after():
    pipe = Pipeline()
    pipe.finalize([group(f"g{i}") for i in range(2)])
    pipe.store = UnsettledLookup(pipe.store)
    consumer = pipe.consumer()
    meta = _select(consumer)
    assert sorted(g.group_id for g in meta.groups) == ["g0", "g1"] and pipe.store.times == 0
    assert consumer.counts.missing_rows == 0
