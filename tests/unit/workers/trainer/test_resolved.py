"""The groups a checkpoint keeps resolved (issue 30): written and read back a message at a time, bound to
their state, refused when cut short or another checkpoint's; and carried into `load_state_dict`."""

from __future__ import annotations

import pytest

import workers.trainer.resolved as resolved_file
from workers.trainer.checkpoint import STATE_VERSION, ConsumerState, PartitionMark, decode_state, encode_state
from workers.trainer.errors import SpillError
from workers.trainer.resolved import RESOLVED_FILE, has_resolved, read_resolved, write_resolved


def test_resolved_groups_come_back_in_order_across_messages(tmp_path, monkeypatch):
    monkeypatch.setattr(resolved_file, "_PER_MESSAGE", 3)  # several messages from a few groups
    groups = [(f"g{i}", i % 2, 10 + i) for i in range(8)]
    write_resolved(tmp_path, "run:4", groups)
    assert has_resolved(tmp_path) and list(read_resolved(tmp_path, "run:4")) == groups
    write_resolved(tmp_path, "run:5", [])
    assert list(read_resolved(tmp_path, "run:5")) == []


def test_resolved_groups_cut_short_or_of_another_checkpoint_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(resolved_file, "_PER_MESSAGE", 2)
    write_resolved(tmp_path, "run:4", [(f"g{i}", 0, i) for i in range(5)])
    with pytest.raises(SpillError, match="written for checkpoint 'run:4', not 'run:9'"):
        list(read_resolved(tmp_path, "run:9"))
    path = tmp_path / RESOLVED_FILE
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) // 2, 3):
        path.write_bytes(whole[:cut])
        with pytest.raises(SpillError, match="cut short"):
            list(read_resolved(tmp_path, "run:4"))
    path.write_bytes(whole + b"x")
    with pytest.raises(SpillError, match="after its last message"):
        list(read_resolved(tmp_path, "run:4"))


def test_a_state_carries_resolved_groups_only_when_given_and_stays_readable_without(tmp_path):
    base = ConsumerState(STATE_VERSION, "t", "g", 3, 2, {0: PartitionMark(5, [])}, "run-a")
    data = encode_state(base)
    assert "resolved" not in data  # state_dict stays small; load_state adds them from the file
    data["resolved"] = [["g1", 0, 4]]
    assert decode_state(data, topic="t", consumer_group="g").resolved == [("g1", 0, 4)]


def test_the_resolved_file_is_synced_and_so_is_its_directory_after_the_rename(tmp_path, monkeypatch):
    # resume writes the file into a checkpoint already made the latest: the rename must be on disk too.
    import os
    import stat

    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_resolved(tmp_path, "run:1", [("g", 0, 1)])
    assert synced == [False, True]
