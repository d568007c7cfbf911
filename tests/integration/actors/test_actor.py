"""The seed's Ray face on the session's real Ray and TQ: pool creation, RPC finalization, checkpoints."""

import time

import pytest
import ray
import torch

from schemas.errors import MetadataViolation
from schemas.request import ReassemblyRequest
from streams.tq import TRAIN
from tests.integration.helpers import SMALL
from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors
from workers.reassembler.config import default_actor_config
from workers.rollout.publisher import stage_rollouts
from workers.rollout.synthetic import make_group


def _gone(name: str) -> bool:
    try:
        ray.get_actor(name)
        return False
    except ValueError:
        return True


def test_num_workers_must_be_positive(tq_session):
    with pytest.raises(ValueError, match="num_workers must be > 0"):
        create_rollout_reassembler_actors(DataPlaneConfig(), default_actor_config(), num_workers=0)


def test_one_failed_dependency_check_kills_every_started_actor(tq_session, unique):
    bad = DataPlaneConfig(required_modules=("no_such_module_for_rlstream",))
    with pytest.raises(Exception, match="no_such_module_for_rlstream"):
        create_rollout_reassembler_actors(
            [DataPlaneConfig(), bad, DataPlaneConfig()],
            default_actor_config(),
            num_workers=3,
            name_prefix=f"pool-{unique}",
        )
    deadline = time.monotonic() + 30
    while not all(_gone(f"pool-{unique}-{i}") for i in range(3)):
        assert time.monotonic() < deadline, "actors still alive after a failed dependency check"
        time.sleep(0.5)


def test_actor_finalizes_a_metadata_only_request_and_rejects_tensors(tq_session, tq_store, unique, tmp_path):
    (actor,) = create_rollout_reassembler_actors(DataPlaneConfig(), default_actor_config(), num_workers=1)
    try:
        group = make_group(f"rpc-{unique}", 4, 2, shape=SMALL)
        stage_rollouts(tq_store, group)
        request = ReassemblyRequest(
            group_id=f"rpc-{unique}",
            rollout_ids=tuple(r.receipt.rollout_id for r in group),
            canonical_sample_ids=tuple(f"rpc-{unique}_g{i}" for i in range(8)),
            receipts=tuple(r.receipt.to_dict() for r in group),
            rewards=tuple(r.receipt.reward for r in group),
            fallback_weight_version=0,
            prompt_idx=4,
            mask_sample=(True,) * 8,
        )
        result = ray.get(actor.finalize.remote(request))
        assert result.sample_ids == request.canonical_sample_ids
        assert result.valid_row_count == 8 and result.group_min_wv == 2
        rows = tq_store.get(TRAIN, list(result.sample_ids), select=["input_ids"])["input_ids"].unbind()
        assert torch.equal(rows[3], torch.cat([s["token_ids"] for s in group[3].segments]))

        smuggled = dict(group[0].receipt.to_dict(), extra={"logprobs": [0.1]})
        bad = ReassemblyRequest(
            group_id="x",
            rollout_ids=("r",),
            canonical_sample_ids=("x_g0",),
            receipts=(smuggled,),
            rewards=(0.0,),
            fallback_weight_version=0,
            prompt_idx=0,
            mask_sample=(True,),
        )
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(actor.finalize.remote(bad))
        assert isinstance(err.value.cause, MetadataViolation)
        assert "rpc.receipts[0]" in str(err.value.cause)

        meta = ray.get(actor.mooncake_checkpoint.remote({"op": "save", "path": str(tmp_path / "ckpt")}))
        assert meta == {"op": "save", "path": str(tmp_path / "ckpt"), "ok": True}
        assert (tmp_path / "ckpt" / "metadata.json").exists()
        tq_store.clear(TRAIN, list(result.sample_ids))
    finally:
        ray.kill(actor)
