"""`rlstream example ...`: runnable examples that train through the pipeline.

Loaded only when run: the examples import torch and Ray.
"""

from __future__ import annotations

from pathlib import Path

import click

from workers.cli.options import KafkaTarget, kafka_options, say


@click.group()
def example() -> None:
    """Runnable examples that train through rlstream."""


@example.command("grpo")
@kafka_options(required=False, prefix_help="topic prefix (default: a fresh grpo-<id>)")
@click.option("--steps", type=click.IntRange(1, 100_000), default=60, show_default=True, help="trainer steps")
@click.option("--batch-groups", type=click.IntRange(1, 1024), default=8, show_default=True, help="groups per step")
@click.option("--group-size", type=click.IntRange(2, 256), default=8, show_default=True, help="rollouts per group")
@click.option("--rollout-workers", type=click.IntRange(1, 64), default=2, show_default=True, help="Ray actors")
@click.option("--reassemblers", type=click.IntRange(1, 16), default=1, show_default=True, help="worker threads")
@click.option(
    "--max-staleness", type=click.IntRange(0, 100), default=1, show_default=True, help="weight versions, at most"
)
@click.option("--lr", type=click.FloatRange(0, 1, min_open=True), default=0.02, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--time-budget", type=click.FloatRange(1, 86_400), default=300.0, show_default=True, help="seconds")
@click.option(
    "--png",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("grpo.png"),
    show_default=True,
    help="figure of reward, staleness and throughput per step",
)
@click.option("--ray-address", default=None, help="Ray cluster to use (default: start a local one)")
@click.option(
    "--prompts",
    type=click.IntRange(1, 10_000_000),
    default=None,
    help="a finite run: prompts 0..N-1, each trained once (or handed back and regenerated); ends when all are",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="checkpoint the trainer here (weights, journal, rlstream's consumer state and a spill of TQ's rows)",
)
@click.option("--checkpoint-every", type=click.IntRange(1, 100_000), default=5, show_default=True, help="steps")
@click.option(
    "--resume",
    is_flag=True,
    help="restart a run killed whole from --checkpoint-dir's latest checkpoint, under the same --prefix",
)
def grpo(target: KafkaTarget, png: Path, time_budget: float, **sizes) -> int:
    """A tiny GRPO run on CPU whose experience flows through Kafka + TQ; exit 1 if the reward did not rise.

    Rollout actors sample a toy copy task with a GRU policy and publish each prompt group; reassemblers
    finalize them; the trainer selects groups by weight version, takes a clipped GRPO step and
    publishes new weights. Prints a line per step and the untrained vs final evaluated reward.
    """
    from workers.actors.kafka_secrets import kafka_files
    from workers.examples.grpo.run import GrpoConfig, run_grpo

    if sizes["resume"] and not (sizes["checkpoint_dir"] and target.prefix):
        say("rlstream example grpo: --resume needs the run's --checkpoint-dir and --prefix")
        return 1
    kafka = target.kafka
    cfg = GrpoConfig(png=png, time_budget_s=time_budget, **sizes)
    files = kafka_files(target.kafka_config, target.config_file)  # where the rollout actors read their secrets
    result = run_grpo(
        cfg, kafka=kafka, prefix=target.prefix, log=lambda line: print(line, flush=True), kafka_files=files
    )
    print(result.summary(), flush=True)
    if result.unsettled:
        say(f"rlstream example grpo: {result.unsettled} prompt(s) never trained before the run ended")
        return 1
    if result.final_reward <= result.untrained_reward:
        say("rlstream example grpo: the final policy scores no better than the untrained one")
        return 1
    return 0
