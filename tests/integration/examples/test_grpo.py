"""`rlstream example grpo`, short: a real GRPO run through broker, TQ, reassemblers and Ray rollout actors learns."""

import pytest

from streams.tq import STAGING, TRAIN
from workers.examples.grpo.run import GrpoConfig, run_grpo


def test_a_short_grpo_run_through_the_pipeline_beats_the_untrained_policy(kafka, tq_store, unique, tmp_path):
    # 12 steps of 8 groups lift the copy task's evaluated reward from ~0.06 to ~0.15-0.2 (seeded; offline
    # the same schedule with one version of staleness gives 0.14-0.16 at step 10 over three seeds).
    cfg = GrpoConfig(steps=12, time_budget_s=240, png=tmp_path / "grpo.png", seed=0)
    lines: list[str] = []
    result = run_grpo(cfg, kafka=kafka, store=tq_store, prefix=f"grpo-{unique}", log=lines.append)
    log = "\n".join(lines[-20:])
    print(result.summary())  # shown with -rP: the figures of a passing run
    assert not result.timed_out, log
    assert len(result.steps) == cfg.steps, log
    # Every batch came through the consumer's staleness bound, and versions advanced one per step.
    assert [s.version for s in result.steps] == list(range(cfg.steps))
    assert all(s.groups == cfg.batch_groups and s.max_staleness <= cfg.max_staleness for s in result.steps)
    assert result.groups_published >= cfg.steps * cfg.batch_groups + result.evicted_stale
    assert result.untrained_reward < 0.1, result.summary()
    assert result.final_reward >= result.untrained_reward + 0.05, result.summary()
    assert result.png is not None and result.png.stat().st_size > 10_000
    # Groups still in flight at the end are cleared with the rest of the run's rows.
    for partition in (STAGING, TRAIN):
        assert not [k for k in tq_store.list(partition) if k.startswith(f"{result.prefix}-")], partition


def test_rollout_actors_without_their_kafka_secret_on_the_node_stop_the_run_in_one_line(tq_session, unique):
    # Pre-checked on every actor before any starts, as the demo's reassembler actors are: not a rollout
    # worker failing later inside a run that waits for its groups.
    from streams.config import KafkaConfig
    from streams.errors import ConfigError
    from workers.actors.kafka_secrets import for_actors
    from workers.examples.grpo.policy import PolicyShape
    from workers.examples.grpo.rollout import RolloutSpec
    from workers.examples.grpo.run import _Rollouts
    from workers.examples.grpo.task import CopyTask

    kafka = for_actors(KafkaConfig("nowhere:9093", {"sasl.username": "run1", "sasl.password": "s3cret-9a1"}))
    spec = RolloutSpec(kafka, f"grpo-{unique}", "trainer", CopyTask(), PolicyShape(), 2, 1, 2)
    with pytest.raises(ConfigError) as err:
        _Rollouts(spec, max_groups=1)
    message = str(err.value)
    assert (
        message.startswith("rollout workers: ") and "sasl.password" in message and "not found on this node" in message
    )
    assert "s3cret-9a1" not in message and "\n" not in message
