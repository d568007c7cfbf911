"""The staging sweeper: staged rows no receipt will use are cleared, and nothing an open group may need."""

from __future__ import annotations

import pytest

from streams.partitioner import partition_of
from streams.tq import STAGING
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
