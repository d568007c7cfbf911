"""Cooperative rebalancing: a worker joining the group takes partitions without stopping the others'.

With eager assignment every member gives up every partition at each join or death, and restores all
of them from the state topic again; cooperative-sticky moves only the partitions that change owner.
"""

from collections import Counter

from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker


def _worker(kafka, tq_store, names, worker_id):
    config = ReassemblerConfig(prefix=names.prefix, worker_id=worker_id, consumer_group=f"rb.{names.prefix}")
    return ReassemblerWorker(kafka, tq_store, config)


def test_a_joining_worker_moves_only_the_partitions_it_takes(kafka, tq_store, unique):
    names = setup_topics(kafka, f"rb-{unique}", partitions=4)
    first = publish_groups(kafka, tq_store, names, 8, prefix="a")
    w0 = _worker(kafka, tq_store, names, "w0")
    workers = [w0]
    try:
        drive(workers, lambda: len(finalized_records(kafka, names)) >= 8, timeout_s=120)
        # Nothing left to commit (cleared staging recorded): no step of w0 can be aborted by the
        # rebalance, which would rebuild its tasks for a reason other than the assignment.
        drive(workers, lambda: not any(t.has_work for t in w0._tasks.values()), timeout_s=60)
        before = dict(w0._tasks)
        assert sorted(before) == [0, 1, 2, 3]

        w1 = _worker(kafka, tq_store, names, "w1")
        workers.append(w1)
        drive(workers, lambda: w1._tasks and len(w0._tasks) + len(w1._tasks) == 4, timeout_s=120)
        kept = sorted(w0._tasks)
        assert kept and len(kept) < 4, kept
        # The partitions w0 kept were never revoked and restored: the same task objects go on.
        assert all(w0._tasks[p] is before[p] for p in kept), "w0's kept partitions were restored again"

        second = publish_groups(kafka, tq_store, names, 8, prefix="b")
        drive(workers, lambda: len(finalized_records(kafka, names)) >= 16, timeout_s=120)
    finally:
        for w in workers:
            w.close()
    counts = Counter(r.group_id for r in finalized_records(kafka, names))
    assert sorted(counts) == sorted([*first, *second]) and set(counts.values()) == {1}
