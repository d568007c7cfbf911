"""The trainer's consumer when things go wrong, against the real broker and TQ (issue 11, items 10 and 11).

Undecodable records go to the trainer's dead-letter topic; duplicates never orphan rows nor destroy
rows not yet trained; rows missing from TQ raise an alarm unless the group was consumed before a
restart; a topic that does not exist yet and a trainer step longer than max.poll.interval.ms are
waited out instead of ending the process.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from prometheus_client import CollectorRegistry

from schemas.deadletter import MAX_ORIGINAL_BYTES, DeadLetter
from schemas.finalized import FinalizedGroup
from streams.consumer import committed_offsets, read_topic, wait_until
from streams.producer import AckedProducer, Outgoing
from streams.tq import TRAIN
from tests.integration.trainer.staging import committed_at_end, finalize_groups
from workers.telemetry.prometheus import PrometheusTrainerSensor
from workers.topics import TopicNames
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.deadletters import MISSING_ROWS, UNDECODABLE_FINALIZED
from workers.trainer.policies import in_order, policy_by_name, ready_first


def _consumer(kafka, tq_store, names, group, policy=None, version=10, **config):
    yielded: list[str] = []
    registry = CollectorRegistry()
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=group, **config),
        policy or policy_by_name("ready_first"),
        version=version,
        on_yield=lambda g, v: yielded.append(g.group_id),
        sensor=PrometheusTrainerSensor(registry),
    )
    return consumer, yielded, registry


def _drain(consumer, num_groups=4, timeout_s=3.0):
    while (batch := consumer.next_batch(num_groups, timeout_s=timeout_s)) is not None:
        consumer.release(batch)


def _drain_until(consumer, done, num_groups=4, timeout_s=60.0):
    """Release batches until `done()` holds: a quiet spell on a loaded machine is not the end of the topic."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the consumer stopped yielding before it was done"
        if (batch := consumer.next_batch(num_groups, timeout_s=1.0)) is not None:
            consumer.release(batch)


def _settle(consumer, kafka, group, topic, timeout_s=150.0):
    """Poll until the consumer's committed offsets reach the end of every partition.

    The deadline allows for the trainer's commit retries, which back off up to 30 s after refusals, on a
    loaded machine: at 60 s two of these tests ran out under `make test` at load 8-28."""
    deadline = time.monotonic() + timeout_s
    while not committed_at_end(kafka, group, topic):
        assert time.monotonic() < deadline, f"{group}: committed {committed_offsets(kafka, group, topic)}"
        consumer.poll(0.2)


def _letters(kafka, names: TopicNames) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.trainer_deadletter)]


def test_undecodable_records_are_dead_lettered_with_their_reason_and_offsets_move_past(kafka, tq_store, unique, caplog):
    names, finalized = finalize_groups(kafka, tq_store, f"tf-u-{unique}")
    some = next(iter(finalized.values()))
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(some), "schema_version": [2, 0]})
    huge = b"\xc1" * (MAX_ORIGINAL_BYTES + 100)
    producer = AckedProducer(kafka)
    bad = [(b"poison", b"\xc1garbage"), (some.group_id.encode(), newer), (b"k" * 5000, huge)]
    producer.send([Outgoing(names.finalized, k, v, partition=1) for k, v in bad])
    producer.close()
    group = f"tf-u-{unique}"
    consumer, yielded, registry = _consumer(kafka, tq_store, names, group)
    try:
        with caplog.at_level(logging.ERROR, logger="rlstream.trainer"):
            _drain(consumer)
            _settle(consumer, kafka, group, names.finalized)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(finalized)
    letters = sorted(_letters(kafka, names), key=lambda d: d.source_offset)
    assert [d.error_kind for d in letters] == [UNDECODABLE_FINALIZED] * 3
    assert {(d.source_topic, d.source_partition) for d in letters} == {(names.finalized, 1)}
    assert letters[0].original == b"\xc1garbage" and letters[0].source_key == b"poison"
    assert "unsupported major version 2" in letters[1].message and letters[1].original == newer
    assert letters[2].original_truncated and letters[2].original_size == len(huge)
    assert len(letters[2].original) == MAX_ORIGINAL_BYTES and len(letters[2].source_key) == 1024
    assert consumer.counts.undecodable == 3
    assert registry.get_sample_value("rlstream_trainer_undecodable_records_total") == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert sum(f"{names.finalized}[1]@{d.source_offset}" in e for d in letters for e in errors) == 3


def _republish(kafka, names, record: FinalizedGroup) -> None:
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.finalized, record.group_id.encode(), record.to_bytes())])
    producer.close()


def test_a_duplicate_of_a_released_group_has_its_rows_cleared(kafka, tq_store, unique):
    """The duplicate's rows are the original's keys; once the original is released nothing needs them."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-d-{unique}")
    group = f"tf-d-{unique}"
    consumer, yielded, registry = _consumer(kafka, tq_store, names, group)
    try:
        first = consumer.next_batch(1, timeout_s=20.0)
        assert first is not None
        record = first.groups[0]
        rows = tq_store.get(TRAIN, list(record.sample_ids))
        consumer.release(first)
        _drain(consumer)
        # Whoever published the duplicate put its rows again under the same sample ids first.
        tq_store.put(TRAIN, list(record.sample_ids), rows, list(record.tags))
        _republish(kafka, names, record)
        _settle(consumer, kafka, group, names.finalized)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(finalized)
    assert consumer.counts.duplicates == 1
    assert registry.get_sample_value("rlstream_trainer_duplicate_groups_total") == 1
    assert not tq_store.present(TRAIN, list(record.sample_ids))


def test_a_duplicate_of_a_group_not_yet_trained_leaves_its_rows_until_the_original_is_released(kafka, tq_store, unique):
    """Clearing a duplicate's rows while its original waits would destroy rows not yet trained."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-h-{unique}", versions=range(3), per_version=1)
    group = f"tf-h-{unique}"
    held = finalized["v2-g0"]
    extra = f"{held.group_id}_g99"  # a re-finalization with one more row than the original
    rows = tq_store.get(TRAIN, [held.sample_ids[0]])
    tq_store.put(TRAIN, [extra], rows, [held.tags[0]])
    bigger = msgspec.structs.replace(
        held,
        sample_ids=(*held.sample_ids, extra),
        tags=(*held.tags, held.tags[0]),
        valid_row_count=held.valid_row_count + 1,
        total_row_count=held.total_row_count + 1,
        rejection_reasons=(*held.rejection_reasons, None),
    )
    _republish(kafka, names, bigger)
    consumer, yielded, _ = _consumer(kafka, tq_store, names, group, policy=in_order(5), version=0)
    try:
        _drain(consumer, timeout_s=5.0)
        consumer.set_version(1)
        _drain(consumer, timeout_s=3.0)
        assert consumer.counts.duplicates == 1 and "v2-g0" not in yielded
        assert tq_store.present(TRAIN, list(held.sample_ids)) == set(held.sample_ids)
        consumer.set_version(2)
        batch = consumer.next_batch(1, timeout_s=10.0)
        assert batch is not None and [g.group_id for g in batch.groups] == ["v2-g0"]
        assert batch.tensors["input_ids"].shape[0] == len(held.sample_ids)
        consumer.release(batch)
        _settle(consumer, kafka, group, names.finalized)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(finalized) and len(yielded) == len(set(yielded))
    assert not tq_store.present(TRAIN, [*held.sample_ids, extra])


def test_rows_missing_from_a_group_never_consumed_raise_an_alarm(kafka, tq_store, unique, caplog):
    """With hand-back off (test_hand_back.py has it on): the group is dropped and dead-lettered."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-m-{unique}")
    lost = finalized["v1-g1"]
    tq_store.clear(TRAIN, list(lost.sample_ids[:3]))  # TQ lost part of the group
    group = f"tf-m-{unique}"
    consumer, yielded, registry = _consumer(kafka, tq_store, names, group, hand_back_lost_rows=False)
    try:
        with caplog.at_level(logging.ERROR, logger="rlstream.trainer"):
            _drain(consumer)
            _settle(consumer, kafka, group, names.finalized)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(g for g in finalized if g != lost.group_id)
    assert consumer.counts.missing_rows == 1
    assert registry.get_sample_value("rlstream_trainer_missing_rows_total") == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(lost.group_id in e and "3 of" in e and TRAIN in e for e in errors)
    letters = _letters(kafka, names)
    assert [(d.error_kind, d.source_key) for d in letters] == [(MISSING_ROWS, lost.group_id.encode())]
    assert FinalizedGroup.from_bytes(letters[0].original) == lost
    assert not tq_store.present(TRAIN, list(lost.sample_ids))


def _released_behind_held(kafka, names) -> int:
    """v0 groups after the first v1 group of their partition: released, but behind the committed offset."""
    records = [(r.partition, r.offset, FinalizedGroup.from_bytes(r.value)) for r in read_topic(kafka, names.finalized)]
    first_held = {}
    for part, offset, g in records:
        if g.group_min_wv == 1:
            first_held[part] = min(offset, first_held.get(part, offset))
    return sum(1 for part, offset, g in records if g.group_min_wv == 0 and offset > first_held.get(part, offset))


def test_groups_consumed_before_a_restart_are_not_reported_missing(kafka, tq_store, unique, caplog):
    """in_order holds the v1 groups, so the committed offsets stay behind v0 groups already released."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-r-{unique}", per_version=6, partitions=2)
    group = f"tf-r-{unique}"
    v0 = sorted(g for g in finalized if g.startswith("v0-"))
    v1 = sorted(g for g in finalized if g.startswith("v1-"))
    first, yielded, _ = _consumer(kafka, tq_store, names, group, policy=in_order(1), version=0)
    try:
        _drain_until(first, lambda: len(yielded) >= len(v0))
        _drain(first, timeout_s=1.0)  # nothing more is yielded at version 0
    finally:
        first.close()
    assert sorted(yielded) == v0
    second, again, registry = _consumer(kafka, tq_store, names, group, policy=in_order(1), version=1)
    try:
        with caplog.at_level(logging.WARNING, logger="rlstream.trainer"):
            _drain_until(second, lambda: len(again) >= len(v1))
            _settle(second, kafka, group, names.finalized)
    finally:
        second.close()
    assert sorted(again) == v1
    assert second.counts.missing_rows == 0 and second.counts.reread == _released_behind_held(kafka, names) > 0
    assert registry.get_sample_value("rlstream_trainer_missing_rows_total") == 0
    assert not [r.getMessage() for r in caplog.records if r.name == "rlstream.trainer" and r.levelno >= logging.WARNING]
    assert not _letters(kafka, names)


def test_a_finalized_topic_that_does_not_exist_yet_is_waited_for(kafka, tq_store, unique, caplog):
    prefix = f"tf-t-{unique}"
    consumer, yielded, _ = _consumer(kafka, tq_store, TopicNames(prefix), prefix)
    try:
        with caplog.at_level(logging.WARNING, logger="rlstream.trainer"):
            assert consumer.next_batch(1, timeout_s=4.0) is None
        assert any(f"{prefix}.experience.finalized" in r.getMessage() for r in caplog.records)
        names, finalized = finalize_groups(kafka, tq_store, prefix, per_version=1)
        deadline = time.monotonic() + 60
        while len(yielded) < len(finalized):
            assert time.monotonic() < deadline, f"yielded {yielded} of {sorted(finalized)}"
            _drain(consumer, timeout_s=1.0)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(finalized)


def test_a_trainer_step_longer_than_max_poll_interval_loses_and_repeats_nothing(kafka, tq_store, unique, caplog):
    names, finalized = finalize_groups(kafka, tq_store, f"tf-p-{unique}", per_version=4)
    group = f"tf-p-{unique}"
    cfg = {"session_timeout_ms": 2000, "max_poll_interval_ms": 3000}
    consumer, yielded, _ = _consumer(kafka, tq_store, names, group, **cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="rlstream.trainer"):
            first = consumer.next_batch(2, timeout_s=20.0)
            assert first is not None
            time.sleep(4.0)  # the trainer step: past max.poll.interval.ms, so the consumer leaves its group
            second = consumer.next_batch(2, timeout_s=20.0)  # rejoins; re-reads what was assigned before
            assert second is not None
            # first is still with the trainer: the committed offsets must not pass its records.
            committed = committed_offsets(kafka, group, names.finalized)
            assert all(committed.get(p, -1001) <= o for p, o in first.positions)
            consumer.release(first)
            consumer.release(second)
            deadline = time.monotonic() + 60
            while len(yielded) < len(finalized):
                assert time.monotonic() < deadline, f"yielded {yielded} of {sorted(finalized)}"
                _drain(consumer, timeout_s=1.0)
            _settle(consumer, kafka, group, names.finalized)
    finally:
        consumer.close()
    assert sorted(yielded) == sorted(finalized)
    assert any("max.poll.interval.ms" in r.getMessage() for r in caplog.records)
    assert not tq_store.present(TRAIN, [s for g in finalized.values() for s in g.sample_ids])
    wait_until(lambda: committed_at_end(kafka, group, names.finalized), timeout_s=10, what="final commit")


class CommitsFail:
    """The real Kafka consumer, except that every offset commit fails (a broker that takes no commits)."""

    def __init__(self, conf):
        self._consumer = Consumer(conf)
        self.attempts = 0

    def commit(self, *args, **kwargs):
        self.attempts += 1
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "commit refused by the test"))

    def __getattr__(self, name):
        return getattr(self._consumer, name)


class FailingCommits(KafkaTrainerClients):
    """The real trainer clients, except that the finalized topic's reader is a `CommitsFail`."""

    def __init__(self, kafka):
        super().__init__(kafka)
        self.consumers: list[CommitsFail] = []

    def consumer(self, consumer_group, settings):
        self.consumers.append(CommitsFail(self.consumer_settings(consumer_group, settings)))
        return self.consumers[-1]


class ClearFails:
    """The real TQ store, except that clearing train rows fails (TQ unreachable from this trainer)."""

    def __init__(self, store):
        self._store = store

    def clear(self, partition, keys):
        if partition == TRAIN and keys:
            raise ConnectionError("TQ unreachable (the test)")
        self._store.clear(partition, keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _train_all(consumer, n: int, checkpointed: bool) -> list[str]:
    """Train n groups and ack them (with a durable checkpoint when checkpointed); their group ids."""
    trained: list[str] = []
    deadline = time.monotonic() + 60
    while len(trained) < n:
        assert time.monotonic() < deadline, f"trained {trained}"
        meta = consumer.select(10, min_groups=1, max_groups=n - len(trained), timeout_s=5.0)
        if meta is not None:
            consumer.materialize(meta)
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
    if checkpointed:
        consumer.checkpoint_durable(consumer.state_dict())
    return trained


@pytest.mark.parametrize("checkpointed", [False, True])
def test_groups_trained_while_commits_fail_are_trained_again_by_a_successor_never_reported_lost(
    kafka, tq_store, unique, checkpointed
):
    """Rows cleared before the commit that failed: the successor, reading from the old commit, found a
    trained group's rows gone and dead-lettered it as data loss."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-c-{unique}", versions=range(1), per_version=3)
    group = f"tf-c-{unique}"
    failing = FailingCommits(kafka)
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=checkpointed)
    first = ExperienceConsumer(kafka, tq_store, cfg, ready_first(), clients=failing)
    try:
        assert sorted(_train_all(first, len(finalized), checkpointed)) == sorted(finalized)
    finally:
        first.close()  # its last commit fails too: nothing of this run reached the broker
    assert failing.consumers[0].attempts > 0
    assert set(committed_offsets(kafka, group, names.finalized).values()) == {-1001}
    second, again, registry = _consumer(kafka, tq_store, names, group)
    try:
        _drain(second)
        _settle(second, kafka, group, names.finalized)
    finally:
        second.close()
    assert second.counts.missing_rows == 0 and not _letters(kafka, names)
    assert sorted(again) == sorted(finalized)  # trained again (no checkpoint says otherwise), not lost
    assert not tq_store.present(TRAIN, [s for g in finalized.values() for s in g.sample_ids])


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_trainer_that_dies_between_its_commit_and_the_clear_leaves_no_rows_behind(
    kafka, tq_store, unique, checkpointed
):
    """The commit names the acked records before their rows go, and does not pass them until they are
    gone: the successor reads them again as consumed and clears what is left."""
    names, finalized = finalize_groups(kafka, tq_store, f"tf-k-{unique}", versions=range(1), per_version=3)
    group = f"tf-k-{unique}"
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=checkpointed)
    first = ExperienceConsumer(kafka, ClearFails(tq_store), cfg, ready_first())
    try:
        with pytest.raises(ConnectionError):
            _train_all(first, len(finalized), checkpointed)
    finally:
        first.close()
    rows = [s for g in finalized.values() for s in g.sample_ids]
    assert tq_store.present(TRAIN, rows) == set(rows)  # the trainer is gone, its rows are not
    second, again, _ = _consumer(kafka, tq_store, names, group)
    try:
        _drain(second)
        _settle(second, kafka, group, names.finalized)
    finally:
        second.close()
    trained_first = len(finalized) - len(again)
    assert trained_first >= 1 and second.counts.reread == trained_first and second.counts.missing_rows == 0
    assert not tq_store.present(TRAIN, rows)
