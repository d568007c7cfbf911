"""Ray restarts a reassembler actor whose process dies, and its worker loop resumes: on the session's
real broker, Ray and TQ, groups published before and after the kill are all finalized exactly once."""

import os
import signal
import time
from collections import Counter

import ray

from tests.integration.helpers import finalized_records, publish_groups, setup_topics
from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors
from workers.reassembler.config import ReassemblerConfig, default_actor_config


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _wait_for(what: str, holds, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(1.0)


def test_a_killed_actor_is_restarted_and_its_worker_loop_resumes(kafka, tq_store, unique):
    names = setup_topics(kafka, f"actor-restart-{unique}", partitions=2)
    config = ReassemblerConfig(prefix=names.prefix, worker_id="actor-r", consumer_group=f"reassemblers.{unique}")
    (actor,) = create_rollout_reassembler_actors(
        DataPlaneConfig(), default_actor_config(), num_workers=1, name_prefix=f"restart-{unique}"
    )
    try:
        run = actor.run_worker.remote(kafka, config)
        groups = publish_groups(kafka, tq_store, names, 10, prefix="before-")
        _wait_for("the first groups", lambda: len(finalized_records(kafka, names)) >= 10)
        first = _pid(actor)
        os.kill(first, signal.SIGKILL)  # as the OOM killer would; Ray did not ask for it

        groups.update(publish_groups(kafka, tq_store, names, 10, seed=1, prefix="after-"))
        _wait_for("a restarted actor", lambda: _pid(actor) != first)
        _wait_for("every group", lambda: {r.group_id for r in finalized_records(kafka, names)} >= set(groups))
        counts = Counter(r.group_id for r in finalized_records(kafka, names))
        assert set(counts) == set(groups) and max(counts.values()) == 1

        actor.stop_worker.remote()
        stats = ray.get(run, timeout=60)  # the run retried on the restarted actor, stopped as asked
        assert stats["finalized"] >= 1
    finally:
        ray.kill(actor)
