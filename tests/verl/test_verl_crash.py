"""Exactly once across a verl crash: verl's own _save_checkpoint/_load_checkpoint, rlstream's state beside them.

A run trains, checkpoints every step and dies; a second run resumes from verl's tracker as verl does,
trains on, and what neither trained is read after it. Every group rlstream finalized is trained
exactly once along the restored model's line: the first run's steps up to its checkpoint, then the
second run's, then what is left.
"""

from __future__ import annotations

import collections
import os
import time

import pytest

from streams.consumer import read_topic
from tests.verl.cpu_verl import StubActorWorkerGroup, agent_loop_manager, cpu_trainer, stop_agent_loop_manager
from workers.adapters.errors import SampleTimeout
from workers.adapters.verl_checkpoint import JOURNAL, STATE_FILE, RlstreamCheckpointCallback, read_tracker, step_dir
from workers.adapters.verl_sampler import RlstreamReplayBuffer
from workers.adapters.verl_tq_guard import SKIPPED_MARKER


class CrashingCallback(RlstreamCheckpointCallback):
    """Dies in on_save at step `crash_at`: verl has written its tracker for that step, rlstream nothing yet."""

    crash_at: int | None = None

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        if global_step == type(self).crash_at:
            raise RuntimeError(f"crash between verl's tracker and on_save at step {global_step}")
        super().on_save(trainer, global_step, checkpoint_dir, async_save=async_save, **kwargs)


CRASHING_CALLBACK = f"trainer.checkpoint_callback_class={__name__}.CrashingCallback"


def _run(config, services, actor=None) -> tuple[dict, int]:
    """verl's fit until it ends or dies; what the actor trained per step and the step it ended at."""
    trainer = cpu_trainer(config, services, actor)
    manager = agent_loop_manager(config, trainer)
    try:
        trainer.fit(manager)
    except RuntimeError as exc:
        assert "crash" in str(exc)
    finally:
        # A dead trainer's agent-loop workers die with it; its Kafka membership would expire after
        # session_timeout_ms, closing it only saves that wait (closing commits nothing not durable).
        stop_agent_loop_manager(manager)
        trainer.replay_buffer.close()
    return trainer.actor_rollout_wg.trained, trainer.global_steps


def _all_finalized(kafka, names, deadline_s: float = 90.0) -> set[str]:
    """Every group published so far, once the reassembler has finalized them all."""
    deadline = time.monotonic() + deadline_s
    while True:
        published = {r.key.decode() for r in read_topic(kafka, names.receipts)}
        finalized = {r.key.decode() for r in read_topic(kafka, names.finalized)}
        if published <= finalized:
            return finalized
        assert time.monotonic() < deadline, f"{len(published - finalized)} published groups never finalized"
        time.sleep(0.5)


def _drain(verl_run, config) -> list[str]:
    """The groups a resumed trainer would still train: a restored sampler, sampled until nothing is left."""
    kwargs = dict(config.trainer.v1.sampler.sampler_kwargs)
    kwargs["rlstream"] = {**kwargs["rlstream"], "wait_timeout_s": 10.0, "publish_version": False}
    sampler = RlstreamReplayBuffer(trainer_mode="sync", max_off_policy_threshold=None, sampler_kwargs=kwargs)
    drained: list[str] = []
    try:
        step = sampler.resumed_step + 1
        while True:
            try:
                batch, _ = sampler.sample(step, "train", 1)
            except SampleTimeout:
                return drained
            drained += dict.fromkeys(t["rlstream_group_id"] for t in batch.tags)  # a group's rows, once
            sampler._store.clear("train", list(batch.keys))
    finally:
        sampler.close()


@pytest.mark.parametrize(
    "mode, crash",
    [
        # colocate_async: verl checkpoints TQ (tq.save_checkpoint/load_checkpoint, guarded), warms up and
        # re-issues prompts; the crash comes after on_save of step 2, in step 3 once it trained.
        ("colocate_async", "after_on_save"),
        # sync: the crash falls between verl's tracker (step 2) and on_save: the step journal covers it.
        ("sync", "before_on_save"),
    ],
)
def test_a_verl_crash_and_restart_trains_every_group_exactly_once(verl_run, kafka, mode, crash):
    extra = [CRASHING_CALLBACK] if crash == "before_on_save" else []
    CrashingCallback.crash_at = 2 if crash == "before_on_save" else None
    first_actor = StubActorWorkerGroup(crash_after_update=3 if crash == "after_on_save" else None)
    first, died_at = _run(verl_run.config(*extra, mode=mode, steps=5), verl_run.services, first_actor)
    checkpoints = verl_run.checkpoints
    assert read_tracker(checkpoints) == 2, "verl's last complete checkpoint is step 2"
    has_state = os.path.exists(os.path.join(step_dir(checkpoints, 2), STATE_FILE))
    assert has_state == (crash == "after_on_save")

    CrashingCallback.crash_at = None
    config = verl_run.config(*extra, mode=mode, steps=5)
    second, ended_at = _run(config, verl_run.services)
    # verl counts one past its last step when it ends.
    assert ended_at == 6 and sorted(second) == [3, 4, 5], "verl resumed after its step 2 checkpoint"

    finalized = _all_finalized(kafka, verl_run.names)
    drained = _drain(verl_run, config)
    # The restored model's line: run 1 up to its checkpoint, run 2, then what is still to train.
    line = [g for s, gs in first.items() if s <= 2 for g in gs] + [g for gs in second.values() for g in gs]
    rows = collections.Counter(line)
    assert set(rows.values()) == {2}, "a group's rows are trained together, once"
    trained = list(rows) + drained
    assert len(trained) == len(set(trained)), "no group trained twice"
    assert set(trained) == finalized, "no finalized group lost"
    if crash == "after_on_save":
        # What run 1 trained after its checkpoint died with it, and was trained again.
        assert died_at == 3
        lost_with_the_crash = {g for s, gs in first.items() if s > 2 for g in gs}
        assert lost_with_the_crash and lost_with_the_crash <= set(trained)
    else:
        # Step 2 is in verl's checkpoint though rlstream never saved its state: not trained again.
        assert died_at == 2 and set(first[2]) <= set(rows) and not set(first[2]) & set(second[3] + drained)
    assert os.path.exists(os.path.join(checkpoints, JOURNAL))
    if mode != "sync":
        # verl asked TQ for whole-store snapshots; the guard wrote why it did not take them.
        assert os.path.exists(os.path.join(step_dir(checkpoints, 2), "transfer_queue", SKIPPED_MARKER))
