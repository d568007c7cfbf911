"""verl's own training loop on CPU with rlstream as its rollout path and its replay buffer.

verl dispatches prompts (``prepare_step``), rlstream's agent-loop manager runs verl's agent loop on
them and publishes each group through rlstream, a real reassembler finalizes them, and verl's
``fit`` samples, pads, computes advantages, trains (stub actor), checkpoints, validates and logs.
cpu_verl.py says which of verl's steps run for real and which are stubbed for want of a GPU.
"""

from __future__ import annotations

import collections
import os

import pytest

from schemas.trainer_version import TrainerVersion
from streams.consumer import read_topic
from tests.integration.helpers import setup_topics
from tests.verl.cpu_verl import (
    ReassemblerThread,
    agent_loop_manager,
    compose,
    cpu_overrides,
    cpu_trainer,
    rlstream_overrides,
    shared_services,
    stop_agent_loop_manager,
)
from workers.adapters.verl_checkpoint import STATE_FILE, read_tracker, step_dir


@pytest.fixture
def run(kafka, tq_store, unique, tiny, tmp_path):
    """A verl run's config, its shared services and a reassembler, all under a unique prefix."""
    prefix = f"verl-{unique}"
    names = setup_topics(kafka, prefix, partitions=2)

    def config(**kw):
        return compose(
            cpu_overrides(tiny, str(tmp_path / "checkpoints"), **kw)
            + rlstream_overrides(kafka.bootstrap_servers, prefix, f"verl-{unique}")
        )

    base = config()
    shared = shared_services(base)
    reassembler = ReassemblerThread(kafka, tq_store, prefix)
    yield names, config, shared, str(tmp_path / "checkpoints")
    reassembler.close()


def _train_partition_keys() -> dict:
    import transfer_queue as tq

    return tq.kv_list("train").get("train", {})


def test_verls_loop_trains_every_group_its_own_rollouts_published_through_rlstream(run, kafka):
    names, config_of, shared, checkpoints = run
    config = config_of(steps=3)
    trainer = cpu_trainer(config, shared)
    manager = agent_loop_manager(config, trainer)
    try:
        trainer.fit(manager)  # validation before training, then 3 steps, a checkpoint each
    finally:
        stop_agent_loop_manager(manager)
        trainer.replay_buffer.close()
    trained = trainer.actor_rollout_wg.trained
    assert sorted(trained) == [1, 2, 3]
    rows_per_group = collections.Counter(g for groups in trained.values() for g in groups)
    # 2 prompts a step, each a group of rollout.n = 2 rows; every group trained once, in one step.
    assert len(rows_per_group) == 6 and set(rows_per_group.values()) == {2}
    assert all(len(groups) == 4 for groups in trained.values())
    # The groups are verl's own prompts (their uids), finalized by rlstream.
    published = {r.key.decode() for r in read_topic(kafka, names.receipts)}
    assert set(rows_per_group) == published
    # verl's partition holds nothing of them: prompt keys cleared on publish, rows after training.
    assert not [k for k, tag in _train_partition_keys().items() if tag.get("rlstream_group_id") in rows_per_group]
    assert not set(_train_partition_keys()) & published
    # The consumer's state beside each of verl's checkpoints; verl's tracker at the last.
    assert read_tracker(checkpoints) == 3
    assert all(os.path.exists(os.path.join(step_dir(checkpoints, s), STATE_FILE)) for s in (1, 2, 3))
    # The trainer's version (weights S - 1 at step S) went to the admission gates once a step.
    versions = [TrainerVersion.from_bytes(r.value).version for r in read_topic(kafka, names.trainer_version)]
    assert versions == [0, 1, 2]
