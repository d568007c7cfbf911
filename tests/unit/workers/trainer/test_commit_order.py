"""The trainer's commit order, over the in-memory Kafka: the commit naming records, then their rows' clears,
then the commit passing them (`clears.py`), with and without checkpoints, and what a failure between
any two leaves a successor."""

from __future__ import annotations

import pytest

from tests.unit.workers.trainer.trainer_kafka import GROUP, Pipeline, group, train
from workers.trainer.position import decode_ranges


def _kinds(events: list[tuple]) -> list[tuple]:
    """Commits as (offset, ranges named) and clears as their sample ids, in order."""
    out = []
    for e in events:
        if e[0] == "commit":
            out.append(("commit", e[3], decode_ranges(e[3], e[4])))
        else:
            out.append(("clear", tuple(sorted(e[1]))))
    return out


def _ids(groups) -> tuple[str, ...]:
    return tuple(sorted(s for g in groups for s in g.sample_ids))


def test_an_ack_commits_its_records_named_then_clears_their_rows_then_commits_past_them():
    pipe = Pipeline()
    groups = [group(f"g{i}") for i in range(3)]
    pipe.finalize(groups)
    consumer = pipe.consumer()
    assert sorted(train(consumer, 3)) == ["g0", "g1", "g2"]
    kinds = _kinds(pipe.broker.events)
    assert kinds[-3:] == [
        ("commit", 0, [(0, 2)]),  # named resolved, the offset stopped at the first of them
        ("clear", _ids(groups)),
        ("commit", 3, []),
    ]
    assert [k for k in kinds[:-3] if k[0] == "clear" or k[2]] == []  # before: nothing cleared, nothing named
    assert not pipe.present(groups)


def test_a_durable_checkpoint_commits_its_records_named_then_clears_their_rows_then_commits_its_marks():
    pipe = Pipeline()
    # g2 is of a version newer than the trainer's: held, so the checkpoint's mark stops at it.
    groups = [group("g0"), group("g1"), group("g2", weight_version=20), group("g3")]
    pipe.finalize(groups)
    consumer = pipe.consumer(checkpointed=True)
    assert sorted(train(consumer, 3)) == ["g0", "g1", "g3"]
    assert pipe.commits() == [] and len(pipe.present(groups)) == 8  # nothing moves before a durable checkpoint
    consumer.checkpoint_durable(consumer.state_dict())
    assert _kinds(pipe.broker.events) == [
        ("commit", 0, [(0, 1), (3, 3)]),  # from where the commit stands, naming all the checkpoint trained
        ("clear", _ids([groups[0], groups[1], groups[3]])),
        ("commit", 2, [(3, 3)]),  # the mark
    ]
    assert pipe.present(groups) == set(groups[2].sample_ids)


def test_a_failed_naming_commit_keeps_the_rows_and_the_marks_wait_until_it_is_made():
    pipe = Pipeline()
    groups = [group(f"g{i}") for i in range(2)]
    pipe.finalize(groups)
    consumer = pipe.consumer(checkpointed=True)
    train(consumer, 2)
    pipe.broker.faults.commits = 1
    consumer.checkpoint_durable(consumer.state_dict())
    assert pipe.broker.events == [] and len(pipe.present(groups)) == 4
    consumer.poll(0)  # the next round retries, in order
    assert _kinds(pipe.broker.events) == [("commit", 0, [(0, 1)]), ("clear", _ids(groups)), ("commit", 2, [])]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_groups_trained_while_commits_fail_are_trained_again_by_a_successor_not_reported_lost(checkpointed):
    pipe = Pipeline()
    groups = [group(f"g{i}") for i in range(3)]
    pipe.finalize(groups)
    pipe.broker.faults.commits = 1_000
    first = pipe.consumer(checkpointed=checkpointed)
    train(first, 3)
    if checkpointed:
        first.checkpoint_durable(first.state_dict())
    first.close()
    assert pipe.commits() == [] and len(pipe.present(groups)) == 6  # no commit: no clear
    pipe.broker.faults.commits = 0
    second = pipe.consumer()
    assert sorted(train(second, 3)) == ["g0", "g1", "g2"]
    assert second.counts.missing_rows == 0 and not pipe.present(groups)


def test_a_trainer_that_dies_between_its_naming_commit_and_the_clear_leaves_a_successor_to_clear_the_rows():
    pipe = Pipeline()
    groups = [group(f"g{i}") for i in range(3)]
    pipe.finalize(groups)

    store = pipe.store

    class ClearFails:
        def clear(self, partition, keys):
            raise ConnectionError("TQ unreachable (the test)")

        def __getattr__(self, name):
            return getattr(store, name)

    pipe.store = ClearFails()
    first = pipe.consumer()
    with pytest.raises(ConnectionError):
        train(first, 3)
    assert [(c[3], decode_ranges(c[3], c[4])) for c in pipe.commits()][-1] == (0, [(0, 2)])  # named, not passed
    assert len(pipe.present(groups)) == 6
    pipe.store = store
    second = pipe.consumer()
    second.poll(0)
    second.poll(0)
    assert second.counts.reread == 3 and second.counts.missing_rows == 0 and second.counts.yielded == 0
    assert not pipe.present(groups)
    assert pipe.broker.committed(GROUP, "u.experience.finalized", 0)[0] == 3
