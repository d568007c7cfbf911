"""The verl sampler over real finalized groups: verl's interface, verl's field names, counts, waits and acks."""

from __future__ import annotations

import time

import pytest
import torch

from schemas.errors import InvalidArgument
from tests.integration.trainer.staging import finalize_groups
from workers.adapters.errors import SampleTimeout
from workers.adapters.verl_fields import verl_uid
from workers.adapters.verl_sampler import RlstreamReplayBuffer
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import windowed


def _check_row(verl: dict, rl: dict) -> None:
    """One verl row (as verl reads it back from TQ) against the rlstream row it came from."""
    length = int(rl["input_lengths"])
    p = int(rl["prompt_ids_for_adv"].shape[0])
    assert torch.equal(verl["input_ids"], rl["input_ids"][:length])
    assert torch.equal(verl["prompts"], rl["prompt_ids_for_adv"])
    assert torch.equal(verl["responses"], rl["input_ids"][p:length])
    assert verl["response_mask"].tolist() == rl["token_mask"][p:length].long().tolist()
    assert torch.equal(verl["rollout_log_probs"], rl["generation_logprobs"][p:length])
    assert verl["rm_scores"][-1].item() == pytest.approx(float(rl["total_reward"]))
    assert verl["rm_scores"][:-1].abs().sum().item() == 0.0


def test_the_verl_sampler_hands_real_groups_to_verls_partition_in_verls_names(kafka, tq_store, unique):
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta

    names, finalized = finalize_groups(kafka, tq_store, f"vs-{unique}", versions=range(2), per_version=2)
    rl_partition = next(iter(finalized.values())).partition_id
    verl_partition = f"verl.{unique}"  # verl's own "train" in a real run; unique here, the TQ is shared
    sample_ids = [s for g in finalized.values() for s in g.sample_ids]
    rl_rows = dict(zip(sample_ids, tq_store.get(rl_partition, sample_ids).unbind(0)))
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"vs-{unique}", train_partition=rl_partition)
    consumer = ExperienceConsumer(kafka, tq_store, config, windowed(1))
    # What verl's _build_replay_buffer passes (tests/verl builds it from a real verl config).
    kwargs = dict(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2)
    sampler = RlstreamReplayBuffer(
        **kwargs, sampler_kwargs={"rlstream": {"poll_interval_s": 0.2}}, consumer=consumer, store=tq_store
    )
    keys: list[str] = []
    try:
        uids, _ = sampler.wait_for_sampleable(1, verl_partition, 4, timeout_s=60.0)
        assert uids == {verl_uid(g) for g in finalized} and sampler.get_sampleable_count(1, verl_partition) == 4
        started = time.monotonic()
        with pytest.raises(SampleTimeout, match="4 of 5"):
            sampler.wait_for_sampleable(1, verl_partition, 5, timeout_s=1.0)
        assert 1.0 <= time.monotonic() - started < 10.0
        with pytest.raises(InvalidArgument, match="rlstream's train partition"):
            sampler.sample(1, rl_partition, 1)

        batch, metrics = sampler.sample(1, verl_partition, 3)
        keys += batch.keys
        chosen = sampler.last_batch
        assert isinstance(batch, KVBatchMeta) and batch.partition_id == verl_partition
        assert metrics["rlstream/groups"] == 3.0 and len(batch.keys) == sum(g.valid_row_count for g in chosen.groups)
        assert sampler.get_sampleable_count(1, verl_partition) == 1
        assert not tq_store.present(rl_partition, list(chosen.sample_ids)), "sampled groups are acked: rows cleared"

        # Read back as verl's trainer does: jagged fields by name, uid as a non-tensor column.
        fields = ["prompts", "responses", "input_ids", "response_mask", "rollout_log_probs", "rm_scores", "uid"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=verl_partition, select_fields=fields)
        assert data["prompts"].offsets().diff().tolist() == [t["prompt_len"] for t in batch.tags]
        assert data["responses"].to_padded_tensor(padding=0).shape[0] == len(batch.keys)
        assert list(data["uid"]) == [verl_uid(t["rlstream_group_id"]) for t in batch.tags]
        for i, tag in enumerate(batch.tags):
            _check_row({f: data[f][i] for f in fields if f != "uid"}, rl_rows[tag["rlstream_sample_id"]])

        last, _ = sampler.sample(1, verl_partition, 1)
        keys += last.keys
        assert {t["rlstream_group_id"] for t in batch.tags + last.tags} == set(finalized)
        assert sampler.get_sampleable_count(1, verl_partition) == 0
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()
