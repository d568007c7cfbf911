"""Whole-job restart drill (issues 24, 30): a GRPO run killed whole at a random step, restarted from its checkpoint.

Each round runs the GRPO example (`tests.tools.job_restart.job`: `rlstream example grpo`'s run with
the drill's faults) as a job of its own (its own Ray with TQ, reassembler threads, Ray rollout
actors, a checkpointing trainer) over a finite set of prompts; at a random trainer step it SIGKILLs
every process of the job: the job's process group, the Ray daemons it started (their pid files) and
every descendant of those, so TQ's rows die with them. The broker stays up. It then restarts the job
with `--resume` from its last checkpoint and lets it run to the end, and audits from the system's
own outputs (`tests.tools.job_restart.audit`): the receipts topic (groups produced), the regenerate
topic (groups handed back), dead letters, and the trainer's journal in its final checkpoint (groups
trained, in the model's history). It prints, per round, trained once / handed back / regenerated and
trained / lost / trained twice, the time from the restart to the first trained batch and the
evaluated reward, and exits 1 unless every round has lost = 0, trained twice = 0, dead-lettered = 0
and trained once + handed back = produced.

Each round's faults (`--faults`, by default all three in every round):
- `failed`: every third prompt's first rollout fails (an environment crash), so groups with a failed
  rollout are open, finalized and lost at the kill: handed back, never dead-lettered (issue 30 item 2);
- `held`: just before the kill the reassembler holds its step's transaction open (records flushed, no
  commit), so the broker keeps a dead worker's transaction open across the restart (item 6);
- `duplicate`: after the kill, a copy of the finalized record of a group trained before the last
  checkpoint is published, past the checkpoint's cut (item 4): it must not be trained again.
A round fails unless each fault it asked for is seen to have fired (`audit.py`: a failed rollout's
receipt, partitions resume found held open, the duplicate resume found past the cut).

    .venv/bin/python -m tests.tools.job_restart [--rounds 3] [--prompts 480] [--faults failed,held,duplicate]

It stops only the processes it started, by their pid. A drill, not part of the runtime: `make drills`
runs it at full size, and `make test` a short round (tests/integration/test_job_restart.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from schemas.finalized import FinalizedGroup
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from tests.tools.faults import HOLDING
from tests.tools.job_restart.audit import Audit, audit_run, fired_in_resume
from workers.demo.local import start_local_broker, stop_all
from workers.topics import TopicNames

FAULTS = ("failed", "held", "duplicate")
FAILED_EVERY = 3
# The reassemblers' transaction timeout in a round with `held`: longer than the kill and the restart up to resume.
HELD_TRANSACTION_MS = 600_000

ROOT = Path(__file__).resolve().parents[3]
STEP = re.compile(r"^step\s+(\d+)\s", re.M)
FIRST = re.compile(r"^first trained batch ([\d.]+)s after this run started", re.M)
LATEST_MADE = ": made the latest and declared durable"


class Job:
    """One start of the GRPO job: its process group, its output, and its Ray's pid files."""

    def __init__(self, argv: list[str], workdir: Path, name: str):
        self.pids = workdir / f"{name}-pids"
        self.pids.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}.log"
        env = {**os.environ, "RLSTREAM_PID_DIR": str(self.pids), "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)  # the job starts a Ray of its own, which the kill takes down
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                log.write(line)
                log.flush()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def steps_done(self) -> int:
        """Trainer steps this start finished (its progress lines)."""
        return len(STEP.findall(self.output))

    def kill_everything(self) -> int:
        """SIGKILL the job's processes and its Ray's, with every descendant; returns how many were killed."""
        # A pid file may outlive its process and its pid be reused: only what started after the job is its.
        born = _started(self.proc.pid) or 0
        listed = [int(p.read_text()) for p in self.pids.glob("*.pid")]
        roots = [self.proc.pid] + [pid for pid in listed if (_started(pid) or -1) >= born]
        doomed = set()
        for root in roots:
            doomed |= {root, *_descendants(root)}
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        _wait_dead(doomed, timeout_s=60)
        self._reader.join(timeout=10)
        return len(doomed)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            raise
        finally:
            self._reader.join(timeout=10)


def _started(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (None if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, out, todo = _children(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _wait_dead(pids: set[int], timeout_s: float) -> None:
    from streams.pids import pid_alive

    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"still alive after SIGKILL: {sorted(p for p in pids if pid_alive(p))}")
        time.sleep(0.2)


def _wait_for(what: str, done: Callable[[], bool], job: Job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if job.proc.poll() is not None:
            raise RuntimeError(f"the job ended (exit {job.proc.returncode}) before {what}:\n{job.output[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f}s:\n{job.output[-3000:]}")
        time.sleep(0.2)


def _held_or_brake(job: Job, pause: Path, args) -> bool:
    """Whether the reassembler holds its transaction; meanwhile the trainer is stopped two steps short
    of the last prompt, never sooner. The hold needs a step of the reassembler's after it is armed: with
    the trainer stopped at once, every group had been finalized already on a quiet machine and no step
    came; left running, under load it trained every prompt before the hold (kill at step 3 of 8, killed
    after 8), leaving the restart nothing to do."""
    if HOLDING in job.output:
        return True
    if (job.steps_done() + 2) * args.batch_groups >= args.prompts:
        pause.touch()
    return False


def _republish_trained(kafka: KafkaConfig, prefix: str, checkpoints: Path) -> str:
    """Publish again the finalized record of the first group the last checkpoint's journal trained; its id."""
    name = (checkpoints / "LATEST").read_text().strip()
    trained = json.loads((checkpoints / name / "progress.json").read_text())["trained"]
    if not trained:
        raise RuntimeError("the last checkpoint trained nothing: kill later for a duplicate past its cut")
    gid = trained[0][0]
    names = TopicNames(prefix)
    record = next(r for r in read_topic(kafka, names.finalized) if FinalizedGroup.from_bytes(r.value).group_id == gid)
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.finalized, record.key, record.value)])
    producer.close()
    return gid


def run_round(
    kafka: KafkaConfig, args, kill_step: int, faults: set[str], workdir: Path, say: Callable[[str], None]
) -> Audit:
    prefix = f"jr-{uuid.uuid4().hex[:8]}"
    checkpoints = workdir / prefix
    hold = workdir / f"{prefix}.hold"
    argv = [
        sys.executable, "-m", "tests.tools.job_restart.job",
        "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", prefix,
        "--prompts", str(args.prompts), "--checkpoint-dir", str(checkpoints),
        "--checkpoint-every", str(args.checkpoint_every), "--max-staleness", str(args.max_staleness),
        "--seed", str(args.seed), "--time-budget", str(args.timeout), "--png", str(workdir / f"{prefix}.png"),
        "--batch-groups", str(args.batch_groups),
        "--failed-rollout-every", str(FAILED_EVERY if "failed" in faults else 0),
    ]  # fmt: skip
    if "held" in faults:
        # Past the kill and the restart up to resume: the held transaction is still open for resume to
        # abort (with the default 10 s the coordinator had aborted it, and the fault proved nothing).
        argv += ["--transaction-timeout-ms", str(HELD_TRANSACTION_MS)]
    say(f"round {prefix}: {args.prompts} prompts, kill at trainer step {kill_step}, faults {sorted(faults) or 'none'}")
    pause = workdir / f"{prefix}.pause"
    first = Job([*argv, "--hold-when", str(hold), "--pause-when", str(pause)], workdir, f"{prefix}-first")
    _wait_for(f"trainer step {kill_step}", lambda: first.steps_done() >= kill_step, first, args.timeout)
    if "duplicate" in faults:  # a checkpoint with trained groups, for a duplicate past its cut
        _wait_for("a checkpoint made the latest", lambda: LATEST_MADE in first.output, first, args.timeout)
    if "held" in faults:
        hold.touch()
        _wait_for("a reassembler holding its transaction", lambda: _held_or_brake(first, pause, args), first, 120)
    killed = first.kill_everything()
    say(f"  killed {killed} processes of the job after {first.steps_done()} steps (Ray and TQ with them)")
    hold.unlink(missing_ok=True)
    pause.unlink(missing_ok=True)
    if first.steps_done() * args.batch_groups >= args.prompts:
        raise RuntimeError(f"the job trained every prompt before the kill at step {kill_step}: kill it earlier")
    duplicate = _republish_trained(kafka, prefix, checkpoints) if "duplicate" in faults else None
    if duplicate:
        say(f"  published again the finalized record of {duplicate}, trained before the last checkpoint")
    restart = Job([*argv, "--resume"], workdir, f"{prefix}-restart")
    try:
        code = restart.wait(args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the restarted job ran past {args.timeout:g}s, killed:\n{restart.output[-6000:]}") from None
    out = restart.output
    for line in out.splitlines():
        if line.startswith("resume: "):
            say(f"  {line}")
    if code != 0:
        raise RuntimeError(f"the restarted job exited {code}:\n{out[-4000:]}")
    first_batch = FIRST.search(out)
    result = audit_run(kafka, prefix, checkpoints)
    result.killed_at_step = first.steps_done()
    result.first_batch_s = float(first_batch[1]) if first_batch else None
    result.duplicate = duplicate
    result.faults = frozenset(faults)
    result.held_partitions, result.duplicates_found = fired_in_resume(out)
    rewards = re.search(r"evaluated reward: untrained ([\d.]+) -> final ([\d.]+)", out)
    if rewards:
        result.rewards = (float(rewards[1]), float(rewards[2]))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.tools.job_restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=480, help="prompt groups per round")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--max-staleness", type=int, default=100, help="high: no group is evicted, each is trained")
    p.add_argument("--kill-steps", default=None, help="comma-separated trainer step per round (default: random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per start of the job")
    p.add_argument("--bootstrap-servers", default=None, help="use this broker (default: start one)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs, checkpoints, plots here")
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated, in every round: {', '.join(FAULTS)} (or 'none')",
    )
    args = p.parse_args(argv)
    faults = {f for f in args.faults.split(",") if f and f != "none"}
    if faults - set(FAULTS):
        p.error(f"--faults: unknown {sorted(faults - set(FAULTS))}, choose from {', '.join(FAULTS)}")

    def say(line: str) -> None:
        print(line, flush=True)

    steps = max(2, args.prompts // args.batch_groups)
    rng = random.Random(args.seed)
    kills = [int(s) for s in args.kill_steps.split(",")] if args.kill_steps else []
    kills += [rng.randint(1, steps - 1) for _ in range(args.rounds - len(kills))]
    cleanups: list[Callable[[], None]] = []
    results = []
    try:
        bootstrap = args.bootstrap_servers or start_local_broker(cleanups, say, name="job-restart")
        kafka = KafkaConfig(bootstrap)
        with tempfile.TemporaryDirectory(prefix="rlstream-job-restart-") as tmp:
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for kill_step in kills[: args.rounds]:
                result = run_round(kafka, args, kill_step, faults, workdir, say)
                results.append(result)
                for line in result.lines():
                    say(f"  {line}")
    finally:
        stop_all(cleanups, say)
    bad = [r for r in results if r.problems()]
    say(f"rounds: {len(results)}, invariants: " + ("all hold" if not bad else f"{len(bad)} round(s) failed"))
    for r in bad:
        say(f"  {r.prefix}: {'; '.join(r.problems())}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
