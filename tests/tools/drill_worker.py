"""A reassembler child process for drills: `rlstream reassemble`'s child, built with drill faults.

    python -m tests.tools.drill_worker [--crash-at POINT] [--freeze-before-put [--then-build-s S]]
                                       [--slow-commit-s S]

reads the same one-line `WorkerSpec` on stdin as a pool's child and runs one worker with the faults
named on its command line. It exists so that no production setting can make a worker kill or
freeze itself: only a test or drill that starts this module can.
"""

from __future__ import annotations

import argparse
import sys

from streams.tq import set_torch_threads
from tests.tools.faults import CRASH_POINTS, CrashAt, FreezeBeforePut, SlowCommit
from workers.reassembler.faults import NO_FAULTS, Faults
from workers.reassembler.run import read_spec, run_worker, spawn_worker
from workers.telemetry.logs import configure_logging

ARGS = ("-m", "tests.tools.drill_worker")


def faults_from(argv: list[str]) -> Faults:
    parser = argparse.ArgumentParser(prog="drill_worker")
    parser.add_argument("--crash-at", choices=CRASH_POINTS)
    parser.add_argument("--freeze-before-put", action="store_true")
    parser.add_argument("--then-build-s", type=float, default=0.0)
    parser.add_argument("--slow-commit-s", type=float)
    args = parser.parse_args(argv)
    chosen = [
        f
        for f in (
            CrashAt(args.crash_at) if args.crash_at else None,
            FreezeBeforePut(args.then_build_s) if args.freeze_before_put else None,
            SlowCommit(args.slow_commit_s) if args.slow_commit_s else None,
        )
        if f is not None
    ]
    if len(chosen) > 1:
        parser.error("one fault per drill worker")
    return chosen[0] if chosen else NO_FAULTS


def spawn_drill_worker(kafka, config, tq, *, faults: list[str] = (), **popen_kwargs):
    """Start a drill worker of `config` with the faults given as drill_worker arguments."""
    return spawn_worker(kafka, config, tq, args=(*ARGS, *faults), **popen_kwargs)


def main(argv: list[str]) -> int:
    faults = faults_from(argv)
    spec = read_spec(sys.stdin.buffer.readline())
    configure_logging()
    set_torch_threads(spec.reassembler.torch_threads)  # as a pool's child sets it
    run_worker(spec.kafka, spec.reassembler, spec.tq, faults=faults)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
