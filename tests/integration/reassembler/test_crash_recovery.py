"""Crash drills in the style of Kafka Streams' EOS system tests: a worker dies mid-step, a successor takes over.

Each case runs a real child process (`rlstream reassemble`) configured with a crash point: it SIGKILLs
itself at that point of its first step with work, which holds complete prompt groups because their
receipts were published whole before it started. The test first checks that something was at
stake when it died (rows put but not committed; an open transaction holding finalized records; a
committed step whose staging was not cleared), then lets a successor with the same worker id take
over, and checks with a fresh read_committed consumer that every group was finalized exactly once
and that no staged tensor is left. Random-time kills, a zombie and a broker loss are in the chaos
drill (`tests/tools/chaos`, `make chaos`).
"""

import signal
import subprocess
import time
from collections import Counter

import pytest

from schemas.finalized import FinalizedGroup
from streams.consumer import read_topic
from streams.tq import STAGING, TRAIN, TQConfig, ray_address
from tests.integration.helpers import SMALL, drive, finalized_records, publish_groups, setup_topics
from tests.tools.drill_worker import spawn_drill_worker
from tests.tools.faults import CRASH_POINTS
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import make_group
from workers.topics import TopicNames

GROUPS = 12


def _spawn(kafka, names, group, worker_id, crash_point=None, tmp_path=None):
    cfg = ReassemblerConfig(prefix=names.prefix, worker_id=worker_id, consumer_group=group)
    log = open(  # noqa: SIM115 - the child process writes it after this returns
        tmp_path / f"{worker_id}-{time.monotonic_ns()}.log", "wb"
    )
    faults = ["--crash-at", crash_point] if crash_point else []
    tq = TQConfig(address=ray_address())
    return spawn_drill_worker(kafka, cfg, tq, faults=faults, stdout=log, stderr=subprocess.STDOUT)


def _publish_whole_groups(kafka, store, names: TopicNames, n: int, prefix: str) -> dict:
    """Each group's receipts in one acked send, so a fetch never holds part of a group."""
    groups = {f"{prefix}{i:03d}": make_group(f"{prefix}{i:03d}", i, 1, shape=SMALL) for i in range(n)}
    pub = RolloutPublisher(kafka, store, names.receipts)
    try:
        for rollouts in groups.values():
            pub.publish(rollouts)
    finally:
        pub.close()
    return groups


def _staging_keys(groups) -> list[str]:
    return [c.staging_key for g in groups.values() for r in g for c in r.receipt.manifest]


def _sample_ids(groups) -> list[str]:
    return [f"{gid}_g{i}" for gid, g in groups.items() for i in range(len(g))]


def _assert_at_stake(point, kafka, names, groups, tq_store):
    """What the victim left behind shows it died inside a step that mattered."""
    committed = finalized_records(kafka, names)
    if point == "after_tq_put":
        # Rows of some groups are in TQ train, but no record of them was committed.
        assert committed == [] and tq_store.present(TRAIN, _sample_ids(groups)), "no rows put before the crash"
    elif point == "before_commit":
        # Finalized records are in the log inside a transaction that never committed.
        uncommitted = list(read_uncommitted(kafka, names))
        assert committed == [] and uncommitted, "no finalized record produced before the crash"
    else:
        # The step committed, but its staged tensors were never cleared.
        assert committed, "nothing committed before the crash"
        done = {r.group_id: groups[r.group_id] for r in committed}
        assert tq_store.present(STAGING, _staging_keys(done)), "staging of committed groups was cleared"
    return {r.group_id for r in committed}


def read_uncommitted(kafka, names):
    return read_topic(kafka, names.finalized, read_committed=False)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_worker_killed_at_each_crash_point_loses_nothing_and_emits_nothing_twice(
    point, kafka, tq_store, unique, tmp_path
):
    names = setup_topics(kafka, f"crash-{point.replace('_', '')}-{unique}", partitions=2)
    group = f"reassemblers.crash.{unique}"
    groups = _publish_whole_groups(kafka, tq_store, names, GROUPS, prefix=f"{unique}-")
    victim = _spawn(kafka, names, group, "w0", crash_point=point, tmp_path=tmp_path)
    try:
        assert victim.wait(timeout=120) == -signal.SIGKILL, f"the worker did not die at {point}"
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    by_victim = _assert_at_stake(point, kafka, names, groups, tq_store)

    # The successor takes the victim's worker id, as a restarted pod would: it fences any open
    # transaction of its predecessor at once, restores from the state topic and carries on.
    successor = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=group)
    )
    try:
        # Until it holds both partitions, too: after an `after_commit` kill everything is already
        # finalized, and what is left to check is the successor's restore clearing the staging.
        drive(
            [successor],
            lambda: len(successor._tasks) == 2 and len({r.group_id for r in finalized_records(kafka, names)}) >= GROUPS,
            180,
        )
    finally:
        successor.close()

    records = _assert_exactly_once(kafka, names, groups)  # a fresh read_committed consumer
    assert all(r.valid_row_count == len(groups[r.group_id]) for r in records)
    left = {k.rsplit("-r", 1)[0] for k in tq_store.present(STAGING, _staging_keys(groups))}
    assert not left, f"staging left of {sorted(left)}; committed by the victim: {sorted(by_victim)}"
    assert tq_store.present(TRAIN, _sample_ids(groups)) == set(_sample_ids(groups))
    if point == "before_commit":
        # Without the transaction those aborted records would be the duplicates a trainer sees.
        everything = Counter(FinalizedGroup.from_bytes(r.value).group_id for r in read_uncommitted(kafka, names))
        assert any(c > 1 for c in everything.values())
    tq_store.clear(TRAIN, _sample_ids(groups))


def _assert_exactly_once(kafka, names, groups):
    records = finalized_records(kafka, names)
    counts = Counter(r.group_id for r in records)
    assert set(counts) == set(groups), f"missing {sorted(set(groups) - set(counts))[:5]}"
    assert max(counts.values()) == 1, f"duplicates: {[g for g, c in counts.items() if c > 1][:5]}"
    return records


def test_two_workers_split_partitions_and_a_third_joins_mid_run(kafka, tq_store, unique):
    names = setup_topics(kafka, f"join-{unique}", partitions=6)
    group = f"reassemblers.join.{unique}"
    mk = lambda wid: ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id=wid, consumer_group=group)
    )
    a, b = mk("a"), mk("b")
    groups = publish_groups(kafka, tq_store, names, 60, prefix="first-")
    c = None
    try:
        drive([a, b], lambda: bool(a._consumer.assignment()) and bool(b._consumer.assignment()), timeout_s=60)
        assert {tp.partition for tp in a._consumer.assignment()}.isdisjoint(
            {tp.partition for tp in b._consumer.assignment()}
        )
        drive([a, b], lambda: len(finalized_records(kafka, names)) >= 20, timeout_s=120)
        c = mk("c")
        groups.update(publish_groups(kafka, tq_store, names, 60, prefix="second-"))
        # Until c holds partitions too: a and b alone may finalize every group before c's join completes.
        drive(
            [a, b, c],
            lambda: (
                bool(c._consumer.assignment())
                and len({r.group_id for r in finalized_records(kafka, names)}) >= len(groups)
            ),
            timeout_s=180,
        )
        assert c._consumer.assignment(), "the third worker never received partitions"
    finally:
        for w in (a, b, c):
            if w is not None:
                w.close()
    _assert_exactly_once(kafka, names, groups)
    assert tq_store.present(STAGING, _staging_keys(groups)) == set()
