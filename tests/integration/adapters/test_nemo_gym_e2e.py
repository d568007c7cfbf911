"""NeMo Gym's own capture into rlstream, on the real broker and real TQ, to the trainer.

NeMo Gym's `RolloutTokenCapture` (driven with synthetic engine output through a small
`CaptureAdapter`, no vLLM) stages multi-turn calls, a VLM call with its pixels among them, into
rlstream's `TQStagingSink`; NeMo Gym's ledger and receipt builders make the receipts; rlstream
publishes them beside its own receipts, a reassembler worker finalizes both kinds, and the trainer
reads rows equal to what NeMo Gym's `verify_and_linearize` gives, the pixels bit for bit.
"""

import pytest
import torch

from schemas.multimodal import PackedRows
from streams.tq import STAGING
from tests.integration.helpers import SMALL, drive, finalized_records, publish_groups, setup_topics
from tests.unit.workers.adapters.gym_sinks import RecordingSink
from workers.adapters.nemo_gym_capture import EngineTurn, SyntheticEngineAdapter, capture_rollout, gym_receipt
from workers.adapters.nemo_gym_staging import TQStagingSink, TQStagingSource
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.publisher import RolloutPublisher
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first

staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")
conformance = pytest.importorskip("nemo_gym.token_id_capture.staging.conformance")

GROUP_SIZE = 4


def _pixels(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8, 12, generator=g).to(torch.bfloat16)


def _turns(i):
    """Rollout i: prompt + answer, a tool observation + answer, and (rollout 1) a VLM call with its pixels."""
    turns = [
        EngineTurn([11, 12, 13 + i], [21 + i, 22], [-0.25, -1.5], weight_version=5),
        EngineTurn([31], [41, 42 + i, 43], [-0.5, -0.125, -3.0], weight_version=6),
    ]
    if i == 1:
        turns.append(
            EngineTurn(
                [51, 52],
                [61],
                [-0.75],
                weight_version=6,
                attachments={"pixel_values": _pixels(1), "imgs_sizes": torch.tensor([[4, 24]], dtype=torch.int32)},
                extras={"media_spans": [[0, 2]]},
            )
        )
    if i == 3:
        turns[1] = EngineTurn([31], [41], [-0.5], weight_version=6, fail=True)
    return turns


def _verified(receipt, snapshots):
    try:
        return staging.verify_and_linearize(receipt, snapshots)
    except staging.ReceiptVerificationError as exc:
        return exc.code


def test_nemo_gym_receipts_flow_beside_rlstream_receipts_to_the_trainer(kafka, tq_store, unique):
    names = setup_topics(kafka, f"ng-{unique}", partitions=2)
    group_id = f"ng-{unique}-g0"
    assert isinstance(TQStagingSink(tq_store), staging.StagingSink)
    sink = RecordingSink(TQStagingSink(tq_store))
    capture = staging.RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0, adapter=SyntheticEngineAdapter())
    source = TQStagingSource(tq_store)
    receipts, expected = [], {}
    for i in range(GROUP_SIZE):
        done = capture_rollout(capture, f"{group_id}_g{i}", _turns(i))
        theirs = done.receipt
        if i == 2:
            # A forged manifest: the terminal call's digest is not its staged row's.
            rows = theirs.model_dump(mode="json")
            rows["manifest"][-1]["digest"] = "0" * 64
            theirs = staging.RolloutReceipt.model_validate(rows)
        keys = [r.staging_key for r in theirs.manifest]
        # What NeMo Gym's own verifier makes of each receipt, from the records as NeMo Gym's capture
        # built them (before rlstream's sink), and the same from the rows as rlstream's source gives them.
        expected[i] = _verified(theirs, sink.as_built(keys))
        assert _verified(theirs, source.fetch(keys)) == expected[i]
        receipts.append(
            gym_receipt(
                theirs,
                group_id=group_id,
                prompt_idx=3,
                rollout_index=i,
                group_size=GROUP_SIZE,
                reward=float(i),
                environment="vision",
            )
        )
    assert expected[2] == "wrong_digest" and expected[3] == "rollout_failed"
    pub = RolloutPublisher(kafka, tq_store, names.receipts)
    try:
        pub.publish_receipts(receipts)
    finally:
        pub.close()
    own = publish_groups(kafka, tq_store, names, 1, shape=SMALL, prefix=f"ng-{unique}-own")
    own_id = next(iter(own))

    worker = ReassemblerWorker(
        kafka,
        tq_store,
        ReassemblerConfig(prefix=names.prefix, worker_id="w0", consumer_group=f"reassemblers.{names.prefix}"),
    )
    try:
        drive([worker], lambda: len(finalized_records(kafka, names)) >= 2, timeout_s=120)
    finally:
        worker.close()
    records = {r.group_id: r for r in finalized_records(kafka, names)}
    assert set(records) == {group_id, own_id}
    record = records[group_id]
    assert record.rejection_reasons == (None, None, "wrong_digest", "rollout_failed")
    assert record.sample_ids == tuple(f"{group_id}_g{i}" for i in range(GROUP_SIZE))

    consumer = ExperienceConsumer(
        kafka, tq_store, ConsumerConfig(prefix=names.prefix, consumer_group=f"trainer.{names.prefix}"), ready_first()
    )
    try:
        metas = []
        while len({g.group_id for m in metas for g in m.groups}) < 2:
            meta = consumer.select(100, min_groups=1, max_groups=2, timeout_s=60)
            assert meta is not None, "the trainer got no batch"
            metas.append(meta)
        meta = next(m for m in metas if any(g.group_id == group_id for g in m.groups))
        gym_rows = [i for i, s in enumerate(meta.sample_ids) if s.startswith(f"{group_id}_g")]
        batch = consumer.materialize(meta)
        for slot, i in enumerate(gym_rows[:2]):
            want = expected[slot]
            n = len(want.token_ids)
            assert int(batch["input_lengths"][i]) == n
            assert batch["input_ids"][i, :n].tolist() == want.token_ids
            assert batch["token_mask"][i, :n].tolist() == [m == 1.0 for m in want.token_mask]
            assert torch.equal(batch["generation_logprobs"][i, :n], torch.tensor(want.logprobs, dtype=torch.float32))
            assert float(batch["sample_mask"][i]) == 1.0
        for i in gym_rows[2:]:
            assert float(batch["sample_mask"][i]) == 0.0
        tags = [meta.tags[i] for i in range(len(meta.sample_ids))]
        assert all(tags[i]["rollout_environment"] == "vision" for i in gym_rows)
        pixels = PackedRows.from_wire(batch["pixel_values"], tags, "pixel_values")
        (segment,) = pixels.rows[gym_rows[1]]
        staged = sink.attachments[receipts[1].manifest[-1].staging_key]
        assert segment.dtype == torch.bfloat16 and torch.equal(segment.view(torch.int16), _pixels(1).view(torch.int16))
        assert torch.equal(segment.view(torch.int16), staged["pixel_values"].view(torch.int16))
        assert all(not pixels.rows[i] for i in (gym_rows[0], *gym_rows[2:]))
        sizes = PackedRows.from_wire(batch["imgs_sizes"], tags, "imgs_sizes")
        assert sizes.rows[gym_rows[1]][0].tolist() == [[4, 24]]
        for m in metas:
            consumer.ack(m)
    finally:
        consumer.close()
    # The group's staged calls were cleared once it committed, the failed capture's first call too.
    assert not tq_store.present(STAGING, [c.staging_key for r in receipts for c in r.manifest])


def test_the_golden_vector_goes_through_the_sink_and_source_on_real_tq(tq_store, unique):
    vectors = conformance.load_golden_vectors()
    fields = {**vectors["staged_call"], "rollout_id": f"gold-{unique}_g0"}
    from schemas.gym_digest import compute_staging_digest

    record = staging.StagedCallRecord.model_validate(
        {**fields, "digest": compute_staging_digest(**fields), "extras": vectors["extras"]}
    )
    result = TQStagingSink(tq_store).stage(record)
    assert result.ok
    try:
        (snapshot,) = TQStagingSource(tq_store).fetch([result.staging_key])
        assert (
            snapshot.model_dump()
            == staging.StagedCallBaseSnapshot.model_validate(record.model_dump(exclude={"extras"})).model_dump()
        )
        (full,) = TQStagingSource(tq_store).fetch_records([result.staging_key])
        assert staging.compute_extras_digest(full.extras) == vectors["extras_digest"]
        # The published vector itself, re-digested from the row as TQ gave it back.
        assert (
            compute_staging_digest(**{**snapshot.model_dump(exclude={"digest"}), "rollout_id": "rollout-1"})
            == vectors["staged_call_digest"]
        )
    finally:
        tq_store.clear(STAGING, [result.staging_key])


def test_stage_from_many_capture_threads_at_once_on_real_tq(tq_store, unique):
    """NeMo Gym's capture calls `stage` from its completion threads without serializing them."""
    import threading

    from schemas import gym_digest as gd

    def record(i):
        ids = [i, i + 1, 7]
        fields = dict(
            schema_version=2, digest_version=2, extras_digest_version=1, rollout_id=f"mt-{unique}_g{i}",
            model_call_id="c0", parent_call_id=None, mode="text", prev_len=0, delta_len=3, cum_len=3,
            weight_version=1, token_ids_delta=ids, token_mask_delta=[0.0, 0.0, 1.0],
            generation_log_probs_delta=[0.0, 0.0, -0.5], extras_digest=gd.EMPTY_EXTRAS_DIGEST,
            chain_hash=gd.compute_chain_hash(None, ids), cumulative_hash=gd.hash_token_ids(ids),
        )  # fmt: skip
        return staging.StagedCallRecord(digest=gd.compute_staging_digest(**fields), **fields)

    sink, results = TQStagingSink(tq_store), {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, sink.stage(record(i)))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    keys = [f"mt-{unique}_g{i}/c0" for i in range(8)]
    try:
        assert all(results[i].ok for i in range(8))
        assert [s.token_ids_delta[0] for s in TQStagingSource(tq_store).fetch(keys)] == list(range(8))
    finally:
        tq_store.clear(STAGING, keys)
