"""The seed's face on NeMo Gym receipts: `ReassemblyRequest.receipts` as NeMo Gym `RolloutReceipt`
dicts, finalized by an actor on the session's real Ray and TQ, rows equal to NeMo Gym's verifier's."""

import pytest
import ray
import torch

from schemas.errors import SchemaError
from schemas.request import ReassemblyRequest
from streams.tq import STAGING, TRAIN
from tests.unit.workers.adapters.gym_sinks import RecordingSink
from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors
from workers.adapters.nemo_gym_capture import EngineTurn, SyntheticEngineAdapter, capture_rollout
from workers.adapters.nemo_gym_staging import TQStagingSink, TQStagingSource
from workers.reassembler.config import default_actor_config

staging = pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")


def _captured(tq_store, group_id, n, *, fail=False, sink=None):
    capture = staging.RolloutTokenCapture(
        sink=sink or TQStagingSink(tq_store), weight_version_fn=lambda: 2, adapter=SyntheticEngineAdapter()
    )
    out = []
    for i in range(n):
        turns = [
            EngineTurn([1, 2, 3 + i], [4, 5], [-0.5, -0.25], weight_version=2),
            EngineTurn([6], [7 + i], [-1.0], weight_version=3, fail=fail),
        ]
        out.append(capture_rollout(capture, f"{group_id}_g{i}", turns).receipt)
    return out


def _request(group_id, receipts, *, rollout_ids=None):
    n = len(receipts)
    return ReassemblyRequest(
        group_id=group_id,
        rollout_ids=tuple(rollout_ids or (r.rollout_id for r in receipts)),
        canonical_sample_ids=tuple(f"{group_id}_g{i}" for i in range(n)),
        receipts=tuple(r.model_dump(mode="json") for r in receipts),
        rewards=tuple(float(i) for i in range(n)),
        fallback_weight_version=0,
        prompt_idx=7,
        mask_sample=(True,) * n,
    )


def test_actor_finalizes_nemo_gym_receipt_dicts(tq_session, tq_store, unique):
    (actor,) = create_rollout_reassembler_actors(
        DataPlaneConfig(nemo_gym=True, placeholder_groups=True), default_actor_config(), num_workers=1
    )
    try:
        group_id = f"rpc-gym-{unique}"
        sink = RecordingSink(TQStagingSink(tq_store))
        receipts = _captured(tq_store, group_id, 3, sink=sink)
        source = TQStagingSource(tq_store)
        # NeMo Gym's verifier on the records as its capture built them, and the same on rlstream's source.
        expected = [
            staging.verify_and_linearize(r, sink.as_built([c.staging_key for c in r.manifest])) for r in receipts
        ]
        for r, want in zip(receipts, expected):
            assert staging.verify_and_linearize(r, source.fetch([c.staging_key for c in r.manifest])) == want
        result = ray.get(actor.finalize.remote(_request(group_id, receipts)))
        assert result.valid_row_count == 3 and result.group_min_wv == 2 and result.group_max_wv == 3
        rows = tq_store.get(TRAIN, list(result.sample_ids), select=["input_ids", "generation_logprobs"])
        for got, lp, want in zip(rows["input_ids"].unbind(), rows["generation_logprobs"].unbind(), expected):
            assert got.tolist() == want.token_ids
            assert torch.equal(lp, torch.tensor(want.logprobs, dtype=torch.float32))
        assert [t["prompt_idx"] for t in result.tags] == [7, 7, 7]

        # A receipt whose rollout is not the one the request names is refused with its field path.
        bad = _request(f"{group_id}-x", receipts[:1], rollout_ids=["someone-else"])
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(actor.finalize.remote(bad))
        assert isinstance(err.value.cause, SchemaError) and "rpc.receipts[0].rollout_id" in str(err.value.cause)

        # One rollout twice (the same id in two slots, its receipt twice) would train it twice: refused, naming it.
        twice = _request(f"{group_id}-2", [receipts[0], receipts[0]])
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(actor.finalize.remote(twice))
        assert isinstance(err.value.cause, SchemaError) and "rpc.rollout_ids" in str(err.value.cause)
        assert repr(receipts[0].rollout_id) in str(err.value.cause)
        assert not tq_store.present(TRAIN, [f"{group_id}-2_g0", f"{group_id}-2_g1"])

        # Every capture failed: with placeholder_groups, NeMo RL's N masked placeholder rows.
        failed_id = f"rpc-gym-f-{unique}"
        failed = _captured(tq_store, failed_id, 2, fail=True)
        placeholders = ray.get(actor.finalize.remote(_request(failed_id, failed)))
        assert placeholders.valid_row_count == 0 and placeholders.rejection_reasons == ("rollout_failed",) * 2
        tq_store.clear(TRAIN, [*result.sample_ids, *placeholders.sample_ids])
        # The RPC face leaves staging to its caller (the Kafka worker clears it after its commit).
        tq_store.clear(STAGING, [c.staging_key for r in (*receipts, *failed) for c in r.manifest])
    finally:
        ray.kill(actor)
