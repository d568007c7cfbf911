"""verl's own training loop on CPU with rlstream as its rollout path and its replay buffer.

verl dispatches prompts (``prepare_step``), rlstream's agent-loop manager runs verl's agent loop on
them and publishes each group through rlstream, a real reassembler finalizes them, and verl's
``fit`` validates, samples, pads, computes advantages, trains (stub actor), checkpoints and computes
its metrics. cpu_verl.py says which of verl's steps run for real and which are stubbed (GPU only).
"""

from __future__ import annotations

import collections
import os

import ray
import transfer_queue as tq

from schemas.trainer_version import TrainerVersion
from streams.consumer import read_topic
from tests.verl.cpu_verl import agent_loop_manager, cpu_trainer, record, stop_agent_loop_manager
from workers.adapters import verl_tq_guard
from workers.adapters.verl_checkpoint import STATE_FILE, RlstreamCheckpointCallback, read_tracker, step_dir
from workers.adapters.verl_sampler import RlstreamReplayBuffer


def _partition(name: str) -> dict:
    return tq.kv_list(name).get(name, {})


def test_verls_loop_trains_every_group_its_own_rollouts_published_through_rlstream(verl_run, kafka):
    # Mini-batches of 3 prompts (6 rows) make verl pad each 4-row batch with 2 rows of its own.
    config = verl_run.config("actor_rollout_ref.actor.ppo_mini_batch_size=3", steps=3)
    trainer = cpu_trainer(config, verl_run.services)
    # The 2 validation requests go through, then one training session fails (its rollout is rejected).
    ray.get(verl_run.services.server.fail_call.remote(4))
    # verl's _build_replay_buffer and build_checkpoint_callback, from verl's config, built rlstream's.
    assert isinstance(trainer.replay_buffer, RlstreamReplayBuffer)
    assert isinstance(trainer.checkpoint_callback, RlstreamCheckpointCallback)
    assert verl_tq_guard.installed() and trainer.replay_buffer.settings.group_size == 2
    validations = record(trainer, "_validate")
    metrics = record(trainer, "_compute_metrics")
    manager = agent_loop_manager(config, trainer)
    try:
        trainer.fit(manager)  # validation before training, then 3 steps, a checkpoint each
    finally:
        stop_agent_loop_manager(manager)
        trainer.replay_buffer.close()

    actor = trainer.actor_rollout_wg
    trained = actor.trained
    assert sorted(trained) == [1, 2, 3]
    rows_per_group = collections.Counter(g for groups in trained.values() for g in groups)
    # 2 prompts a step, each a group of rollout.n = 2 rows, the failed session's as a masked row;
    # every group trained once, in one step, and verl padded each batch to its mini-batch multiple.
    assert len(rows_per_group) == 6 and set(rows_per_group.values()) == {2}
    assert all(len(groups) == 4 for groups in trained.values())
    assert sum(len(r) for r in actor.rejected.values()) == 1 and actor.padding_rows == 3 * 2
    # The groups are verl's own prompts (their uids), published and finalized by rlstream.
    published = {r.key.decode() for r in read_topic(kafka, verl_run.names.receipts)}
    assert set(rows_per_group) == published
    # verl's partitions hold nothing: prompt keys cleared on publish, rows cleared after training.
    assert not _partition("train") and not _partition("val")

    # verl's validation ran its own path (val partition, verl's buffer) and scored the val prompts.
    ((_, _, val),) = validations
    assert any(k.startswith("val-core/rlstream_tiny_sums/") for k in val)
    # verl's _compute_metrics read every field it reads of rlstream's rows, num_turns included.
    for args, _, _ in metrics:
        logged = args[1]  # the step's metrics dict, filled in place
        assert logged["training/num_turns/mean"] == 2.0 and logged["rlstream/groups"] == 2.0
        # Staleness as verl measures it: on-policy (sync mode) is 0.
        assert logged["training/off_policy/trajectory_staleness/max"] == 0
    assert [kwargs["global_steps"] for _, kwargs, _ in metrics] == [1, 2, 3]

    # The consumer's state beside each of verl's checkpoints; verl's tracker at the last.
    checkpoints = verl_run.checkpoints
    assert read_tracker(checkpoints) == 3
    assert all(os.path.exists(os.path.join(step_dir(checkpoints, s), STATE_FILE)) for s in (1, 2, 3))
    # The trainer's version (weights S - 1 at step S) went to the admission gates once a step.
    versions = [TrainerVersion.from_bytes(r.value).version for r in read_topic(kafka, verl_run.names.trainer_version)]
    assert versions == [0, 1, 2]
