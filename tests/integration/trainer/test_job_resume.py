"""`rlstream resume` after TQ lost everything: what the checkpoint's spill kept comes back, the rest is handed back.

A checkpointing trainer trains two groups and checkpoints (its state and a spill of TQ's rows); two
more groups are finalized after the checkpoint and one more is staged and published but not yet
finalized; then every row of the run vanishes from TQ, as when the job dies whole. `rlstream resume`
puts back the rows of the groups the checkpoint did not count as trained and of the open group, and
a trainer restored from the checkpoint then trains exactly the untrained groups whose rows came
back and hands back the two finalized after it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from schemas.finalized import FinalizedGroup
from schemas.regenerate import TRAIN_ROWS_LOST, Regenerate
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN, ray_address
from tests.integration.helpers import SMALL, drive, finalized_records
from tests.integration.trainer.staging import committed_at_end, finalize_groups
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import make_group
from workers.trainer.checkpoint_dir import load_state, save_into_checkpoint
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first
from workers.trainer.resolved import RESOLVED_FILE
from workers.trainer.resume import resume

ROOT = Path(__file__).resolve().parents[3]


def _consumer(kafka, store, names, group, yielded):
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True)
    return ExperienceConsumer(
        kafka, store, config, ready_first(), version=10, on_yield=lambda g, v: yielded.append(g.group_id)
    )


def _publish(kafka, store, names, groups):
    pub = RolloutPublisher(kafka, store, names.receipts)
    for rollouts in groups:
        pub.publish(rollouts)
    pub.close()


def test_resume_restores_what_the_checkpoint_kept_and_the_trainer_hands_back_the_rest(
    kafka, tq_store, unique, tmp_path
):
    names, finalized = finalize_groups(kafka, tq_store, f"jres-{unique}", versions=range(1), per_version=4)
    reassemblers = f"re-{names.prefix}"  # finalize_groups' worker
    group = f"jres-trainer-{unique}"
    # Half of a group published and left open (its other rollouts never come before the job dies).
    open_group = make_group(f"jres-{unique}-open", 7, 1, shape=SMALL)[:2]
    staged = [c.staging_key for r in open_group for c in r.receipt.manifest]
    yielded: list[str] = []
    first = _consumer(kafka, tq_store, names, group, yielded)
    try:
        batch = first.select(10, min_groups=2, max_groups=2, timeout_s=60)
        assert batch is not None
        first.ack(batch)
        _publish(kafka, tq_store, names, [open_group])
        state, spilled = save_into_checkpoint(tmp_path, first, tq_store)
        first.checkpoint_durable(state)
    finally:
        first.close()
    untrained = sorted(set(finalized) - {g.group_id for g in batch.groups})
    assert spilled is not None and spilled.rows[TRAIN] >= 2 * 8 and spilled.rows[STAGING] >= len(staged)

    # After the checkpoint two more groups are finalized (the open one stays open: its timeout is far off).
    late = [f"jres-{unique}-late-{i}" for i in range(2)]
    _publish(kafka, tq_store, names, [make_group(gid, 20 + i, 1, shape=SMALL) for i, gid in enumerate(late)])
    worker = ReassemblerWorker(
        kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="w", consumer_group=reassemblers)
    )
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 6, timeout_s=120)
    finally:
        worker.close()

    # The job dies whole: TQ comes back empty.
    mine = [*finalized, *late]
    tq_store.clear(TRAIN, [k for k in tq_store.list(TRAIN) if k.rsplit("_g", 1)[0] in mine])
    tq_store.clear(STAGING, staged)

    cli = [sys.executable, "-m", "workers.cli.main", "resume", "--bootstrap-servers", kafka.bootstrap_servers]
    cli += ["--prefix", names.prefix, "--trainer-consumer-group", group, "--consumer-group", reassemblers]
    cli += ["--checkpoint", str(tmp_path), "--ray-address", ray_address()]
    out = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    # Read from the checkpoint's cut: of the groups trained before it, only those past the cut are read.
    assert "finalized records read from the checkpoint's cut:" in out.stdout
    assert "finalized groups restored (16 train rows back in TQ): 2" in out.stdout
    assert "to be handed back (or dead-lettered) by the trainer: 2" in out.stdout
    assert "open groups restored whole: 1," in out.stdout
    assert "unaccounted for: 0" in out.stdout
    assert tq_store.present(STAGING, staged) == set(staged)
    tq_store.clear(STAGING, staged)

    yielded.clear()
    second = _consumer(kafka, tq_store, names, group, yielded)
    try:
        second.load_state_dict(load_state(tmp_path))
        deadline = time.monotonic() + 60
        while second.counts.handed_back < 2 or len(yielded) < len(untrained):
            assert time.monotonic() < deadline, f"yielded {yielded}, counts {second.counts}"
            if (b := second.select(10, min_groups=1, max_groups=8, timeout_s=1.0)) is not None:
                second.ack(b)
    finally:
        second.close()
    assert sorted(yielded) == untrained
    backs = [Regenerate.from_bytes(r.value) for r in read_topic(kafka, names.regenerate)]
    assert sorted(b.group_id for b in backs) == late and {b.reason for b in backs} == {TRAIN_ROWS_LOST}


def _duplicate_past_the_cut(kafka, tq_store, unique, tmp_path, tag):
    """Two groups trained and checkpointed, then a re-publish of one of them past the checkpoint's cut."""
    names, finalized = finalize_groups(kafka, tq_store, f"{tag}-{unique}", versions=range(1), per_version=2)
    group = f"{tag}-trainer-{unique}"
    first = _consumer(kafka, tq_store, names, group, [])
    try:
        batch = first.select(10, min_groups=2, max_groups=2, timeout_s=60)
        assert batch is not None
        first.ack(batch)
        state, _ = save_into_checkpoint(tmp_path, first, tq_store)
        first.checkpoint_durable(state)
    finally:
        first.close()
    original = finalized["v0-g0"]
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.finalized, original.group_id.encode(), original.to_bytes())])  # a re-publish
    producer.close()
    return names, group, original


def _train_to_the_end(kafka, tq_store, names, group, tmp_path) -> ExperienceConsumer:
    """A trainer restored the way README says (`load_state` of the checkpoint), run until it committed all."""
    yielded: list[str] = []
    second = _consumer(kafka, tq_store, names, group, yielded)
    try:
        second.load_state_dict(load_state(tmp_path))
        deadline = time.monotonic() + 60
        while not committed_at_end(kafka, group, names.finalized):
            assert time.monotonic() < deadline, f"counts {second.counts}"
            if (b := second.select(10, min_groups=1, max_groups=8, timeout_s=0.5)) is not None:
                second.ack(b)
            state = second.state_dict()
            second.checkpoint_durable(state)
    finally:
        second.close()
    assert yielded == []
    return second


def test_a_duplicate_past_the_checkpoint_of_a_group_trained_before_it_is_not_handed_back_to_train_again(
    kafka, tq_store, unique, tmp_path
):
    """The restored trainer starts at the checkpoint's marks and never reads the original again: unless the
    checkpoint gives it the groups resolved before (no code of the user's), it takes the duplicate for a
    group whose rows were lost and hands it back to be trained twice."""
    names, group, original = _duplicate_past_the_cut(kafka, tq_store, unique, tmp_path, "jdup")
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True)
    report = resume(kafka, tq_store, config, tmp_path, reassembler_consumer_group=f"re-{names.prefix}")
    assert report.duplicates == 1 and report.hand_back_finalized == 0 and not report.read_whole
    second = _train_to_the_end(kafka, tq_store, names, group, tmp_path)
    assert second.counts.duplicates == 1 and second.counts.handed_back == 0
    assert not list(read_topic(kafka, names.regenerate))


def test_resume_finds_the_duplicates_of_a_checkpoint_without_resolved_groups_and_writes_them_for_the_trainer(
    kafka, tq_store, unique, tmp_path
):
    # A checkpoint written before it kept its resolved groups: resume reads the finalized topic from its
    # start, finds the original before the cut, and writes the groups resolved before the cut where the
    # restored trainer loads them from: all of them, not only those with a duplicate resume saw, so a
    # duplicate published after resume ran (of v0-g1 here) is dropped too.
    names, group, original = _duplicate_past_the_cut(kafka, tq_store, unique, tmp_path, "jold")
    (tmp_path / RESOLVED_FILE).unlink()
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, checkpointed=True)
    report = resume(kafka, tq_store, config, tmp_path, reassembler_consumer_group=f"re-{names.prefix}")
    (gid, part, offset), *more = report.resolved_originals
    assert report.read_whole and gid == original.group_id and not more
    assert any(r.offset == offset and r.partition == part for r in read_topic(kafka, names.finalized))
    records = {(g := FinalizedGroup.from_bytes(r.value)).group_id: g for r in read_topic(kafka, names.finalized)}
    assert sorted(g for g, _, _ in load_state(tmp_path)["resolved"]) == sorted(records)  # both trained before
    later = next(g for gid, g in records.items() if gid != original.group_id)
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.finalized, later.group_id.encode(), later.to_bytes())])  # after resume ran
    producer.close()
    second = _train_to_the_end(kafka, tq_store, names, group, tmp_path)
    assert second.counts.duplicates == 2 and second.counts.handed_back == 0
    assert not list(read_topic(kafka, names.regenerate))


def test_resume_refuses_a_ray_without_the_jobs_tq_instead_of_restoring_into_one_it_would_close(kafka, tmp_path):
    cli = [sys.executable, "-m", "workers.cli.main", "resume", "--bootstrap-servers", kafka.bootstrap_servers]
    out = subprocess.run([*cli, "--ray-address", "local"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1 and "no TQ runs in the Ray at local" in out.stderr, out.stdout + out.stderr
