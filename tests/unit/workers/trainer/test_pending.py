"""The trainer's pending groups (`PendingGroups`): duplicates never yielded twice, never orphaning rows, never
destroying rows of a group not yet trained; records read again after a rebalance are no duplicates."""

import pytest
import torch
from tensordict import TensorDict

from schemas.finalized import FinalizedGroup
from tests.unit.memory_store import InMemoryStore
from tests.unit.workers.trainer.trainer_kafka import GROUP, NAMES, Pipeline, group
from workers.trainer.errors import IllegalTransition
from workers.trainer.pending import DUPLICATE, NEW, REREAD, Pending, PendingGroups, PendingState
from workers.trainer.policies import Decision

TRAIN = "train"


def _group(group_id: str, rows: int = 2) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=group_id,
        prompt_idx=0,
        partition_id="p",
        sample_ids=tuple(f"{group_id}_g{i}" for i in range(rows)),
        tags=tuple({} for _ in range(rows)),
        group_min_wv=0,
        group_max_wv=0,
        canonical_output_tokens=1,
        valid_row_count=rows,
        total_row_count=rows,
        rejection_reasons=(None,) * rows,
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
    )


def _put(store, group):
    ids = list(group.sample_ids)
    store.put(TRAIN, ids, TensorDict({"x": torch.zeros(len(ids), 2)}, batch_size=[len(ids)]), [{}] * len(ids))


def _groups():
    store = InMemoryStore()
    return store, PendingGroups(store, TRAIN, max_seen_groups=100)


def _take(groups, group, partition, offset):
    return groups.take(group, partition, offset, resolved_before=groups.read(partition, offset))


def test_a_duplicate_of_a_waiting_group_keeps_the_shared_rows_and_waits_for_it():
    store, groups = _groups()
    original, bigger = _group("a"), _group("a", rows=3)
    _put(store, bigger)
    outcome, pending = _take(groups, original, 0, 0)
    assert outcome == NEW and pending is not None
    assert _take(groups, bigger, 0, 1) == (DUPLICATE, None)
    assert store.present(TRAIN, list(bigger.sample_ids)) == set(bigger.sample_ids)
    # Neither record is resolved: the commit stays at the original.
    assert groups.commit_points(lambda p: [])[0][:2] == (0, 0)
    pending.move(PendingState.READY)
    pending.move(PendingState.YIELDED)
    store.clear(TRAIN, list(original.sample_ids))  # what release does
    groups.release(original, 0, 0)
    assert store.present(TRAIN, list(bigger.sample_ids)) == set()  # the duplicate's extra row too
    assert groups.commit_points(lambda p: [])[0][:2] == (0, 2)


def test_a_duplicate_of_a_released_group_has_its_rows_cleared_at_once():
    store, groups = _groups()
    group = _group("b")
    _, pending = _take(groups, group, 1, 5)
    groups.release(group, 1, 5)
    _put(store, group)  # put again by whoever published the duplicate
    assert _take(groups, group, 1, 9) == (DUPLICATE, None)
    assert store.present(TRAIN, list(group.sample_ids)) == set()
    assert groups.commit_points(lambda p: [])[0][:2] == (1, 10)


def test_a_yielded_group_read_again_after_a_rebalance_waits_for_its_release():
    store, groups = _groups()
    group = _group("c")
    _put(store, group)
    _, pending = _take(groups, group, 2, 3)
    pending.move(PendingState.READY)
    pending.move(PendingState.YIELDED)
    groups.revoke(2)
    groups.assign(2, 3, [])
    assert _take(groups, group, 2, 3) == (REREAD, None)
    assert groups.commit_points(lambda p: []) == []  # still at 3: the trainer holds the group
    assert store.present(TRAIN, list(group.sample_ids)) == set(group.sample_ids)
    groups.release(group, 2, 3)
    assert groups.commit_points(lambda p: [])[0][:2] == (2, 4)


def test_a_held_group_of_a_revoked_partition_is_taken_in_again_as_new():
    _, groups = _groups()
    group = _group("d")
    _take(groups, group, 0, 0)
    groups.revoke(0)
    assert _take(groups, group, 0, 0)[0] == NEW


def test_records_resolved_before_a_restart_are_rereads_and_their_rows_are_not_needed():
    _, groups = _groups()
    groups.assign(0, 4, [])
    groups.read(0, 4)
    groups.positions[0].resolve(4)
    groups.read(0, 5)
    ((part, offset, ranges),) = groups.commit_points(lambda p: [5])
    assert (offset, ranges) == (5, [])
    successor = PendingGroups(InMemoryStore(), TRAIN, max_seen_groups=100)
    successor.assign(part, offset, ranges)
    assert _take(successor, _group("e"), 0, 5)[0] == NEW
    assert successor.read(0, 6) is False


def test_a_group_whose_letter_was_dropped_unsent_with_its_partition_is_new_when_read_again():
    _, groups = _groups()
    group = _group("lost")
    _, pending = _take(groups, group, 0, 10)
    # Its rows were missing: a letter holds the commit back; the group counts as consumed meanwhile.
    groups.set_aside(pending)
    groups.group_resolved(group)
    groups.revoke(0)
    groups.forget_seen(0, [10])  # the unsent letter was dropped with the partition
    assert _take(groups, group, 0, 10)[0] == NEW


def test_a_waiting_group_is_never_forgotten_so_its_duplicate_is_never_taken_in_as_new():
    store = InMemoryStore()
    groups = PendingGroups(store, TRAIN, max_seen_groups=2)
    waiting = _group("waiting")
    _take(groups, waiting, 0, 0)
    for offset, gid in enumerate(("a", "b", "c"), start=1):
        group = _group(gid)
        _, pending = _take(groups, group, 0, offset)
        groups.resolved(pending)
        groups.group_resolved(group)
    # Three resolved groups came after it, past the memory of two: the waiting one is still known.
    assert _take(groups, waiting, 1, 0)[0] == DUPLICATE


class _Switch:
    """ready_first, except for the group ids the test holds: a policy may hold a group it let through before."""

    name = "switch"

    def __init__(self) -> None:
        self.held: set[str] = set()

    def decide(self, group, version):
        return Decision.HOLD if group.group_id in self.held or group.group_min_wv > version else Decision.YIELD

    def order(self, ready):
        return list(ready)

    def too_far_ahead(self, group, version):
        return False


def test_every_move_a_decision_taken_again_makes_goes_through_the_consumer():
    """Each state change the consumer makes, driven through select, set_version, give_back and ack: a move
    table missing one raises IllegalTransition here."""
    pipe = Pipeline()
    pipe.finalize([group("g0"), group("g1", weight_version=5)])
    policy = _Switch()
    consumer = pipe.consumer(policy, version=0)
    consumer.poll(0)
    consumer.poll(0)  # g0 held -> ready, g1 held -> held
    assert [g.group_id for g in consumer.ready_groups()] == ["g0"] and consumer.counts.waiting == 2
    consumer.set_version(1)  # decided again: ready -> ready, held -> held
    policy.held = {"g0"}
    consumer.set_version(2)  # ready -> held
    assert consumer.ready_groups() == [] and consumer.select(2, timeout_s=0.0) is None
    policy.held = set()
    consumer.set_version(3)  # held -> ready
    meta = consumer.select(3, timeout_s=0.0)  # ready -> yielded
    assert [g.group_id for g in meta.groups] == ["g0"] and consumer.counts.waiting == 1  # g1 only
    consumer.give_back(meta)  # yielded -> ready
    meta = consumer.select(3, timeout_s=0.0)
    policy.held = {"g0"}
    consumer.give_back(meta)  # yielded -> held
    assert consumer.select(3, timeout_s=0.0) is None
    policy.held = set()
    consumer.set_version(5)
    meta = consumer.select(5, min_groups=2, timeout_s=0.0)
    assert sorted(g.group_id for g in meta.groups) == ["g0", "g1"]
    consumer.ack(meta)
    assert consumer.counts.waiting == 0 and pipe.broker.committed(GROUP, NAMES.finalized, 0)[0] == 2


def test_a_duplicate_is_never_decided_and_leaves_with_its_original():
    pipe = Pipeline()
    pipe.finalize([group("g0"), group("g0"), group("g1", weight_version=5)])
    consumer = pipe.consumer(version=0)
    consumer.poll(0)
    consumer.poll(0)
    consumer.set_version(1)  # every waiting record decided again: the duplicate is not one of them
    assert consumer.counts.duplicates == 1 and consumer.counts.waiting == 2
    meta = consumer.select(1, timeout_s=0.0)
    assert [g.group_id for g in meta.groups] == ["g0"]
    consumer.ack(meta)
    assert pipe.broker.committed(GROUP, NAMES.finalized, 0)[0] == 2  # past the original and its duplicate
    duplicate = Pending(_group("d"), 0, 1, PendingState.DUPLICATE)
    for to in PendingState:
        with pytest.raises(IllegalTransition, match=rf"group d at \[0\]@1: duplicate -> {to.value}"):
            duplicate.move(to)


def test_a_group_handed_out_cannot_be_handed_out_again_before_it_is_decided_again():
    _, groups = _groups()
    _, pending = _take(groups, _group("e"), 0, 0)
    with pytest.raises(IllegalTransition):
        pending.move(PendingState.YIELDED)  # held: not usable, never handed out
    pending.move(PendingState.READY)
    pending.move(PendingState.YIELDED)
    with pytest.raises(IllegalTransition):
        pending.move(PendingState.YIELDED)
