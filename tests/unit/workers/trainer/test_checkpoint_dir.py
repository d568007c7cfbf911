"""What rlstream writes into a trainer checkpoint (`checkpoint_dir.py`), over the in-memory Kafka and store:
the groups it keeps resolved agree with the state's cut, and the spill written off the trainer's thread."""

from __future__ import annotations

import threading

import pytest

from schemas.errors import InvalidArgument
from schemas.regenerate import Regenerate
from streams.errors import MissingKeysError
from streams.tq import TRAIN
from tests.unit.memory_store import InMemoryStore
from tests.unit.workers.trainer.fake_kafka import NotingStore
from tests.unit.workers.trainer.trainer_kafka import NAMES, Pipeline, group, train
from workers.trainer.checkpoint_dir import begin_checkpoint, load_state, save_into_checkpoint, spill_binding
from workers.trainer.resolved import read_resolved, write_resolved
from workers.trainer.spill_read import read_spill


def _handed_back(pipe: Pipeline) -> list[str]:
    return [Regenerate.from_bytes(m.value()).group_id for m in pipe.broker.records(NAMES.regenerate)]


def _meet_lost_rows(consumer, n: int = 10) -> None:
    """Select until the consumer met a group whose rows are gone (found by select or materialize)."""
    for _ in range(n):
        consumer.poll(0)
        meta = consumer.select(10, min_groups=1, max_groups=1, timeout_s=0.0)
        if meta is not None:
            try:
                consumer.materialize(meta)
                consumer.ack(meta)
            except MissingKeysError:
                pass
        if consumer.counts.missing_rows:
            return
    raise AssertionError("no group with rows missing was met")


def test_a_hand_back_still_in_the_outbox_at_the_checkpoint_is_handed_back_by_the_restored_trainer(tmp_path):
    pipe = Pipeline()
    lost = group("lost")
    pipe.finalize([lost, group("g1")])
    pipe.rows.clear(TRAIN, list(lost.sample_ids))  # TQ lost its rows
    pipe.broker.faults.held_topics = {NAMES.regenerate}  # its hand-back is not acknowledged before the kill
    first = pipe.consumer(checkpointed=True)
    _meet_lost_rows(first)
    assert first.counts.handed_back == 1 and _handed_back(pipe) == []
    state, _ = save_into_checkpoint(tmp_path, first, pipe.store, spill=False)
    # The cut holds the record back (its notice is not acknowledged), and the resolved file must agree.
    assert state["partitions"][0]["offset"] == 0
    assert [tuple(r) for r in state["partitions"][0]["trained"]] == [(1, 1)]  # g1 trained
    assert [g for g, _, _ in read_resolved(tmp_path, spill_binding(state))] == ["g1"]
    # Killed here. The restored trainer reads the record again: its group is handed back, not dropped.
    pipe.broker.faults.held_topics = set()
    second = pipe.consumer(checkpointed=True)
    second.load_state_dict(load_state(tmp_path))
    trained = []
    for _ in range(10):
        second.poll(0)
        meta = second.select(10, min_groups=1, max_groups=10, timeout_s=0.0)
        if meta is None:
            continue
        try:
            second.materialize(meta)
        except MissingKeysError:
            continue
        trained += [g.group_id for g in meta.groups]
        second.ack(meta)
    assert _handed_back(pipe) == ["lost"] and second.counts.handed_back == 1
    assert trained == []  # g1 was trained before the cut


def test_a_resolved_file_that_names_a_group_its_cut_does_not_resolve_is_not_believed(tmp_path):
    """A checkpoint written before the fix: its resolved file named the set-aside group anyway."""
    pipe = Pipeline()
    lost = group("lost")
    pipe.finalize([lost])
    pipe.rows.clear(TRAIN, list(lost.sample_ids))
    pipe.broker.faults.held_topics = {NAMES.regenerate}
    first = pipe.consumer(checkpointed=True)
    _meet_lost_rows(first)
    state, _ = save_into_checkpoint(tmp_path, first, pipe.store, spill=False)
    write_resolved(tmp_path, spill_binding(state), [("lost", 0, 0)])  # what the old code wrote
    assert load_state(tmp_path)["resolved"] == []


def test_groups_trained_before_the_cut_are_kept_resolved(tmp_path):
    pipe = Pipeline()
    pipe.finalize([group(f"g{i}") for i in range(3)])
    first = pipe.consumer(checkpointed=True)
    assert sorted(train(first, 2)) == ["g0", "g1"]
    state, _ = save_into_checkpoint(tmp_path, first, pipe.store, spill=False)
    assert sorted(g for g, _, _ in load_state(tmp_path)["resolved"]) == ["g0", "g1"]
    assert state["partitions"][0]["offset"] == 2


class _Gated(InMemoryStore):
    """The spill's reads of TQ wait until the test opens the gate (or raise `fail`), so the trainer's acks
    are driven in while the spill runs, deterministically; the trainer's own reads pass."""

    def __init__(self, fail: BaseException | None = None):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.fail = fail

    def list(self, partition):
        if threading.current_thread().name == "rlstream-spill":
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail is not None:
                raise self.fail
        return super().list(partition)


def _gated_pipeline(fail: BaseException | None = None) -> tuple[Pipeline, _Gated]:
    pipe = Pipeline()
    pipe.rows = _Gated(fail)
    pipe.store = NotingStore(pipe.rows, pipe.broker.events)
    return pipe, pipe.rows


def test_acks_landing_while_the_spill_runs_keep_their_rows_and_are_in_the_spill(tmp_path):
    pipe, gated = _gated_pipeline()
    groups = [group(f"g{i}") for i in range(4)]
    pipe.finalize(groups)
    first = pipe.consumer(checkpointed=True)
    assert sorted(train(first, 2)) == ["g0", "g1"]
    write = begin_checkpoint(tmp_path, first, pipe.store)
    assert gated.entered.wait(30) and not write.done()
    with pytest.raises(InvalidArgument, match="wait"):
        _ = write.state  # not before the spill is written: checkpoint_durable would clear rows it has not read
    assert sorted(train(first, 2)) == ["g2", "g3"]  # acked after the cut, while the spill reads
    gated.gate.set()
    summary = write.wait(30)
    assert write.done() and summary.rows[TRAIN] == 8  # g0, g1 still there (cleared only once durable), g2, g3
    state = write.state
    assert state["partitions"][0]["offset"] == 2  # the cut: g2 and g3 were not trained at it
    first.checkpoint_durable(state)
    first.poll(0)
    assert pipe.present(groups[2:]) == set(groups[2].sample_ids + groups[3].sample_ids)  # kept for the next
    assert pipe.present(groups[:2]) == set()
    with read_spill(tmp_path, binding=spill_binding(state)) as spill:
        assert {"g2_g0", "g2_g1", "g3_g0", "g3_g1"} <= spill.keys(TRAIN)


def test_a_spill_that_fails_in_the_background_raises_from_wait_and_gives_no_state(tmp_path):
    pipe, gated = _gated_pipeline(fail=RuntimeError("TQ storage unit gone"))
    pipe.finalize([group("g0")])
    first = pipe.consumer(checkpointed=True)
    train(first, 1)
    write = begin_checkpoint(tmp_path, first, pipe.store)
    gated.gate.set()
    with pytest.raises(RuntimeError, match="storage unit gone"):
        write.wait(30)
    assert write.done()
    with pytest.raises(InvalidArgument, match="spill failed"):
        _ = write.state
    assert pipe.present([group("g0")]) == {"g0_g0", "g0_g1"}  # nothing declared durable, nothing cleared


def test_a_checkpoint_written_on_the_trainers_thread_gives_its_state_at_once(tmp_path):
    pipe = Pipeline()
    pipe.finalize([group("g0")])
    first = pipe.consumer(checkpointed=True)
    train(first, 1)
    write = begin_checkpoint(tmp_path, first, pipe.store, background=False)
    assert write.done() and write.state["partitions"][0]["offset"] == 1
