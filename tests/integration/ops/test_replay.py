"""Replay topics against the real broker and TQ: exact slices, and a replay run isolated from production."""

import time

from streams.admin import TopicSpec, create_topics, partition_count
from streams.consumer import committed_offsets, end_offsets, read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from workers.ops.replay import parse_partition_offsets, replay
from workers.ops.replay_run import prepare_replay_run, replay_train_partition
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.topics import TopicNames


def _records(kafka, topic):
    return list(read_topic(kafka, topic))


def _assert_consumed_to_the_end(kafka, consumer_group, topic):
    """The consumer group's committed offsets are past every record of the topic, and not past its end."""
    last = {}
    for r in read_topic(kafka, topic):
        last[r.partition] = r.offset
    committed = committed_offsets(kafka, consumer_group, topic)
    ends = end_offsets(kafka, topic)
    assert last, f"{topic} is empty"
    for p, off in last.items():
        assert off < committed[p] <= ends[p][1], (p, off, committed[p], ends[p])


def test_replay_time_range_and_group_ids_copy_exactly_the_matching_records(kafka, unique):
    prefix = f"rp-{unique}"
    src = f"{prefix}.rollout.receipts"
    create_topics(kafka, [TopicSpec(src, 3)])
    base = int(time.time() * 1000) - 100_000
    out = []
    for i in range(30):
        gid = f"g{i % 6}"
        out.append(
            Outgoing(
                src,
                gid.encode(),
                f"v{i}".encode(),
                headers=[("h", f"{i}".encode()), ("x", b"y")],
                partition=i % 3,
                timestamp_ms=base + i * 1000,
            )
        )
    AckedProducer(kafka).send(out)
    source = _records(kafka, src)
    assert len(source) == 30

    report = replay(
        kafka, src, "window", prefix=prefix, time_range_ms=(base + 5000, base + 20000), group_ids={"g1", "g2", "g3"}
    )
    dest = TopicNames(prefix).replay("window")
    assert report.dest_topic == dest and report.created
    assert partition_count(kafka, dest) == 3
    want = [r for r in source if base + 5000 <= r.timestamp_ms < base + 20000 and r.key in (b"g1", b"g2", b"g3")]
    got = _records(kafka, dest)
    key = lambda r: (r.partition, r.value)
    assert sorted(map(key, got)) == sorted(map(key, want)) and len(got) == len(want) == 7
    by_value = {r.value: r for r in want}
    for r in got:
        src_rec = by_value[r.value]
        assert (r.key, r.headers, r.timestamp_ms, r.partition) == (
            src_rec.key,
            src_rec.headers,
            src_rec.timestamp_ms,
            src_rec.partition,
        )
    assert report.total == 7 and sum(report.copied.values()) == 7
    assert report.copied == {
        p: sum(1 for r in want if r.partition == p) for p in range(3) if any(r.partition == p for r in want)
    }

    # Offset ranges (inclusive) per partition, into a second replay topic.
    report = replay(kafka, src, "offsets", prefix=prefix, offsets=parse_partition_offsets("0:2-4,2:0-0"))
    got = _records(kafka, TopicNames(prefix).replay("offsets"))
    assert sorted((r.partition, r.value) for r in got) == sorted(
        (r.partition, r.value)
        for r in source
        if (r.partition == 0 and 2 <= r.offset <= 4) or (r.partition == 2 and r.offset == 0)
    )
    assert report.scanned == {0: 3, 2: 1}


# A replay process that copies `cut` records, gives the client a moment to send them, and dies.
_DYING_REPLAY = """
import os, signal, sys, time
import workers.ops.replay as replay_module
from streams.config import KafkaConfig

bootstrap, source, prefix, cut = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
read_topic = replay_module.read_topic

def dying(*args, **kwargs):
    for i, rec in enumerate(read_topic(*args, **kwargs)):
        if i == cut:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        yield rec

replay_module.read_topic = dying
replay_module.replay(KafkaConfig(bootstrap), source, "cut", prefix=prefix)
"""


def test_a_replay_killed_mid_copy_shows_nothing_and_a_rerun_copies_the_slice_once(kafka, unique):
    import signal
    import subprocess
    import sys

    prefix = f"rk-{unique}"
    src = f"{prefix}.rollout.receipts"
    create_topics(kafka, [TopicSpec(src, 3)])
    AckedProducer(kafka).send(
        [Outgoing(src, f"g{i % 5}".encode(), f"v{i}".encode(), partition=i % 3) for i in range(30)]
    )
    dest = TopicNames(prefix).replay("cut")
    proc = subprocess.run(
        [sys.executable, "-c", _DYING_REPLAY, kafka.bootstrap_servers, src, prefix, "12"],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # The dead copy's records reached the log, but a read_committed reader sees none of them.
    assert len(list(read_topic(kafka, dest, read_committed=False))) == 12
    assert _records(kafka, dest) == []

    # The rerun's transactional id is derived from the destination: it aborts the orphan at once
    # (else read_committed readers would stall behind it until its timeout) and copies the slice once.
    report = replay(kafka, src, "cut", prefix=prefix)
    assert report.total == 30 and not report.created
    got = _records(kafka, dest)
    assert sorted((r.partition, r.key, r.value) for r in got) == sorted(
        (r.partition, r.key, r.value) for r in _records(kafka, src)
    )
    assert len(list(read_topic(kafka, dest, read_committed=False))) == 30 + 12


def _rows(store, partition, record):
    return store.get(partition, list(record.sample_ids), select=["input_ids"])["input_ids"].unbind()


def _outcome(r):
    fields = ("sample_ids", "tags", "valid_row_count", "total_row_count", "rejection_reasons", "group_min_wv")
    return tuple(getattr(r, f) for f in (*fields, "canonical_output_tokens"))


def test_replay_run_reproduces_finalized_records_without_touching_production(kafka, tq_store, unique):
    prefix = f"rr-{unique}"
    names = setup_topics(kafka, prefix, partitions=3)
    groups = publish_groups(kafka, tq_store, names, 10, weight_version=4, prefix=f"{unique}-")
    chosen = {gid for gid in sorted(groups)[:5]}

    report = replay(kafka, names.receipts, "debug", prefix=prefix, group_ids=chosen, weight_versions=(3, 5))
    assert report.total == 5 * 8
    nothing = replay(kafka, names.receipts, "none", prefix=prefix, weight_versions=(5, 9))
    assert nothing.total == 0

    # The replay run first: it must not clear the staged tensors production still needs.
    run_names = TopicNames(f"{prefix}.run1")
    cfg = prepare_replay_run(
        kafka,
        ReassemblerConfig(
            prefix=run_names.prefix,
            worker_id="replay0",
            consumer_group=f"replay.{unique}",
            input_topic=report.dest_topic,
        ),
    )
    assert cfg.actor.partition_id == replay_train_partition(run_names.prefix) and not cfg.clear_staging
    rw = ReassemblerWorker(kafka, tq_store, cfg)
    try:
        drive([rw], lambda: len(finalized_records(kafka, run_names)) >= 5, timeout_s=120)
    finally:
        rw.close()
    assert finalized_records(kafka, names) == [] and list(read_topic(kafka, names.state)) == []
    # The replay run's own consumer group holds its place in the replay topic, to the end of the slice;
    # production's consumer group has no place anywhere yet.
    _assert_consumed_to_the_end(kafka, f"replay.{unique}", report.dest_topic)
    production_group = f"reassemblers.{prefix}"
    assert committed_offsets(kafka, production_group, names.receipts) == {p: -1001 for p in range(3)}
    keys = [c.staging_key for gid in chosen for r in groups[gid] for c in r.receipt.manifest]
    assert tq_store.present(STAGING, keys) == set(keys)

    prod = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="p0", consumer_group=production_group)
    )
    try:
        drive([prod], lambda: len(finalized_records(kafka, names)) >= 10, timeout_s=120)
    finally:
        prod.close()
    _assert_consumed_to_the_end(kafka, production_group, names.receipts)
    replayed = {r.group_id: r for r in finalized_records(kafka, run_names)}
    original = {r.group_id: r for r in finalized_records(kafka, names)}
    assert set(replayed) == chosen and set(original) == set(groups)
    for gid in chosen:
        a, b = replayed[gid], original[gid]
        assert _outcome(a) == _outcome(b)
        assert a.partition_id == replay_train_partition(run_names.prefix) and b.partition_id == TRAIN
        assert a.source.topic == report.dest_topic
    first = sorted(chosen)[0]
    rows = _rows(tq_store, replay_train_partition(run_names.prefix), replayed[first])
    assert all(x.equal(y) for x, y in zip(rows, _rows(tq_store, TRAIN, original[first])))
    tq_store.clear(TRAIN, [s for r in original.values() for s in r.sample_ids])
    tq_store.clear(replay_train_partition(run_names.prefix), [s for r in replayed.values() for s in r.sample_ids])


def test_replay_run_refuses_production_group_and_prefix(kafka, unique):
    import pytest

    names = setup_topics(kafka, f"rg-{unique}", partitions=1)
    replay(kafka, names.receipts, "x", prefix=names.prefix)
    topic = names.replay("x")
    with pytest.raises(ValueError, match="--prefix"):
        prepare_replay_run(
            kafka, ReassemblerConfig(prefix=names.prefix, worker_id="a", consumer_group="mine", input_topic=topic)
        )
    with pytest.raises(ValueError, match="--consumer-group"):
        prepare_replay_run(kafka, ReassemblerConfig(prefix="other", worker_id="a", input_topic=topic))


def test_replay_and_reassemble_cli(kafka, unique):
    import subprocess
    import sys

    names = setup_topics(kafka, f"rc-{unique}", partitions=2)
    AckedProducer(kafka).send(
        [Outgoing(names.receipts, f"g{i}".encode(), f"v{i}".encode(), partition=i % 2) for i in range(10)]
    )

    def cli(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "workers.cli.main",
                *args,
                "--bootstrap-servers",
                kafka.bootstrap_servers,
                "--prefix",
                names.prefix,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    res = cli(
        "replay",
        names.receipts,
        "--to",
        "cli",
        "--partition-offsets",
        "0:1-3,1:0-1",
        "--group-id",
        "g2",
        "--group-id",
        "g3",
    )
    assert res.returncode == 0, res.stderr
    assert f"copying {names.receipts} to {names.replay('cli')}" in res.stderr
    assert res.stdout.splitlines()[0] == f"2 record(s) copied from {names.receipts} to {names.replay('cli')} (created)"
    assert sorted((r.partition, r.value) for r in read_topic(kafka, names.replay("cli"))) == [(0, b"v2"), (1, b"v3")]

    res = cli("replay", "no.such.topic", "--to", "x")
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("rlstream replay: topic no.such")
    res = cli("reassemble", "--input-topic", names.replay("cli"), "--consumer-group", f"own.{unique}")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith("rlstream reassemble: input ") and "--prefix" in res.stderr
