"""What rlstream writes into a trainer checkpoint (`checkpoint_dir.py`), over the in-memory Kafka and store:
the groups it keeps resolved agree with the state's cut, and the spill written off the trainer's thread."""

from __future__ import annotations

from schemas.regenerate import Regenerate
from streams.errors import MissingKeysError
from streams.tq import TRAIN
from tests.unit.workers.trainer.trainer_kafka import NAMES, Pipeline, group, train
from workers.trainer.checkpoint_dir import load_state, save_into_checkpoint, spill_binding
from workers.trainer.resolved import read_resolved, write_resolved


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
