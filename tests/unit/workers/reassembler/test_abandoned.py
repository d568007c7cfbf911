"""Train rows nothing will read (issue 30, item 8): an uncommitted attempt put a group's rows, and the attempt
that commits decides the group without rows; those rows are cleared in the deciding step."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from schemas.regenerate import Regenerate
from schemas.state import HANDED_BACK
from streams.partitioner import partition_of
from streams.tq import STAGING, TRAIN
from tests.unit.memory_store import InMemoryStore
from workers.reassembler.config import default_actor_config
from workers.reassembler.errors import LeaseRefused
from workers.reassembler.faults import Faults
from workers.reassembler.finalize import finalize_groups
from workers.reassembler.groups import OpenGroup
from workers.rollout.synthetic import SyntheticShape, make_group

from .steps import NAMES, RecordingStore, finalized, make_broker, publish, state_entries, steps, worker


class _Killed(Exception):
    pass


class _KilledBeforeCommit(Faults):
    def before_commit(self) -> None:
        raise _Killed("SIGKILL after the put, before the commit")


def test_a_killed_steps_train_rows_of_a_group_its_successor_hands_back_are_cleared():
    broker, store = make_broker(), RecordingStore()
    broker.create(NAMES.regenerate, 1)
    rollouts = publish(broker, store, "g1")
    killed = worker(broker, store, faults=_KilledBeforeCommit())
    with pytest.raises(_Killed):
        killed.step()
    assert set(store.list(TRAIN)) == {"g1_g0", "g1_g1"}  # put, never committed
    # Meanwhile the group's staged rows are lost (a storage unit with them, say): the successor
    # re-reads the receipts, finds none of the rows and hands the group back. No record names g1_g*.
    store.clear(STAGING, [c.staging_key for r in rollouts for c in r.receipt.manifest])
    successor = worker(broker, store)
    steps(successor, 2)
    assert finalized(broker) == []
    assert [Regenerate.from_bytes(m.value()).group_id for m in broker.records(NAMES.regenerate)] == ["g1"]
    assert {e.outcome for e in state_entries(broker) if e.outcome} == {HANDED_BACK}
    assert store.list(TRAIN) == {}


FAILING = SyntheticShape(
    group_size=3, calls=(1, 1), prompt_len=(2, 3), answer_len=(1, 2), observation_len=(1, 1), failure_rate=1.0
)
WORKING = SyntheticShape(group_size=3, calls=(1, 1), prompt_len=(2, 3), answer_len=(1, 2), observation_len=(1, 1))


def _group(store, group_id: str, shape: SyntheticShape, *, partition: int = 0, first_offset: int = 0) -> OpenGroup:
    from workers.rollout.publisher import stage_rollouts

    rollouts = make_group(group_id, 0, 1, shape=shape)
    stage_rollouts(store, rollouts)
    group = OpenGroup(group_id, partition, shape.group_size, 0, first_offset, first_offset, 0)
    for i, r in enumerate(rollouts):
        group.receipts[i] = r.receipt
    return group


def _earlier_attempt(store, group: OpenGroup) -> None:
    """An attempt that finalized `group` and put its rows, then never committed (killed, aborted)."""
    (outcome,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="t", now_ms=0)
    assert outcome.finalized is not None


def _staging_lost(store, group: OpenGroup) -> None:
    store.clear(STAGING, list(group.staging_keys()))


def _decide(store, groups: list[OpenGroup], *, earlier=lambda g: True):
    return finalize_groups(
        store, groups, default_actor_config(), receipts_topic="t", now_ms=0, may_hold_earlier_attempt=earlier
    )


def test_a_group_now_decided_without_rows_loses_the_rows_its_earlier_attempt_put_and_a_finalized_one_keeps_its_own():
    store = InMemoryStore()
    lost, fine = _group(store, "gl", WORKING), _group(store, "gk", WORKING, first_offset=7)
    _earlier_attempt(store, lost)
    _earlier_attempt(store, fine)
    _staging_lost(store, lost)  # its successor hands it back
    store.put(TRAIN, ["gl_g3"], TensorDict({"x": torch.arange(1)}, [1]), [{"group_id": "gl"}])  # not its row
    outcomes = _decide(store, [lost, fine])
    assert [o.finalized is None for o in outcomes] == [True, False]
    assert sorted(store.list(TRAIN)) == ["gk_g0", "gk_g1", "gk_g2", "gl_g3"]  # gk's rows are this attempt's


def test_rows_of_a_committed_record_of_the_same_group_id_at_another_source_position_are_never_cleared():
    # The group id published again after its group closed and was forgotten (closed_retention_s): a
    # fresh group, at a later offset, decided without rows. The rows waiting for the trainer are the
    # committed original's, which the attempt of that fresh group never put.
    store = InMemoryStore()
    original = _group(store, "g1", WORKING, first_offset=3)
    _earlier_attempt(store, original)  # finalized and committed: its record names g1_g*
    again = _group(store, "g1", FAILING, first_offset=900)
    outcomes = _decide(store, [again])
    assert outcomes[0].finalized is None
    assert sorted(store.list(TRAIN)) == ["g1_g0", "g1_g1", "g1_g2"]


def test_a_finalize_over_ray_rpc_never_clears_the_rows_a_call_before_it_returned():
    # The Ray face commits nothing: a call repeated after the caller took the first call's record (its
    # staging gone by then) decides the group without rows; those rows are the first record's.
    store = InMemoryStore()
    group = _group(store, "G", WORKING, partition=-1)
    (first,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="rpc", now_ms=0)
    _staging_lost(store, group)
    (second,) = finalize_groups(store, [group], default_actor_config(), receipts_topic="rpc", now_ms=0)
    assert second.finalized is None and sorted(store.list(TRAIN)) == sorted(first.finalized.sample_ids)


def test_a_worker_whose_lease_refuses_clears_no_train_row_and_its_step_aborts():
    store = InMemoryStore()
    lost = _group(store, "gl", WORKING)
    _earlier_attempt(store, lost)
    _staging_lost(store, lost)

    class Refusing(InMemoryStore):
        def clear(self, partition, keys):
            from streams.errors import ClearRefused

            raise ClearRefused("given up before its mark: the process was frozen")

    refusing = Refusing()
    refusing._rows = store._rows
    with pytest.raises(LeaseRefused, match="frozen"):
        _decide(refusing, [lost])
    assert sorted(store.list(TRAIN)) == ["gl_g0", "gl_g1", "gl_g2"]


class CountingStore(RecordingStore):
    """Notes every lookup of train rows (a tags lookup, or the lookup a clear begins with): each is a TQ
    controller lookup, which TQ logs as a WARNING listing the keys it did not find."""

    def __init__(self) -> None:
        super().__init__()
        self.train_lookups: list[tuple[str, ...]] = []

    def tags(self, partition, keys):
        if partition == TRAIN:
            self.train_lookups.append(tuple(keys))
        return super().tags(partition, keys)

    def clear(self, partition, keys):
        if partition == TRAIN:
            self.train_lookups.append(tuple(keys))
        super().clear(partition, keys)


def test_a_worker_running_since_before_a_group_asks_tq_nothing_about_its_train_rows_when_it_decides_it_without():
    # No earlier attempt can have put them: the only uncommitted step of a partition is the one in
    # flight when its last owner stopped (or this worker's own, aborted), and this worker decides the
    # group after it read past anything that step could have read (max_poll_records past the commit).
    broker, store = make_broker(), CountingStore()
    w = worker(broker, store, max_poll_records=2)
    same = [g for g in (f"w{i}" for i in range(40)) if partition_of(g.encode(), 2) == partition_of(b"gf", 2)][:2]
    for i, gid in enumerate(same):
        publish(broker, store, gid, seed=3 + i)  # 4 receipts, past the first step's reach of 2
    steps(w, 4)
    assert finalized(broker) == same
    store.train_lookups.clear()
    publish(broker, store, "gf", shape=FAILING)
    steps(w, 2)
    assert finalized(broker) == same and store.train_lookups == []


def test_a_restored_worker_looks_up_one_row_per_group_it_decides_without_rows_until_past_its_predecessors_reach():
    broker, store = make_broker(), CountingStore()
    publish(broker, store, "gf", shape=FAILING)
    w = worker(broker, store)
    steps(w, 2)
    assert store.train_lookups == [("gf_g0",)]  # one key a group, not every row, and no list of the partition
