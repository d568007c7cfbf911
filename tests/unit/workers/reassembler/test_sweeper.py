"""The staging sweeper: staged rows no receipt will use are cleared, and nothing an open group may need."""

from __future__ import annotations

import pytest
import torch

from schemas.payload import group_sample_ids
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN
from tests.unit.manual_runtime import ManualRuntime
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.restore import restore_partition
from workers.reassembler.sweeper import StagingSweeper
from workers.reassembler.task import PartitionTask
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import SyntheticShape, make_group

from .fixtures import record

TINY = SyntheticShape(group_size=2, calls=(1, 1), prompt_len=(2, 3), answer_len=(1, 2), observation_len=(1, 1))
CONFIG = ReassemblerConfig(prefix="t", worker_id="w0", staging_sweep_age_s=600, staging_sweep_interval_s=60)
PARTS = 4
HOUR_MS = 3_600_000


def _group_in(partition: int, start: int = 0) -> str:
    """A prompt group id whose receipts land in `partition` of a PARTS-partition topic."""
    for i in range(start, start + 10_000):
        gid = f"g{i}"
        if partition_of(gid.encode(), PARTS) == partition:
            return gid
    raise AssertionError("no such group id")


def _stage(store, group_id, staged_at_ms):
    rollouts = make_group(group_id, 0, 1, shape=TINY)
    stage_rollouts(store, rollouts)
    for key, tags in store.list(STAGING).items():
        if tags["group_id"] == group_id:
            store._rows[STAGING][key][1]["staged_at_ms"] = staged_at_ms
    return rollouts


def _task(store, partition):
    return PartitionTask.resume(restore_partition(partition, []), store, CONFIG)


def _runtime() -> ManualRuntime:
    """Monotonic time from 0, wall time an hour after the epoch."""
    return ManualRuntime(0.0, wall_now_ms=HOUR_MS)


def test_old_rows_nobody_opened_are_swept_by_their_partitions_owner_once_it_is_read_to_the_end():
    store, runtime = InMemoryStore(), _runtime()
    orphan = _group_in(0)  # staged, then its publish failed: no receipt ever names its rows
    _stage(store, orphan, staged_at_ms=0)
    sweeper = StagingSweeper(store, CONFIG, runtime=runtime)
    tasks = {0: _task(store, 0)}
    assert not sweeper.due()
    runtime.now = 61
    assert sweeper.due()
    # Behind its end, a receipt naming the rows may still be unread: nothing is swept.
    assert sweeper.sweep(tasks, caught_up={0: False}, partitions=PARTS) == 0
    assert sweeper.sweep(tasks, caught_up={0: True}, partitions=PARTS) == 2
    assert store.list(STAGING) == {}


def test_rows_of_an_open_group_young_rows_and_other_partitions_rows_are_kept():
    store, runtime = InMemoryStore(), _runtime()
    open_gid, young, elsewhere = _group_in(0), _group_in(0, 5_000), _group_in(1)
    rollouts = _stage(store, open_gid, staged_at_ms=0)
    _stage(store, young, staged_at_ms=HOUR_MS - 1_000)
    _stage(store, elsewhere, staged_at_ms=0)
    task = _task(store, 0)
    task.intake(record(0, rollouts[0].receipt.to_bytes()), HOUR_MS)  # the group is open, waiting for rollout 1
    sweeper = StagingSweeper(store, CONFIG, runtime=runtime)
    assert sweeper.sweep({0: task}, caught_up={0: True}, partitions=PARTS) == 0
    assert len(store.list(STAGING)) == 6


def test_a_row_staged_without_a_time_is_aged_from_when_the_sweeper_first_saw_it():
    store, runtime = InMemoryStore(), _runtime()
    gid = _group_in(2)
    _stage(store, gid, staged_at_ms=0)
    for key in store.list(STAGING):
        del store._rows[STAGING][key][1]["staged_at_ms"]  # staged by an older publisher
    sweeper = StagingSweeper(store, CONFIG, runtime=runtime)
    tasks = {2: _task(store, 2)}
    assert sweeper.sweep(tasks, caught_up={2: True}, partitions=PARTS) == 0
    runtime.wall_now_ms += 600_000
    assert sweeper.sweep(tasks, caught_up={2: True}, partitions=PARTS) == 2


def test_the_sweep_age_must_stay_above_the_group_timeout():
    from streams.errors import ConfigError

    with pytest.raises(ConfigError, match="staging_sweep_age_s"):
        ReassemblerConfig(group_timeout_s=30.0, staging_sweep_age_s=30.0)


def _train_rows(store, group_id, tags):
    """Train rows of `group_id` as a put leaves them: `tags` None for a put cut off after its index
    lookup (TQ registered its keys, untagged, and it never set their custom meta), else tagged."""
    from tensordict import TensorDict

    keys = group_sample_ids(group_id, 2)
    fields = TensorDict({"x": torch.zeros(2, 1)}, batch_size=[2])
    store.put(TRAIN, keys, fields, [{} if tags is None else {**tags, "group_id": group_id}] * 2)
    return keys


def test_train_rows_a_put_cut_off_after_its_index_lookup_left_are_swept_once_old():
    # A zombie frozen inside its put (past its lease check) woke after its successor had finalized the
    # group and the trainer had trained and cleared it: its put registered the keys again and was given
    # up at its deadline before tagging them. No record names them; nothing else would clear them
    # (the explorer's seed 9881).
    store, runtime = InMemoryStore(), _runtime()
    orphan = _train_rows(store, _group_in(0), tags=None)
    sweeper = StagingSweeper(store, CONFIG, runtime=runtime)
    tasks = {0: _task(store, 0)}
    assert sweeper.sweep(tasks, caught_up={0: True}, partitions=PARTS) == 0  # first seen now: a put may be on its way
    runtime.wall_now_ms += 600_000
    assert sweeper.sweep(tasks, caught_up={0: True}, partitions=PARTS) == len(orphan)
    assert store.list(TRAIN) == {}


def test_tagged_train_rows_and_untagged_ones_of_others_or_of_open_groups_are_kept():
    store, runtime = InMemoryStore(), _runtime()
    committed = _train_rows(store, _group_in(0), tags={"attempt": [0, 0]})  # a record names them: the trainer's
    elsewhere = _train_rows(store, _group_in(1), tags=None)  # another worker's partition
    open_gid = _group_in(0, 5_000)
    rollouts = _stage(store, open_gid, staged_at_ms=HOUR_MS)
    opened = _train_rows(store, open_gid, tags=None)  # its owner's own put will set them
    foreign = "not-a-sample-id"
    store._rows[TRAIN][foreign] = ({}, {})
    task = _task(store, 0)
    task.intake(record(0, rollouts[0].receipt.to_bytes()), HOUR_MS)
    sweeper = StagingSweeper(store, CONFIG, runtime=runtime)
    for _ in range(3):
        assert sweeper.sweep({0: task}, caught_up={0: True}, partitions=PARTS) == 0
        runtime.wall_now_ms += 600_000
    assert set(store.list(TRAIN)) == {*committed, *elsewhere, *opened, foreign}
