"""verl's whole-TQ checkpoint and close, through verl's own code, leave rlstream's partitions as they are.

verl 0.9.1 snapshots and restores all of TQ in its async modes (``_save_checkpoint`` ->
``tq.save_checkpoint``, ``_load_checkpoint`` -> ``tq.load_checkpoint``) and closes TQ at the end of
every ``TaskRunnerV1.run``, killing the controller. rlstream's replay buffer guards all three when
verl builds it (verl_tq_guard.py).
"""

from __future__ import annotations

import os
import uuid

import pytest
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict

from streams.tq import STAGING, TRAIN
from tests.verl.cpu_verl import cpu_trainer
from workers.adapters import verl_tq_guard
from workers.adapters.verl_checkpoint import step_dir


def _stage(store, partition: str, n: int) -> list[str]:
    """`n` rows of rlstream's in `partition` under fresh keys."""
    keys = [f"guard-{uuid.uuid4().hex[:8]}/c0" for _ in range(n)]
    fields = TensorDict(
        {"token_ids": torch.nested.nested_tensor([torch.arange(3)] * n, layout=torch.jagged)}, batch_size=[n]
    )
    store.put(partition, keys, fields, [{"group_id": "guard"}] * n)
    return keys


def test_verls_tq_checkpoint_neither_snapshots_nor_rewinds_rlstreams_partitions(verl_run, tq_store):
    config = verl_run.config(mode="colocate_async")
    trainer = cpu_trainer(config, verl_run.services)
    before: list[str] = []
    after: list[str] = []
    try:
        before = _stage(tq_store, STAGING, 2) + _stage(tq_store, TRAIN, 1)
        trainer.global_steps = 1
        trainer._save_checkpoint()  # verl's own: actor (stub), data.pt, tq.save_checkpoint, tracker, on_save

        after = _stage(tq_store, STAGING, 2)  # rlstream moves on: rows staged and cleared after the save
        tq_store.clear(STAGING, before[:1])
        trainer._load_checkpoint()  # verl's own resume: global step from the tracker, tq.load_checkpoint
        assert trainer.global_steps == 1
        assert tq_store.present(STAGING, after) == set(after), "rows staged after verl's save are kept"
        assert not tq_store.present(STAGING, before[:1]), "rows cleared after verl's save stay cleared"
        assert tq_store.present(TRAIN, before[2:]) == set(before[2:])
        saved = os.path.join(step_dir(verl_run.checkpoints, 1), "transfer_queue")
        assert os.listdir(saved) == [verl_tq_guard.SKIPPED_MARKER], "no copy of rlstream's staging in verl's checkpoint"
    finally:
        trainer.replay_buffer.close()
        tq_store.clear(STAGING, before[1:2] + after)
        tq_store.clear(TRAIN, before[2:])


def test_verls_task_runner_closes_its_tq_client_not_the_tq_rlstream_uses(verl_run, tq_store):
    """TaskRunnerV1.run's `finally: tq.close()` runs even when the trainer fails, as it does here on CPU."""
    from verl.trainer.main_ppo import TaskRunnerV1

    kept = _stage(tq_store, STAGING, 2)
    runner = TaskRunnerV1.__ray_actor_class__()
    try:
        with pytest.raises(ValueError, match="GPUs"):  # trainer.init(): verl's resource pools want GPUs
            runner.run(verl_run.config())
        assert ray.get_actor("TransferQueueController", namespace="transfer_queue") is not None
        tq.init()  # this process's client was closed, as verl's own process would be done with it
        assert tq_store.present(STAGING, kept) == set(kept), "rlstream's rows outlive verl's close"
    finally:
        tq.init()
        if runner.trainer is not None:
            runner.trainer.replay_buffer.close()
        tq_store.clear(STAGING, kept)


def test_the_guard_is_in_place_once_verl_builds_its_checkpoint_callback(verl_run):
    """verl builds the callback first in PPOTrainer.__init__: a run failing before its replay buffer is
    built still reaches TaskRunnerV1's final tq.close(), which must not take rlstream's TQ along."""
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

    verl_tq_guard.uninstall()
    build_checkpoint_callback(verl_run.config())
    assert verl_tq_guard.installed()

    verl_tq_guard.uninstall()
    build_checkpoint_callback(verl_run.config("++trainer.v1.sampler.sampler_kwargs.rlstream.guard_tq=false"))
    assert not verl_tq_guard.installed(), "guard_tq=false leaves TQ's own functions"
