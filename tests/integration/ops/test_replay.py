"""Replay topics against the real broker and TQ: exact slices, and a replay run isolated from production."""

import time

from streams.admin import TopicSpec, create_topics, partition_count
from streams.consumer import committed_offsets, read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from workers.ops.replay import parse_partition_offsets, replay
from workers.ops.replay_run import prepare_replay_run, replay_train_partition
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.topics import TopicNames


def _records(kafka, topic):
    return list(read_topic(kafka, topic))


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
    assert finalized_records(kafka, names) == []
    assert committed_offsets(kafka, "reassemblers", names.receipts) == {p: -1001 for p in range(3)}
    keys = [c.staging_key for gid in chosen for r in groups[gid] for c in r.receipt.manifest]
    assert tq_store.present(STAGING, keys) == set(keys)

    prod = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="p0", consumer_group=f"reassemblers.{prefix}")
    )
    try:
        drive([prod], lambda: len(finalized_records(kafka, names)) >= 10, timeout_s=120)
    finally:
        prod.close()
    replayed = {r.group_id: r for r in finalized_records(kafka, run_names)}
    original = {r.group_id: r for r in finalized_records(kafka, names)}
    assert set(replayed) == chosen and set(original) == set(groups)
    for gid in chosen:
        a, b = replayed[gid], original[gid]
        assert (
            a.sample_ids,
            a.tags,
            a.valid_row_count,
            a.total_row_count,
            a.rejection_reasons,
            a.group_min_wv,
            a.canonical_output_tokens,
        ) == (
            b.sample_ids,
            b.tags,
            b.valid_row_count,
            b.total_row_count,
            b.rejection_reasons,
            b.group_min_wv,
            b.canonical_output_tokens,
        )
        assert a.partition_id == replay_train_partition(run_names.prefix) and b.partition_id == "train"
        assert a.source.topic == report.dest_topic
    rows = tq_store.get(
        replay_train_partition(run_names.prefix), list(replayed[sorted(chosen)[0]].sample_ids), select=["input_ids"]
    )["input_ids"].unbind()
    prod_rows = tq_store.get("train", list(original[sorted(chosen)[0]].sample_ids), select=["input_ids"])[
        "input_ids"
    ].unbind()
    assert all(x.equal(y) for x, y in zip(rows, prod_rows))
    tq_store.clear("train", [s for r in original.values() for s in r.sample_ids])
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
