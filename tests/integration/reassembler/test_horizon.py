"""The closed-group horizon against the real broker and TQ: a forgotten group is never finalized twice."""

from schemas.deadletter import LATE_RECEIPT
from schemas.state import PartitionProgress
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from tests.integration.helpers import dead_letters, drive, finalized_records, publish_groups, setup_topics
from workers.ops.redrive import redrive
from workers.reassembler.changelog import read_changelog
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.restore import restore_partition
from workers.reassembler.worker import ReassemblerWorker


def _worker(kafka, tq_store, names, worker_id):
    config = ReassemblerConfig(
        prefix=names.prefix,
        worker_id=worker_id,
        consumer_group=f"reassemblers.{names.prefix}",
        max_closed_groups=2,
        group_timeout_s=5.0,
    )
    return ReassemblerWorker(kafka, tq_store, config)


def _resend(kafka, names, group_id):
    """A straggler: one of the group's receipts again, with the timestamp it was first produced with."""
    first = next(r for r in read_topic(kafka, names.receipts) if r.key == group_id.encode())
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.receipts, first.key, first.value, timestamp_ms=first.timestamp_ms)])
    producer.close()


def _late(kafka, names, group_id):
    return [d for d in dead_letters(kafka, names) if d.error_kind == LATE_RECEIPT and d.source_key == group_id.encode()]


def _count(kafka, names, group_id):
    return sum(r.group_id == group_id for r in finalized_records(kafka, names))


def test_a_straggler_or_redrive_of_a_forgotten_group_is_late_across_a_restart(kafka, tq_store, unique):
    names = setup_topics(kafka, f"horizon-{unique}", partitions=1)
    old = sorted(publish_groups(kafka, tq_store, names, 4, prefix="h"))
    w0 = _worker(kafka, tq_store, names, "w0")
    try:
        drive([w0], lambda: len(finalized_records(kafka, names)) >= 4, timeout_s=60)
        newer = sorted(publish_groups(kafka, tq_store, names, 4, prefix="k", seed=1))
        # Only two closed groups are remembered: the older ones fall behind the horizon.
        drive([w0], lambda: len(finalized_records(kafka, names)) >= 8, timeout_s=60)
        drive([w0], lambda: set(w0._tasks[0].groups.closed) <= set(newer), timeout_s=30)
        remembered = set(w0._tasks[0].groups.closed)
        forgotten = old
        _resend(kafka, names, forgotten[0])
        drive([w0], lambda: len(_late(kafka, names, forgotten[0])) == 1, timeout_s=30)
        # The operator redrives the late letter: it keeps its original time, so it is late again.
        report = redrive(kafka, names, reason=LATE_RECEIPT, to_source=True)
        assert len(report.redriven) == 1
        drive([w0], lambda: len(_late(kafka, names, forgotten[0])) == 2, timeout_s=30)
    finally:
        w0.close()

    # A successor restores the horizon from the state topic, reading only from the restore point.
    changelog = read_changelog(kafka, names.state, 0)
    progress = [e.entry for e in changelog.entries if isinstance(e.entry, PartitionProgress)]
    assert progress[-1].horizon_ms > 0
    # None of the forgotten groups' entries is read again, and what is read restores the same memory.
    whole = list(read_topic(kafka, names.state))
    last_forgotten = max(r.offset for r in whole if r.value is not None and r.key in {g.encode() for g in old})
    assert changelog.read_from > last_forgotten
    assert set(restore_partition(0, changelog.entries).groups.closed) == remembered
    w1 = _worker(kafka, tq_store, names, "w1")
    try:
        _resend(kafka, names, forgotten[1])
        drive([w1], lambda: len(_late(kafka, names, forgotten[1])) == 1, timeout_s=60)
    finally:
        w1.close()
    assert [_count(kafka, names, g) for g in old + newer] == [1] * 8
