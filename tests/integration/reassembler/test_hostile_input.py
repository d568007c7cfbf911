"""Hostile input and timing against the real broker and TQ: staging ownership, staging leaks, an aborted step."""

import time

import msgspec
from confluent_kafka import KafkaError, KafkaException

from schemas.deadletter import LATE_RECEIPT
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN
from tests.integration.helpers import dead_letters, drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher, stage_rollouts
from workers.rollout.synthetic import make_group
from workers.telemetry.sensors import ReassemblerStats

from .test_reassembler import SMALL


def _worker(kafka, tq_store, names, sensor=None, **kw):
    config = ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=f"reassemblers.{names.prefix}", **kw)
    return ReassemblerWorker(kafka, tq_store, config, sensor=sensor)


def _send(kafka, topic, receipts):
    producer = AckedProducer(kafka)
    producer.send([Outgoing(topic, r.group_id.encode(), r.to_bytes()) for r in receipts])
    producer.close()


def test_a_group_carrying_another_groups_rollout_takes_none_of_its_rows(kafka, tq_store, unique):
    names = setup_topics(kafka, f"hijack-{unique}", partitions=1)
    a = make_group("A", 0, 1, shape=SMALL)
    stage_rollouts(tq_store, a)
    # Group B, of one rollout, claims A's first rollout: its id, its manifest, its staged rows.
    hijack = msgspec.structs.replace(a[0].receipt, group_id="B", group_size=1, rollout_index=0)
    _send(kafka, names.receipts, [hijack])
    _send(kafka, names.receipts, [r.receipt for r in a])
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: any(r.group_id == "A" for r in finalized_records(kafka, names)), timeout_s=60)
    finally:
        worker.close()
    records = finalized_records(kafka, names)
    assert len(records) == 1, [(r.group_id, r.valid_row_count, r.rejection_reasons) for r in records]
    (record,) = records
    assert record.group_id == "A" and record.valid_row_count == 8
    # B got no row of A's (its only row is not its own): dead-lettered, A's tensors untouched by it.
    assert [d.source_key for d in dead_letters(kafka, names)] == [b"B"]
    rows = tq_store.get(TRAIN, list(record.sample_ids), select=["input_ids"])["input_ids"]
    assert len(rows.unbind()) == 8


def test_a_late_receipts_staged_tensors_are_cleared_once_its_dead_letter_commits(kafka, tq_store, unique):
    names = setup_topics(kafka, f"leak-{unique}", partitions=1)
    rollouts = make_group("L", 0, 1, shape=SMALL)
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(rollouts[:7])
    worker = _worker(kafka, tq_store, names, group_timeout_s=2.0)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) == 1, timeout_s=60)
        pub.publish(rollouts[7:])
        late = [c.staging_key for c in rollouts[7].receipt.manifest]
        drive(
            [worker],
            lambda: (
                [d.error_kind for d in dead_letters(kafka, names)] == [LATE_RECEIPT]
                and not tq_store.present(STAGING, late)
            ),
            timeout_s=60,
        )
    finally:
        pub.close()
        worker.close()
    assert finalized_records(kafka, names)[0].valid_row_count == 7


class _FailFirstCommit:
    """The worker's real producer, whose first commit fails as a broker timeout would make it fail."""

    def __init__(self, producer):
        self._producer = producer
        self.failed = False

    def commit(self, **kw):
        if not self.failed:
            self.failed = True
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected commit failure", txn_requires_abort=True))
        return self._producer.commit(**kw)

    def __getattr__(self, name):
        return getattr(self._producer, name)


def test_after_an_aborted_step_a_backlog_is_not_cut_short(kafka, tq_store, unique):
    names = setup_topics(kafka, f"abort-{unique}", partitions=1)
    groups = publish_groups(kafka, tq_store, names, 12)
    time.sleep(3.0)  # the whole backlog is now older than the group deadline
    stats = ReassemblerStats()
    worker = _worker(kafka, tq_store, names, sensor=stats, group_timeout_s=2.0, max_poll_records=7)
    injected = worker._producer = _FailFirstCommit(worker._producer)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 12, timeout_s=90)
    finally:
        worker.close()
    assert injected.failed and stats.aborts == 1
    records = finalized_records(kafka, names)
    # As in a run without the failure: every group complete, none finalized short by its deadline.
    assert sorted(r.group_id for r in records) == sorted(groups)
    assert all(r.valid_row_count == 8 and r.metrics["timed_out"] == 0.0 for r in records)
