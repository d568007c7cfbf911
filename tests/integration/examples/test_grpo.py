"""`rlstream example grpo`, short: a real GRPO run through broker, TQ, reassemblers and Ray rollout actors learns."""

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
