"""Train rows nothing will read (issue 30, item 8): an uncommitted attempt put a group's rows, and the attempt
that commits decides the group without rows; those rows are cleared in the deciding step."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from schemas.regenerate import Regenerate
from schemas.state import HANDED_BACK
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


def _group(store, group_id: str, shape: SyntheticShape) -> OpenGroup:
    from workers.rollout.publisher import stage_rollouts

    rollouts = make_group(group_id, 0, 1, shape=shape)
    stage_rollouts(store, rollouts)
    group = OpenGroup(group_id, 0, shape.group_size, 0, 0, 0, 0)
    for i, r in enumerate(rollouts):
        group.receipts[i] = r.receipt
    return group


def _rows_put_before(store, group_id: str, n: int) -> None:
    """What an earlier attempt (another version's checks, say) put and never committed."""
    ids = [f"{group_id}_g{i}" for i in range(n)]
    store.put(TRAIN, ids, TensorDict({"x": torch.arange(n)}, [n]), [{"group_id": group_id}] * n)


def test_a_group_now_dead_lettered_loses_the_rows_an_earlier_attempt_put_and_a_finalized_one_keeps_its_own():
    store = InMemoryStore()
    failed, fine = _group(store, "gf", FAILING), _group(store, "gk", WORKING)
    _rows_put_before(store, "gf", 3)
    _rows_put_before(store, "gk", 3)
    store.put(TRAIN, ["gf_g3"], TensorDict({"x": torch.arange(1)}, [1]), [{"group_id": "gf"}])  # not its row
    outcomes = finalize_groups(store, [failed, fine], default_actor_config(), receipts_topic="t", now_ms=0)
    assert [o.finalized is None for o in outcomes] == [True, False]
    assert sorted(store.list(TRAIN)) == ["gf_g3", "gk_g0", "gk_g1", "gk_g2"]  # gk's rows are this attempt's


def test_a_worker_whose_lease_refuses_clears_no_train_row_and_its_step_aborts():
    store = InMemoryStore()
    failed = _group(store, "gf", FAILING)
    _rows_put_before(store, "gf", 3)

    class Refusing(InMemoryStore):
        def clear(self, partition, keys):
            from streams.errors import ClearRefused

            raise ClearRefused("given up before its mark: the process was frozen")

    refusing = Refusing()
    refusing._rows = store._rows
    with pytest.raises(LeaseRefused, match="frozen"):
        finalize_groups(refusing, [failed], default_actor_config(), receipts_topic="t", now_ms=0)
    assert sorted(store.list(TRAIN)) == ["gf_g0", "gf_g1", "gf_g2"]
