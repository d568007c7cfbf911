"""Crash drills in the style of Kafka Streams' EOS system tests: SIGKILL workers, check read_committed output.

Workers are real child processes (`rlstream reassemble`) attached to the session's Ray/TQ.
"""

import random
import signal
import subprocess
import threading
import time
from collections import Counter

from streams.tq import STAGING, TQConfig, ray_address
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import spawn_worker
from workers.reassembler.worker import ReassemblerWorker


def _spawn(kafka, names, group, worker_id, crash_point=None, tmp_path=None):
    cfg = ReassemblerConfig(prefix=names.prefix, worker_id=worker_id, consumer_group=group, crash_point=crash_point)
    log = open(  # noqa: SIM115 - the child process writes it after this returns
        tmp_path / f"{worker_id}-{time.monotonic_ns()}.log", "wb"
    )
    return spawn_worker(kafka, cfg, TQConfig(address=ray_address()), stdout=log, stderr=subprocess.STDOUT)


def _assert_exactly_once(kafka, names, groups, tq_store):
    records = finalized_records(kafka, names)
    counts = Counter(r.group_id for r in records)
    assert set(counts) == set(groups), f"missing {sorted(set(groups) - set(counts))[:5]}"
    assert max(counts.values()) == 1, f"duplicates: {[g for g, c in counts.items() if c > 1][:5]}"
    keys = [c.staging_key for g in groups.values() for r in g for c in r.receipt.manifest]
    return records, keys


def test_sigkill_at_random_points_loses_nothing_and_emits_nothing_twice(kafka, tq_store, unique, tmp_path):
    names = setup_topics(kafka, f"crash-{unique}", partitions=4)
    group = f"reassemblers.crash.{unique}"
    rng = random.Random(7)
    groups: dict = {}
    kills_done = threading.Event()

    def produce():
        # Keep receipts flowing for the whole drill, so every run has groups to finalize when it dies.
        wave = 0
        while not kills_done.is_set() or wave < 4:
            groups.update(publish_groups(kafka, tq_store, names, 10, seed=wave, prefix=f"w{wave}-"))
            wave += 1
            time.sleep(1.5)

    producer = threading.Thread(target=produce)
    producer.start()
    survivor = _spawn(kafka, names, group, "survivor", tmp_path=tmp_path)
    kills = []
    try:
        # Four kills at random instants and one run that kills itself between TQ put and commit.
        for run in range(5):
            crash = "after_tq_put" if run == 2 else None
            victim = _spawn(kafka, names, group, "victim", crash_point=crash, tmp_path=tmp_path)
            if crash is None:
                time.sleep(rng.uniform(6.0, 12.0))
                victim.send_signal(signal.SIGKILL)
            assert victim.wait(timeout=120) == -signal.SIGKILL
            kills.append(run)
        kills_done.set()
        producer.join()
        final = _spawn(kafka, names, group, "victim", tmp_path=tmp_path)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if len({r.group_id for r in finalized_records(kafka, names)}) >= len(groups):
                break
            time.sleep(2)
        # Let the survivors commit their post-finalization staging clears.
        time.sleep(3)
    finally:
        kills_done.set()
        for p in [survivor] + ([final] if "final" in locals() else []):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        producer.join()
    assert len(kills) == 5
    records, keys = _assert_exactly_once(kafka, names, groups, tq_store)
    assert all(r.valid_row_count == 8 for r in records)
    assert tq_store.present(STAGING, keys) == set()


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
        drive(
            [a, b, c], lambda: len({r.group_id for r in finalized_records(kafka, names)}) >= len(groups), timeout_s=180
        )
        assert c._consumer.assignment(), "the third worker never received partitions"
    finally:
        for w in (a, b, c):
            if w is not None:
                w.close()
    _, keys = _assert_exactly_once(kafka, names, groups, tq_store)
    assert tq_store.present(STAGING, keys) == set()
