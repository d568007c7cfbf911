"""The reassembler worker against the real broker and real TQ: exactly-once finalization of prompt groups."""

import time

import msgpack
import torch

from schemas.deadletter import DECODE_ERROR, METADATA_VIOLATION, VALIDATION_ERROR
from schemas.payload import VIOLATION_TAG_KEYS
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN
from tests.integration.helpers import SMALL, dead_letters, drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.telemetry.sensors import ReassemblerStats


def _worker(kafka, tq_store, names, worker_id="w0", sensor=None, **kw):
    return ReassemblerWorker(
        kafka,
        tq_store,
        ReassemblerConfig(
            prefix=names.prefix, worker_id=worker_id, consumer_group=f"reassemblers.{names.prefix}", **kw
        ),
        sensor=sensor,
    )


def _staged_keys(groups):
    return [c.staging_key for g in groups.values() for r in g for c in r.receipt.manifest]


def test_200_groups_of_8_finalize_exactly_once_with_tensors_equal_to_staged(kafka, tq_store, unique):
    names = setup_topics(kafka, f"re-{unique}")
    groups = publish_groups(kafka, tq_store, names, 200)
    worker = _worker(kafka, tq_store, names)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 200, timeout_s=180)
    finally:
        worker.close()
    records = finalized_records(kafka, names)
    assert sorted(r.group_id for r in records) == sorted(groups)
    for rec in records:
        assert len(rec.sample_ids) == 8 and rec.valid_row_count == 8
        assert rec.sample_ids == tuple(f"{rec.group_id}_g{i}" for i in range(8))
        for i, tag in enumerate(rec.tags):
            assert tag["group_id"] == rec.group_id and tag["rollout_index"] == i
            assert tag["prompt_idx"] == rec.prompt_idx and tag["weight_version"] == 1
            assert all(k in tag for k in VIOLATION_TAG_KEYS)

    # The packed rows in TQ train are the staged call deltas, concatenated in call order.
    some = sorted(groups)[:20]
    sample_ids = [f"{gid}_g{i}" for gid in some for i in range(8)]
    got = tq_store.get(TRAIN, sample_ids, select=["input_ids", "token_mask", "generation_logprobs"])
    rows = zip(got["input_ids"].unbind(), got["token_mask"].unbind(), got["generation_logprobs"].unbind())
    expected = [r for gid in some for r in groups[gid]]
    for (ids, mask, lps), rollout in zip(rows, expected):
        assert torch.equal(ids, torch.cat([s["token_ids"] for s in rollout.segments]))
        assert torch.equal(mask, torch.cat([s["token_mask"] for s in rollout.segments]))
        assert torch.equal(lps, torch.cat([s["generation_logprobs"] for s in rollout.segments]))
    assert tq_store.present(STAGING, _staged_keys(groups)) == set()
    tq_store.clear(TRAIN, [f"{gid}_g{i}" for gid in groups for i in range(8)])


def test_poison_receipts_are_dead_lettered_and_neighbours_finalize(kafka, tq_store, unique):
    names = setup_topics(kafka, f"poison-{unique}", partitions=1)
    groups = publish_groups(kafka, tq_store, names, 3, prefix="a")
    good = next(iter(groups.values()))[0].receipt
    body = msgpack.unpackb(good.to_bytes())
    future = dict(body, schema_version=[9, 0])
    smuggled = dict(body, token_ids=list(range(64)))
    AckedProducer(kafka).send(
        [
            Outgoing(names.receipts, b"x", b"\x93\xff\x00garbage"),
            Outgoing(names.receipts, b"y", msgpack.packb(future)),
            Outgoing(names.receipts, b"z", msgpack.packb(smuggled)),
        ]
    )
    groups.update(publish_groups(kafka, tq_store, names, 3, prefix="b"))
    worker = _worker(kafka, tq_store, names)
    try:
        drive(
            [worker],
            lambda: len(finalized_records(kafka, names)) >= 6 and len(dead_letters(kafka, names)) >= 3,
            timeout_s=120,
        )
    finally:
        worker.close()
    letters = {d.source_key: d for d in dead_letters(kafka, names)}
    assert letters[b"x"].error_kind == DECODE_ERROR
    assert letters[b"y"].error_kind == VALIDATION_ERROR and "schema_version" in letters[b"y"].message
    assert letters[b"z"].error_kind == METADATA_VIOLATION and "token_ids" in letters[b"z"].message
    assert letters[b"x"].original == b"\x93\xff\x00garbage"
    assert sorted(r.group_id for r in finalized_records(kafka, names)) == sorted(groups)


def test_a_near_megabyte_poison_receipt_is_dead_lettered_once_and_the_partition_flows(kafka, tq_store, unique):
    # Its dead letter once copied the whole record, outgrew the producer's message limit, aborted
    # the step, and the worker read the same record again: forever.
    from workers.telemetry.sensors import ReassemblerStats

    names = setup_topics(kafka, f"huge-{unique}", partitions=1)
    AckedProducer(kafka).send([Outgoing(names.receipts, b"huge", b"\xc1" * 999_800)])
    groups = publish_groups(kafka, tq_store, names, 3, prefix="n")
    stats = ReassemblerStats()
    worker = _worker(kafka, tq_store, names, sensor=stats)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 3, timeout_s=120)
    finally:
        worker.close()
    (letter,) = dead_letters(kafka, names)
    assert letter.error_kind == DECODE_ERROR and letter.original_truncated and letter.original_size == 999_800
    assert sorted(r.group_id for r in finalized_records(kafka, names)) == sorted(groups)
    assert stats.aborts == 0


def test_missing_segment_gives_placeholder_and_incomplete_group_finalizes_at_deadline(kafka, tq_store, unique):
    names = setup_topics(kafka, f"deadline-{unique}", partitions=1)
    from workers.rollout.publisher import RolloutPublisher
    from workers.rollout.synthetic import make_group

    broken = make_group("broken", 0, 3, shape=SMALL)
    partial = make_group("partial", 1, 3, shape=SMALL)
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(broken + partial[:5])
    pub.close()
    tq_store.clear(STAGING, [broken[2].receipt.manifest[0].staging_key])
    worker = _worker(kafka, tq_store, names, group_timeout_s=3.0)
    start = time.monotonic()
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 2, timeout_s=60)
    finally:
        worker.close()
    recs = {r.group_id: r for r in finalized_records(kafka, names)}
    assert recs["broken"].rejection_reasons[2] == "missing_staging_row"
    assert recs["broken"].valid_row_count == 7 and recs["broken"].total_row_count == 8
    assert recs["partial"].rejection_reasons[5:] == ("missing_receipt",) * 3
    assert recs["partial"].valid_row_count == 5 and recs["partial"].metrics["timed_out"] == 1.0
    assert time.monotonic() - start >= 3.0
    masks = tq_store.get(TRAIN, list(recs["partial"].sample_ids), select=["sample_mask"])["sample_mask"]
    assert masks.tolist() == [1.0] * 5 + [0.0] * 3


def test_open_groups_are_capped_by_pausing_and_resume_as_groups_close(kafka, tq_store, unique):
    names = setup_topics(kafka, f"cap-{unique}", partitions=1)
    from workers.rollout.publisher import RolloutPublisher
    from workers.rollout.synthetic import make_group

    # Ten groups with 5 of 8 receipts each: none completes, so only deadlines close them.
    partial = [r for i in range(10) for r in make_group(f"cap{i}", i, 1, shape=SMALL)[:5]]
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(partial)
    pub.close()
    stats = ReassemblerStats()
    worker = _worker(kafka, tq_store, names, sensor=stats, max_open_groups=3, max_poll_records=5, group_timeout_s=2.0)
    peak, paused_seen = 0, False
    try:
        deadline = time.monotonic() + 90
        while len(finalized_records(kafka, names)) < 10:
            assert time.monotonic() < deadline, "groups did not all finalize"
            for _ in range(20):
                worker.step()
                peak = max(peak, stats.open_groups)
                paused_seen |= stats.paused
    finally:
        worker.close()
    assert paused_seen
    assert peak <= 3 + 1, f"open groups peaked at {peak} with a cap of 3"
    assert sorted(r.group_id for r in finalized_records(kafka, names)) == [f"cap{i}" for i in range(10)]


def test_a_worker_behind_a_backlog_older_than_the_deadline_does_not_cut_complete_groups_short(kafka, tq_store, unique):
    names = setup_topics(kafka, f"backlog-{unique}", partitions=1)
    groups = publish_groups(kafka, tq_store, names, 12)
    time.sleep(3.0)  # the whole backlog is now older than the group deadline
    # Small polls make most groups straddle two steps, so a wall-clock deadline would fire mid-group.
    worker = _worker(kafka, tq_store, names, group_timeout_s=2.0, max_poll_records=7)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 12, timeout_s=90)
    finally:
        worker.close()
    records = finalized_records(kafka, names)
    assert sorted(r.group_id for r in records) == sorted(groups)
    assert all(r.valid_row_count == 8 and r.metrics["timed_out"] == 0.0 for r in records)
    assert dead_letters(kafka, names) == []


def test_router_replay_carries_routed_experts_to_the_train_rows(kafka, tq_store, unique):
    import msgspec

    from schemas.payload import unpack_payload
    from workers.reassembler.config import default_actor_config
    from workers.rollout.synthetic import SyntheticShape

    names = setup_topics(kafka, f"experts-{unique}", partitions=1)
    shape = SyntheticShape(
        group_size=4, calls=(2, 3), prompt_len=(4, 8), answer_len=(3, 9), observation_len=(1, 4), routed_experts_k=4
    )
    groups = publish_groups(kafka, tq_store, names, 2, shape=shape)
    actor = msgspec.structs.replace(default_actor_config(), router_replay_enabled=True)
    worker = _worker(kafka, tq_store, names, actor=actor)
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 2, timeout_s=60)
    finally:
        worker.close()
    rec = next(r for r in finalized_records(kafka, names) if r.group_id == sorted(groups)[0])
    assert rec.valid_row_count == 4
    fields = tq_store.get(TRAIN, list(rec.sample_ids))
    tensors = unpack_payload(fields, list(rec.tags), pad_value_dict={"input_ids": 0})
    for i, rollout in enumerate(groups[rec.group_id]):
        staged = torch.cat([s["routed_experts"] for s in rollout.segments])
        assert rec.tags[i]["routed_experts__row_shapes"] == [staged.shape[0], 4]
        assert torch.equal(tensors["routed_experts"][i, : staged.shape[0]].to(staged.dtype), staged)


def test_a_group_whose_staged_rows_are_all_gone_is_handed_back_once_in_its_commit(kafka, tq_store, unique):
    # A whole-job restart: Kafka kept the receipts, TQ came back without their staged rows.
    from schemas.regenerate import Regenerate
    from streams.consumer import read_topic
    from workers.rollout.publisher import RolloutPublisher
    from workers.rollout.synthetic import make_group

    names = setup_topics(kafka, f"handback-{unique}", partitions=1)
    lost, kept = make_group("lost", 0, 3, shape=SMALL), make_group("kept", 1, 3, shape=SMALL)
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    pub.publish(lost + kept)
    pub.close()
    tq_store.clear(STAGING, [c.staging_key for r in lost for c in r.receipt.manifest])
    stats = ReassemblerStats()
    worker = _worker(kafka, tq_store, names, sensor=stats)
    try:
        drive([worker], lambda: stats.handed_back >= 1 and len(finalized_records(kafka, names)) >= 1, timeout_s=60)
    finally:
        worker.close()
    (regen,) = [Regenerate.from_bytes(r.value) for r in read_topic(kafka, names.regenerate)]
    assert (regen.group_id, regen.new_group_id, regen.prompt_idx, regen.group_size) == ("lost", "lost~r1", 0, 8)
    assert [r.group_id for r in finalized_records(kafka, names)] == ["kept"] and dead_letters(kafka, names) == []
