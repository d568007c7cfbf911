"""`rlstream example grpo`: a tiny GRPO run whose experience flows through rlstream, on CPU.

`run_grpo` starts (or uses the caller's) Kafka broker and Ray/TQ, creates the pipeline topics under
a fresh prefix, runs reassembler workers in threads of this process, rollout workers as Ray actors
and the GRPO trainer here, until `steps` trainer steps, the time budget, or (with `prompts`) every
prompt's group trained; then it evaluates the untrained and the final policy on the same prompts,
writes the PNG and stops what it started.

With `checkpoint_dir` the trainer checkpoints every `checkpoint_every` steps (`checkpoints.py`), and
`resume` restarts a run killed whole (Ray, TQ and every process of the job lost; the broker kept)
from its last checkpoint under the same prefix: `workers.trainer.resume` puts back the rows the
checkpoint's spill kept, before the reassemblers and the trainer start; groups whose rows are lost
are handed back and generated again by the rollout workers.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from schemas.errors import InvalidArgument
from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.tq import STAGING, TRAIN, KVStore, TQConfig, TQStore, init_tq
from workers.actors.kafka_secrets import NO_FILES, KafkaFiles, check_on_nodes, for_actors
from workers.demo.local import start_local_broker, stop_all
from workers.examples.grpo.checkpoints import Progress, Saving, begin, finish, journal_prompts, latest, load, save
from workers.examples.grpo.policy import PolicyShape, TinyPolicy
from workers.examples.grpo.rollout import RolloutSpec, RolloutWorker, WeightBoard, prompt_of
from workers.examples.grpo.task import CopyTask
from workers.examples.grpo.train import GrpoTrainer, StepStats
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.faults import NO_FAULTS, Faults
from workers.reassembler.worker import ReassemblerWorker
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.config import ConsumerConfig
from workers.trainer.resume import ResumeReport, resume


@dataclass(frozen=True)
class GrpoConfig:
    """Sizes of the run; the defaults learn the copy task clearly within 5 minutes on 2 cores."""

    steps: int = 60
    batch_groups: int = 8
    group_size: int = 8
    rollout_workers: int = 2
    reassemblers: int = 1
    max_staleness: int = 1
    lr: float = 0.02
    seed: int = 0
    time_budget_s: float = 300.0
    eval_prompts: int = 512
    partitions: int = 2
    task: CopyTask = CopyTask()
    png: Path | None = Path("grpo.png")
    ray_address: str | None = None
    # A finite run: prompts 0 .. prompts - 1, each trained once (or handed back and trained then).
    prompts: int | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 5
    resume: bool = False  # restart from checkpoint_dir's latest checkpoint, under the same prefix
    group_timeout_s: float = 10.0  # reassemblers: a group cut short by a crash is finalized this soon
    # Every n-th prompt's first rollout reports a failure, as an environment that crashed would (0: none).
    failed_rollout_every: int = 0
    # The reassemblers' transaction timeout (None: ReassemblerConfig's). The job-restart drill makes it
    # long so the transaction it holds open at the kill is still open when the restarted job resumes.
    transaction_timeout_ms: int | None = None


@dataclass
class GrpoResult:
    """What the run measured: evaluated rewards before and after, and every trainer step."""

    prefix: str
    untrained_reward: float = 0.0
    final_reward: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    evicted_stale: int = 0
    groups_published: int = 0
    wall_s: float = 0.0
    png: Path | None = None
    timed_out: bool = False
    restarts: list[int] = field(default_factory=list)  # the step each restart resumed at
    resume_report: list[str] = field(default_factory=list)
    first_step_after_start_s: float | None = None  # from the start of this process's run to its first step
    unsettled: int = 0  # prompts of a finite run neither trained nor evicted when it ended

    def summary(self) -> str:
        trained = sum(s.groups for s in self.steps)
        first = _mean([s.mean_reward for s in self.steps[:5]])
        last = _mean([s.mean_reward for s in self.steps[-5:]])
        return (
            f"GRPO through rlstream: {len(self.steps)} steps, {trained} groups trained "
            f"({self.groups_published} published, {self.evicted_stale} evicted as stale) in {self.wall_s:.1f}s\n"
            f"  evaluated reward: untrained {self.untrained_reward:.3f} -> final {self.final_reward:.3f}\n"
            f"  batch reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}"
            + (f"\n  figure: {self.png}" if self.png else "")
            + ("\n  stopped by the time budget" if self.timed_out else "")
            + (f"\n  restarted at step(s) {self.restarts}" if self.restarts else "")
            + (
                f"\n  first trained batch {self.first_step_after_start_s:.1f}s after this run started"
                if self.first_step_after_start_s is not None
                else ""
            )
        )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@torch.no_grad()
def evaluate(policy: TinyPolicy, task: CopyTask, n: int, seed: int) -> float:
    """Mean reward of sampled answers on `n` fixed prompts (same prompts and draws for every policy)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    prompts = task.prompts(n, gen)
    answers, _ = policy.sample(prompts, task.answer_len, gen)
    return float(task.reward(prompts, answers).mean())


def progress_line(s: StepStats) -> str:
    return (
        f"step {s.step:3d}  v{s.version:<3d} reward {s.mean_reward:.3f}  staleness {s.mean_staleness:.2f}"
        f" (max {s.max_staleness})  {s.groups_per_s:5.1f} groups/s  loss {s.loss:+.4f}"
        f"  clipped {s.clipped_fraction:.2f}  t={s.seconds:.1f}s"
    )


class _Reassemblers:
    """Reassembler workers in threads of this process (one consumer group), stopped together."""

    def __init__(
        self, kafka: KafkaConfig, store: KVStore, prefix: str, n: int, group_timeout_s: float, faults: Faults,
        transaction_timeout_ms: int | None = None,
    ):  # fmt: skip
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._threads = []
        for i in range(n):
            cfg = ReassemblerConfig(
                prefix=prefix,
                worker_id=reassembler_id(i),
                consumer_group=reassembler_group(prefix),
                group_timeout_s=group_timeout_s,
                **({"transaction_timeout_ms": transaction_timeout_ms} if transaction_timeout_ms else {}),
            )
            worker = ReassemblerWorker(kafka, store, cfg, faults=faults)
            t = threading.Thread(target=self._run, args=(worker,), name=f"reassembler-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, worker: ReassemblerWorker) -> None:
        try:
            worker.run(self._stop)
        except BaseException as exc:  # noqa: BLE001 - reported by failure(), which the trainer loop checks
            self._errors.append(exc)

    def failure(self) -> str | None:
        return f"a reassembler failed: {self._errors[0]!r}" if self._errors else None

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def reassembler_group(prefix: str) -> str:
    return f"reassemblers.{prefix}"


def reassembler_id(i: int) -> str:
    return f"grpo-{i}"


def rollout_group(prefix: str) -> str:
    """The rollout workers' RegenerateFeed consumer group."""
    return f"rollouts.{prefix}"


def trainer_id_of(prefix: str) -> str:
    return f"trainer.{prefix}"


class _Rollouts:
    """The weight board and the rollout workers, as Ray actors."""

    def __init__(self, spec: RolloutSpec, max_groups: int):
        import ray

        self._ray = ray
        self.board = ray.remote(num_cpus=0)(WeightBoard).remote()
        actor = ray.remote(num_cpus=0)(RolloutWorker)
        self.actors = [actor.remote(spec, i, self.board) for i in range(spec.workers)]
        # Every actor finds its Kafka secrets on its node before any starts: one line if one does not.
        check_on_nodes("rollout workers", [*self.actors, self.board], [a.connect.remote() for a in self.actors])
        self.runs = [a.run.remote(max_groups) for a in self.actors]

    def failure(self) -> str | None:
        done, _ = self._ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor's error, reported as the run's problem
                return f"a rollout worker failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
        return None

    def stop(self) -> list[dict]:
        self.board.stop.remote()
        try:
            return self._ray.get(self.runs, timeout=60)
        finally:
            for a in [*self.actors, self.board]:
                self._ray.kill(a)


def _train(
    trainer: GrpoTrainer,
    cfg: GrpoConfig,
    health: list[Callable[[], str | None]],
    log: Callable[[str], None],
    on_step: Callable[[StepStats], None],
) -> bool:
    """Train until `cfg.steps` steps, every prompt of a finite run settled, or the time budget; False when
    the budget ran out first."""
    deadline = time.monotonic() + cfg.time_budget_s
    while len(trainer.steps) < cfg.steps:
        want = None
        if cfg.prompts is not None:
            want = cfg.prompts - len(trainer.settled())
            if want <= 0:
                return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        stats = trainer.step(timeout_s=min(5.0, left), min_groups=want)
        if stats is not None:
            log(progress_line(stats))
            on_step(stats)
            continue
        problem = next((p for p in (check() for check in health) if p), None)
        if problem is not None:
            raise RuntimeError(problem)
    return True


def _restart(
    cfg: GrpoConfig, kafka: KafkaConfig, store: KVStore, names: TopicNames, log: Callable[[str], None]
) -> tuple[Path | None, ResumeReport, set[int]]:
    """Before anything reads the topics again: put back what the last checkpoint's spill kept.

    Resume aborts what this job's reassemblers left open (their ids are known) and settles the rollout
    workers' hand-backs; the prompts published already (the journal's, and those of every group
    resume saw) are not generated again.
    """
    assert cfg.checkpoint_dir is not None
    checkpoint = latest(cfg.checkpoint_dir)
    config = ConsumerConfig(prefix=names.prefix, consumer_group=trainer_id_of(names.prefix), checkpointed=True)
    report = resume(
        kafka, store, config, checkpoint,
        reassembler_consumer_group=reassembler_group(names.prefix),
        rollout_consumer_group=rollout_group(names.prefix),
        reassembler_worker_ids=[reassembler_id(i) for i in range(cfg.reassemblers)],
        feed_from_start=True,  # its own feed's group: one with no commit never took a hand-back
        say=log,
    )  # fmt: skip
    for line in report.lines():
        log(f"resume: {line}")
    if report.unaccounted:
        raise RuntimeError(f"resume: {len(report.unaccounted)} group(s) unaccounted for, e.g. {report.unaccounted[:3]}")
    published = journal_prompts(checkpoint) if checkpoint is not None else set()
    published |= {p for g in report.known_groups if (p := prompt_of(names.prefix, g)) is not None}
    return checkpoint, report, published


def run_grpo(
    cfg: GrpoConfig = GrpoConfig(),
    *,
    kafka: KafkaConfig | None = None,
    store: KVStore | None = None,
    prefix: str | None = None,
    log: Callable[[str], None] = print,
    kafka_files: KafkaFiles = NO_FILES,
    reassembler_faults: Faults = NO_FAULTS,
) -> GrpoResult:
    """Run GRPO through the pipeline; uses `kafka` / `store` (TQ already up) when given, else starts them.

    The rollout actors read `kafka`'s secret settings on their node, from `kafka_files` or the
    environment (`workers.actors.kafka_secrets`), never from their Ray arguments.

    Stops everything it started, also on failure or Ctrl-C. `reassembler_faults` is a drill's (the
    reassemblers' fault points, `workers/reassembler/faults.py`); nothing else sets it.
    """
    if cfg.resume and (cfg.checkpoint_dir is None or prefix is None):
        raise InvalidArgument("resuming a GRPO run needs its checkpoint directory and its prefix")
    t0 = time.monotonic()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # a tiny model: extra threads only contend with the workers for the cores
    result = GrpoResult(prefix=prefix or f"grpo-{uuid.uuid4().hex[:8]}")
    policy = TinyPolicy(PolicyShape(vocab=cfg.task.vocab))
    progress = Progress(untrained_reward=evaluate(policy, cfg.task, cfg.eval_prompts, cfg.seed))
    log(f"untrained policy: mean reward {progress.untrained_reward:.3f} on {cfg.eval_prompts} prompts")
    cleanups: list[Callable[[], None]] = []
    try:
        kafka = kafka or KafkaConfig(start_local_broker(cleanups, log, name="grpo"))
        if store is None:
            cleanups.append(init_tq(TQConfig(address=cfg.ray_address)).close)
            store = TQStore()
        names = TopicNames(result.prefix)
        create_topics(kafka, pipeline_topics(names, cfg.partitions))
        checkpoint, published = None, set()
        if cfg.resume:
            checkpoint, report, published = _restart(cfg, kafka, store, names, log)
            result.resume_report = report.lines()
        # Runs last: groups still in flight when training stops leave rows that nobody will consume.
        cleanups.append(lambda: _clear_rows(store, f"{result.prefix}-"))
        reassemblers = _Reassemblers(
            kafka, store, result.prefix, cfg.reassemblers, cfg.group_timeout_s, reassembler_faults,
            cfg.transaction_timeout_ms,
        )  # fmt: skip
        cleanups.append(reassemblers.stop)
        trainer_id = trainer_id_of(result.prefix)
        spec = RolloutSpec(
            for_actors(kafka, kafka_files), result.prefix, trainer_id, cfg.task, policy.shape, cfg.group_size,
            cfg.max_staleness, cfg.rollout_workers, cfg.seed, cfg.prompts, frozenset(published),
            cfg.failed_rollout_every,
        )  # fmt: skip
        rollouts = _Rollouts(spec, max_groups=10_000_000)
        cleanups.append(lambda: _stop_rollouts(rollouts, result))
        trainer = GrpoTrainer(
            kafka, store, result.prefix, policy, rollouts.board, batch_groups=cfg.batch_groups,
            max_staleness=cfg.max_staleness, lr=cfg.lr, trainer_id=trainer_id,
            checkpointed=cfg.checkpoint_dir is not None,
        )  # fmt: skip
        cleanups.append(trainer.close)
        if checkpoint is not None:
            progress = load(checkpoint, trainer)
            log(f"restarted from {checkpoint} at step {len(trainer.steps)}, version {trainer.version}")
        if cfg.resume:
            progress.restarts.append(len(trainer.steps))
        trainer.start()
        log(
            f"pipeline up in {time.monotonic() - t0:.1f}s (prefix {result.prefix}): {cfg.rollout_workers} rollout"
            f" actors, {cfg.reassemblers} reassembler(s), trainer weight_fifo({cfg.max_staleness}),"
            f" {cfg.batch_groups} groups x {cfg.group_size} rollouts per step"
        )
        saved = len(trainer.steps)
        saving: Saving | None = None

        def finished() -> None:
            nonlocal saving
            where = finish(saving, trainer)
            saving = None
            log(f"checkpoint {where.name}: made the latest and declared durable")

        def on_step(stats: StepStats) -> None:
            nonlocal saved, saving
            if result.first_step_after_start_s is None:
                result.first_step_after_start_s = time.monotonic() - t0
                log(f"first trained batch {result.first_step_after_start_s:.1f}s after this run started")
            if saving is not None and saving.done():
                finished()
            if cfg.checkpoint_dir is not None and len(trainer.steps) - saved >= cfg.checkpoint_every:
                if saving is not None:  # still spilling the last one: it goes first
                    finished()
                # The spill reads TQ off this thread; the trainer trains on and makes it the latest once written.
                saving = begin(cfg.checkpoint_dir, trainer, store, progress)
                saved = len(trainer.steps)
                log(f"checkpoint {saving.name}: {len(trainer.trained)} groups trained so far, spilling TQ")

        result.timed_out = not _train(trainer, cfg, [reassemblers.failure, rollouts.failure], log, on_step)
        if saving is not None:
            finished()
        if cfg.checkpoint_dir is not None and len(trainer.steps) > saved:
            save(cfg.checkpoint_dir, trainer, store, progress)
        result.steps, result.evicted_stale = list(trainer.steps), len(trainer.evicted_groups)
        result.restarts = list(progress.restarts)
        if cfg.prompts is not None:
            result.unsettled = cfg.prompts - len(trainer.settled())
    finally:
        stop_all(cleanups, log)
        result.wall_s = time.monotonic() - t0
    result.untrained_reward = progress.untrained_reward
    result.final_reward = evaluate(policy, cfg.task, cfg.eval_prompts, cfg.seed)
    if cfg.png is not None and result.steps:
        result.png = _plot(result, cfg.png)
    return result


def _plot(result: GrpoResult, path: Path) -> Path:
    from workers.examples.grpo.plot import write_png

    return write_png(
        result.steps, path, untrained=result.untrained_reward, final=result.final_reward, restarts=result.restarts
    )


def _stop_rollouts(rollouts: _Rollouts, result: GrpoResult) -> None:
    result.groups_published = sum(int(t["groups"]) for t in rollouts.stop())


def _clear_rows(store: KVStore, key_prefix: str) -> None:
    """Clear this run's staged and train rows from TQ (group ids, hence every key, start with its prefix)."""
    for partition in (STAGING, TRAIN):
        store.clear(partition, [k for k in store.list(partition) if k.startswith(key_prefix)])
