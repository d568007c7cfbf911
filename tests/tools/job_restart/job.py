"""The job-restart drill's GRPO job: `rlstream example grpo`'s run, with the drill's faults (a test tool).

    python -m tests.tools.job_restart.job --bootstrap-servers B --prefix P --prompts N --checkpoint-dir D
        [--resume] [--failed-rollout-every K] [--hold-when FILE] [--transaction-timeout-ms T] ...

The same run as `rlstream example grpo` (`workers.examples.grpo.run.run_grpo`) and the same output,
but built by the drill: every K-th prompt's first rollout fails (an environment crash), and with
`--hold-when FILE` its reassemblers hold their next step's open transaction for good once FILE exists
(`tests.tools.faults.HoldWhenArmed`), and with `--pause-when FILE` its trainer takes no step after FILE
exists (`PauseWhenArmed`). No production setting reaches any of them: only this module does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from streams.config import KafkaConfig
from tests.tools.faults import HoldWhenArmed
from workers.examples.grpo.run import GrpoConfig, run_grpo
from workers.reassembler.faults import NO_FAULTS

# What the job prints when its trainer pauses for good: in its log, for whoever reads a round afterwards.
PAUSED = "trainer paused until the job is killed"


class PauseWhenArmed:
    """The run's log, except that once `armed` exists the trainer's next progress line blocks for good.

    The trainer logs each step's line from its own loop right after the step, so it trains no batch
    past that one: a drill that kills the job after a wait (for a checkpoint, for a held transaction)
    meanwhile finds prompts untrained, instead of a trainer that drained all of them. The line is
    printed before it blocks, so the drill counts every step trained.
    """

    def __init__(self, armed: str, log: Callable[[str], None]):
        self.armed, self.log = armed, log

    def __call__(self, line: str) -> None:
        self.log(line)
        if line.startswith("step ") and os.path.exists(self.armed):
            self.log(f"[drill] {PAUSED}")
            while True:
                time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.tools.job_restart.job")
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=900.0)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--failed-rollout-every", type=int, default=0)
    p.add_argument("--hold-when", default=None)
    p.add_argument("--pause-when", default=None)
    p.add_argument("--transaction-timeout-ms", type=int, default=None)
    args = p.parse_args(argv)
    cfg = GrpoConfig(
        steps=100_000, batch_groups=args.batch_groups, max_staleness=args.max_staleness, seed=args.seed,
        time_budget_s=args.time_budget, png=args.png, prompts=args.prompts, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, failed_rollout_every=args.failed_rollout_every,
        transaction_timeout_ms=args.transaction_timeout_ms,
    )  # fmt: skip
    faults = HoldWhenArmed(args.hold_when) if args.hold_when else NO_FAULTS

    def log(line: str) -> None:
        print(line, flush=True)

    result = run_grpo(
        cfg, kafka=KafkaConfig(args.bootstrap_servers), prefix=args.prefix,
        log=PauseWhenArmed(args.pause_when, log) if args.pause_when else log, reassembler_faults=faults,
    )  # fmt: skip
    print(result.summary(), flush=True)
    if result.unsettled:
        print(f"job: {result.unsettled} prompt(s) never trained before the run ended", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
