"""Debugging tools against the real broker and real TQ: tail, inspect, redrive, lag, refinalize (via the CLI)."""

import json
import subprocess
import sys
import time

import msgpack
import pytest
import torch

from schemas.deadletter import DECODE_ERROR, INCONSISTENT_GROUP, METADATA_VIOLATION, VALIDATION_ERROR
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN
from tests.integration.helpers import (
    SMALL,
    dead_letters,
    drive,
    finalized_records,
    publish_groups,
    setup_topics,
    stale_clear,
)
from workers.ops.inspect import inspect_group
from workers.ops.lag import lag
from workers.ops.redrive import redrive
from workers.ops.refinalize import refinalize
from workers.ops.replay import replay
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher, StagedRollout, stage_rollouts
from workers.rollout.synthetic import make_group


def _cli(kafka, *args, timeout=240):
    cmd = [sys.executable, "-m", "workers.cli.main", *args, "--bootstrap-servers", kafka.bootstrap_servers]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _worker(kafka, tq_store, names, **kw):
    return ReassemblerWorker(
        kafka,
        tq_store,
        ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=f"reassemblers.{names.prefix}", **kw),
    )


def _keys(rollouts):
    return [c.staging_key for r in rollouts for c in r.receipt.manifest]


def test_tail_of_the_dead_letter_topic_shows_each_poison_receipts_reason(kafka, tq_store, unique):
    names = setup_topics(kafka, f"tail-{unique}", partitions=1)
    groups = publish_groups(kafka, tq_store, names, 1, prefix=f"{unique}-")
    body = msgpack.unpackb(next(iter(groups.values()))[0].receipt.to_bytes())
    AckedProducer(kafka).send(
        [
            Outgoing(names.receipts, b"x", b"\x93\xff\x00garbage"),
            Outgoing(names.receipts, b"y", msgpack.packb(dict(body, schema_version=[9, 0]))),
            Outgoing(names.receipts, b"z", msgpack.packb(dict(body, token_ids=list(range(64))))),
        ]
    )
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: len(dead_letters(kafka, names)) >= 3 and finalized_records(kafka, names), timeout_s=120)
    finally:
        worker.close()
    res = _cli(kafka, "tail", names.deadletter, "--prefix", names.prefix, "--from-beginning", "--idle-exit", "3")
    assert res.returncode == 0, res.stderr
    assert names.deadletter in res.stderr and "from the beginning" in res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    by_key = {d["key"]: d for d in lines}
    assert len(lines) == 3
    assert by_key["x"]["error_kind"] == DECODE_ERROR and "not MessagePack" in by_key["x"]["message"]
    assert by_key["y"]["error_kind"] == VALIDATION_ERROR and "schema_version" in by_key["y"]["message"]
    assert by_key["z"]["error_kind"] == METADATA_VIOLATION and "token_ids" in by_key["z"]["message"]
    assert all(d["kind"] == "dead_letter" and d["value"]["source_topic"] == names.receipts for d in lines)

    # The finalized topic decodes by its role too, and --group-id keeps only that group.
    gid = next(iter(groups))
    res = _cli(kafka, "tail", names.finalized, "--from-beginning", "--group-id", gid, "--max-records", "1")
    assert res.returncode == 0, res.stderr
    (rec,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert rec["kind"] == "finalized_group" and rec["value"]["group_id"] == gid
    assert rec["value"]["sample_ids"] == [f"{gid}_g{i}" for i in range(8)]
    tq_store.clear(TRAIN, rec["value"]["sample_ids"])

    res = _cli(kafka, "tail", f"{names.prefix}.no.such.topic", "--idle-exit", "1")
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("rlstream tail:")


# About a minute (CLI runs that each attach to Ray): in make drills, to keep make test under 20 minutes.
@pytest.mark.drill
def test_redrive_of_a_fixed_group_finalizes_it_and_a_failing_one_is_not_redriven_in_a_loop(kafka, tq_store, unique):
    names = setup_topics(kafka, f"rd-{unique}", partitions=2)
    fixed, broken = make_group(f"{unique}-fixed", 0, 2, shape=SMALL), make_group(f"{unique}-broken", 1, 2, shape=SMALL)
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(fixed + broken)
    pub.close()
    # The staged tensors of both groups are lost (say, a TQ storage unit restarted): both are dead-lettered.
    tq_store.clear(STAGING, _keys(fixed) + _keys(broken))
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: len(dead_letters(kafka, names)) >= 16, timeout_s=120)
        first = dead_letters(kafka, names)
        assert len(first) == 16 and {d.error_kind for d in first} == {INCONSISTENT_GROUP}
        assert all(d.redrive_count == 0 for d in first) and finalized_records(kafka, names) == []

        # The fix: the rollout worker re-stages the first group's tensors.
        stage_rollouts(tq_store, fixed)
        dry = _cli(kafka, "deadletter", "redrive", "--prefix", names.prefix, "--reason", INCONSISTENT_GROUP)
        assert dry.returncode == 0, dry.stderr
        assert "would redrive 16 dead letter(s)" in dry.stdout and names.deadletter in dry.stderr

        res = _cli(
            kafka, "deadletter", "redrive", "--prefix", names.prefix, "--reason", INCONSISTENT_GROUP, "--to-source"
        )
        assert res.returncode == 0, res.stderr
        assert f"redrove 16 dead letter(s) from {names.deadletter}; 16 to {names.receipts}" in res.stdout
        again = redrive(kafka, names, reason=INCONSISTENT_GROUP, to_source=True)
        assert again.redriven == [] and again.skipped_max == 0
        assert len(list(read_topic(kafka, names.receipts))) == 32

        drive(
            [worker],
            lambda: len(finalized_records(kafka, names)) >= 1 and len(dead_letters(kafka, names)) >= 24,
            timeout_s=120,
        )
        (rec,) = finalized_records(kafka, names)
        assert rec.group_id == f"{unique}-fixed" and rec.valid_row_count == 8
        second = dead_letters(kafka, names)[16:]
        assert len(second) == 8 and {d.redrive_count for d in second} == {1}
        assert {json.loads(json.dumps(d.source_key.decode())) for d in second} == {f"{unique}-broken"}

        third = redrive(kafka, names, to_source=True)
        assert third.redriven == [] and third.skipped_max == 8 and third.already_done == 16
        t_end = time.monotonic() + 4
        drive([worker], lambda: time.monotonic() > t_end, timeout_s=30)
        assert len(dead_letters(kafka, names)) == 24 and len(finalized_records(kafka, names)) == 1

        info = inspect_group(kafka, names, f"{unique}-fixed", store=tq_store)
        assert info["summary"] == {
            "receipts": 16,
            "state_entries": info["summary"]["state_entries"],
            "finalized_records": 1,
            "dead_letters": 8,
            "outcome": "finalized",
        }
        # Closed dead-lettered, cleared, closed finalized (its cleared entry may still be to record); OPEN
        # entries are not written for a group that opens and closes in one step.
        assert info["summary"]["state_entries"] >= 3
        assert set(info["tq"]["sample_ids"]) == set(rec.sample_ids) and all(info["tq"]["sample_ids"].values())
        assert info["tq"]["staging_keys"] and not any(info["tq"]["staging_keys"].values())
        res = _cli(kafka, "inspect", "group", f"{unique}-broken", "--prefix", names.prefix, "--no-tq")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["summary"]["outcome"] == "dead_lettered"

        rows = lag(kafka, names, reassembler_consumer_group=f"reassemblers.{names.prefix}")
        mine = [r for r in rows if r.topic == names.receipts]
        # Everything consumed: the only offset past the committed one is the redrive transaction's commit
        # marker, which a consumer never receives (so, as in Kafka's own tools, it counts as lag 1).
        # (Both groups may hash to one partition; the other then has no record and no committed offset.)
        assert len(mine) == 2 and sum(r.committed or 0 for r in mine) == 32
        assert all(r.lag == r.end - (r.committed or 0) <= 1 for r in mine)
        trainer = [r for r in rows if r.topic == names.finalized]
        assert sum(r.lag for r in trainer) >= 1 and all(r.committed is None for r in trainer)
    finally:
        worker.close()
    res = _cli(kafka, "lag", "--prefix", names.prefix, "--consumer-group", f"reassemblers.{names.prefix}")
    assert res.returncode == 0, res.stderr
    table = [line.split("\t") for line in res.stdout.splitlines()[1:]]
    assert [(t[0], t[1], t[3]) for t in table if t[1] == names.receipts] == [
        (f"reassemblers.{names.prefix}", names.receipts, "-" if r.committed is None else str(r.committed)) for r in mine
    ]
    assert [(t[0], t[3]) for t in table if t[1] == names.finalized] == [("trainer", "-")] * 2
    tq_store.clear(TRAIN, list(rec.sample_ids))


# About 90 s (a TQ checkpoint of the whole session's TQ, two CLI runs each loading it into a TQ of their
# own): in make drills, to keep make test under 20 minutes.
@pytest.mark.drill
def test_refinalize_finds_no_difference_then_exactly_the_changed_staged_tensor(kafka, tq_store, unique, tmp_path):
    import transfer_queue as tq

    names = setup_topics(kafka, f"rf-{unique}", partitions=2)
    groups = publish_groups(kafka, tq_store, names, 4, prefix=f"{unique}-rf")
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 4, timeout_s=120)
    finally:
        worker.close()
    report = replay(kafka, names.receipts, "all", prefix=names.prefix)
    assert report.total == 32

    # The checkpoint an operator would keep: staged tensors (re-staged here; production cleared them) and train.
    rollouts = [r for g in groups.values() for r in g]
    stage_rollouts(tq_store, rollouts)
    tq.save_checkpoint(tmp_path / "same")
    target_gid = sorted(groups)[1]
    victim = groups[target_gid][2]
    seg = dict(victim.segments[-1])
    seg["generation_logprobs"] = seg["generation_logprobs"].clone()
    seg["generation_logprobs"][-1] += 0.5
    stage_rollouts(tq_store, [StagedRollout(victim.receipt, list(victim.segments[:-1]) + [seg])])
    tq.save_checkpoint(tmp_path / "changed")
    tq_store.clear(STAGING, _keys(rollouts))

    same = _cli(
        kafka, "refinalize", "--from", "replay.all", "--prefix", names.prefix, "--tq-checkpoint", str(tmp_path / "same")
    )
    assert same.returncode == 0, same.stderr + same.stdout
    assert same.stdout == "" and "0 difference(s)" in same.stderr
    changed = _cli(
        kafka,
        "refinalize",
        "--from",
        "replay.all",
        "--prefix",
        names.prefix,
        "--tq-checkpoint",
        str(tmp_path / "changed"),
    )
    assert changed.returncode == 1, changed.stderr
    assert changed.stdout.splitlines() == [f"group {target_gid} row 2 generation_logprobs differs (max abs diff 0.5)"]
    # The session TQ was not touched by the loads: its train rows are still the recorded ones.
    recs = {r.group_id: r for r in finalized_records(kafka, names)}
    got = tq_store.get(TRAIN, [recs[target_gid].sample_ids[2]], select=["generation_logprobs"])
    want = torch.cat([s["generation_logprobs"] for s in victim.segments])
    assert torch.equal(got["generation_logprobs"].unbind()[0], want)
    tq_store.clear(TRAIN, [s for r in recs.values() for s in r.sample_ids])


def test_refinalize_reads_a_train_row_a_stale_clear_deleted_as_a_missing_row_not_a_crash(kafka, tq_store, unique):
    names = setup_topics(kafka, f"rs-{unique}", partitions=2)
    groups = publish_groups(kafka, tq_store, names, 2, prefix=f"{unique}-rs")
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 2, timeout_s=120)
    finally:
        worker.close()
    replay(kafka, names.receipts, "all", prefix=names.prefix)
    rollouts = [r for g in groups.values() for r in g]
    stage_rollouts(tq_store, rollouts)  # the staged tensors an operator's TQ checkpoint keeps
    target = sorted(groups)[0]
    record = {r.group_id: r for r in finalized_records(kafka, names)}[target]
    # TQ still maps this train row, ready, but a clear whose lookup went stale deleted its storage.
    stale_clear(TRAIN, [record.sample_ids[0]])
    try:
        diffs = refinalize(kafka, names.replay("all"), prefix=names.prefix, store=tq_store)
        assert [(d.group_id, d.field) for d in diffs] == [(target, "train_rows")]
        assert "1 row(s) missing" in diffs[0].detail and record.sample_ids[0] in diffs[0].detail
    finally:
        tq_store.clear(STAGING, _keys(rollouts))
        tq_store.clear(TRAIN, [s for r in finalized_records(kafka, names) for s in r.sample_ids])
