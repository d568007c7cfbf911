"""Failover edges against the real broker and TQ: a commit stalled past the transaction timeout is ridden
out, not taken for a live twin; staged rows no receipt names are swept."""

import time

from streams.tq import STAGING
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from tests.tools.faults import SlowCommit
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group
from workers.telemetry.sensors import ReassemblerStats


def _config(names, **kw):
    return ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=f"reassemblers.{names.prefix}", **kw)


def test_a_commit_stalled_past_the_transaction_timeout_is_ridden_out_and_the_group_finalized_once(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"txto-{unique}", partitions=1)
    groups = publish_groups(kafka, tq_store, names, 2, prefix=f"{unique}-")
    # The broker aborts transactions open past 2 s (it checks every second): the first commit is
    # held for 4 s, as a coordinator lost with its broker would hold it, and comes back fenced.
    config = _config(names, transaction_timeout_ms=2000, session_timeout_ms=6000)
    worker = ReassemblerWorker(kafka, tq_store, config, faults=SlowCommit(4.0))
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 2, timeout_s=90)
    finally:
        worker.close()
    assert sorted(r.group_id for r in finalized_records(kafka, names)) == sorted(groups)


def test_staged_rows_whose_publish_never_happened_are_swept_and_counted(kafka, tq_store, unique):
    names = setup_topics(kafka, f"sweep-{unique}", partitions=2)
    orphans = make_group(f"{unique}-orphan", 0, 1)
    stage_rollouts(tq_store, orphans)  # staged, then the publish failed: no receipt names these rows
    orphan_keys = [c.staging_key for r in orphans for c in r.receipt.manifest]
    groups = publish_groups(kafka, tq_store, names, 3, prefix=f"{unique}-g")
    stats = ReassemblerStats()
    config = _config(names, group_timeout_s=1.0, staging_sweep_age_s=3.0, staging_sweep_interval_s=0.5)
    worker = ReassemblerWorker(kafka, tq_store, config, sensor=stats)
    started = time.monotonic()
    try:
        # Waits for these orphans to go, not for a count: the session's TQ may hold older rows of
        # other tests, which the sweeper counts too.
        drive(
            [worker],
            lambda: len(finalized_records(kafka, names)) >= 3 and not tq_store.present(STAGING, orphan_keys),
            60,
        )
    finally:
        worker.close()
    assert time.monotonic() - started >= 3.0 - 1.0, "swept before its age"
    assert stats.swept >= len(orphan_keys)
    assert sorted(r.group_id for r in finalized_records(kafka, names)) == sorted(groups)
