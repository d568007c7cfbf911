"""One run of the explorer: the models, the real components on them, the faults of a plan, and the verdict.

`World(seed, workload, plan, root).run()` creates the pipeline's topics on a model Kafka cluster and a
model TQ, starts the roles (reassemblers `w0..`, `trainer`, `rollout`) as simulated processes
(`components.py`), installs the plan's faults (`faults.py`), runs the scheduler until every prompt
group has an outcome and TQ is empty (or a virtual deadline passes), then checks the invariants
(`audit.py`). Everything is decided by the seed, the plan and the workload.

Roles are supervised as a worker pool supervises its children: a process that dies (an injected
crash, or an error its code let escape) is started again under the same role (the same worker id,
so its successor fences it and takes its partitions back), at once the first time in a row, then
after 1 s doubling to 30 s; one that ran 60 s starts a new series. A reassembler that stops as
fenced by a live twin (`WorkerFenced`) is not restarted. A whole-job kill kills every process and
TQ (Kafka keeps everything); `resume` runs, then every role starts again, the trainer from its
latest checkpoint.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from tests.tools.explore import components
from tests.tools.explore.audit import outstanding, violations
from tests.tools.explore.commits import named_consumed, scaled_limits
from tests.tools.explore.components import NAMES, Model
from tests.tools.explore.faults import POINT_KINDS, Fault
from tests.tools.explore.runtime import SimRuntime
from tests.tools.explore.sched import START, Actor, Proc, Scheduler, Stuck
from tests.tools.explore.workload import Published, Workload
from tests.tools.sim.env import Request
from tests.tools.sim.kafka import ClusterConfig, KafkaCluster
from tests.tools.sim.tq import SimTQ
from workers.reassembler.errors import WorkerFenced
from workers.topics import pipeline_topics

DEADLINE_S = 900.0  # virtual seconds a run may take before it counts as stuck
COMPACT_EVERY_S = 20.0  # the log cleaner's pass over the compacted topics
SPARE_DELAY_S = 0.2
FAILING_CALL_S = 1.0  # virtual seconds a call takes to fail while an error fault lasts
RESUME_ATTEMPTS = 6  # runs of resume after a whole-job kill, while Kafka fails it for a reason that can pass


@dataclass
class Facts:
    """What the components' own durable records would say (the rollout worker's journal of what it
    published, the trainer's version), and how each role ended."""

    cursor: int = 0
    published: dict[str, Published] = field(default_factory=dict)
    version: int = 0
    crashes: dict[str, list[str]] = field(default_factory=dict)
    resume_reports: list[Any] = field(default_factory=list)
    resume_errors: list[str] = field(default_factory=list)
    resolved_originals: list[tuple[str, int, int]] = field(default_factory=list)
    # Groups a trainer without checkpoints trained though the commit standing when it started named them
    # consumed (DESIGN: such records are read again as consumed, their rows cleared, never trained again).
    retrained_named: list[str] = field(default_factory=list)
    trained_at: dict[str, float] = field(default_factory=dict)  # when each group was first trained
    job_kills: list[float] = field(default_factory=list)  # when the whole job was killed


@dataclass
class Role:
    name: str
    body: Callable[..., None]
    proc: Proc | None = None
    incarnation: int = 0
    series: int = 0
    started_at: float = 0.0
    fenced: bool = False


@dataclass
class Result:
    seed: int
    workload: Workload
    plan: list[Fault]
    ended: str
    violations: list[str]
    events: list[tuple[float, str]]
    digest: str
    virtual_s: float
    real_s: float
    points: int
    switches: int
    trace: list[str]

    @property
    def failed(self) -> bool:
        return bool(self.violations)

    def kinds(self) -> set[str]:
        """The kinds of invariant broken (the text before the first colon), to tell one bug from another."""
        return {v.split(":", 1)[0] for v in self.violations}


class World:
    def __init__(
        self,
        seed: int,
        workload: Workload,
        plan: list[Fault],
        root: Path,
        *,
        switch: float = 0.2,
        deadline_s: float = DEADLINE_S,
    ):
        self.seed, self.workload, self.plan, self.root = seed, workload, list(plan), Path(root)
        self.deadline_s = deadline_s
        self.sched = Scheduler(seed, switch=switch)
        self.cluster = KafkaCluster(self.sched, ClusterConfig())
        self.tq = SimTQ(self.sched)
        for spec in pipeline_topics(NAMES, partitions=workload.partitions):
            parts = spec.partitions
            if spec.name == NAMES.finalized and workload.finalized_partitions is not None:
                parts = workload.finalized_partitions
            self.cluster.create_topic(spec.name, parts, dict(spec.config))
        self.roles: dict[str, Role] = {
            f"w{i}": Role(f"w{i}", components.reassembler(i)) for i in range(workload.reassemblers)
        }
        self.roles["trainer"] = Role("trainer", components.trainer)
        self.roles["rollout"] = Role("rollout", components.rollout)
        self.resume_role = Role("resume", components.resume_job)
        self.facts = Facts()
        self.model: Model | None = None
        self.checkpoints = 0
        self.events: list[tuple[float, str]] = []
        self.epoch = 0
        self.job_down = False
        self._next_check = 0.0
        self.sched.on_exit = self._exited
        self._faults = [f for f in plan if f.kind in POINT_KINDS or f.kind == "hold"]
        self._failing: dict[Fault, float] = {}  # error faults failing every call of theirs until then
        self.sched.hooks.append(self._at_point)
        self.sched.deliver_hooks.append(self._at_request)
        for f in plan:
            if f.kind == "down":
                self.sched.call_at(START + f.at, lambda f=f: self._down(f))
            elif f.kind == "job":
                self.sched.call_at(START + f.at, lambda f=f: self._job_kill(f))
        self.sched.call_at(START + COMPACT_EVERY_S, self._compact)

    # ----- what components and the audit ask -------------------------------------------------------

    def note(self, text: str) -> None:
        self.events.append((round(self.sched.elapsed, 3), text))

    def trained(self) -> Counter:
        return Counter(g for g, _ in self.model.trained) if self.model is not None else Counter()

    def named_consumed(self) -> set[tuple[int, int]]:
        return named_consumed(self)

    # ----- the run ------------------------------------------------------------------------------------

    def run(self) -> Result:
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        for role in self.roles.values():
            self._start(role)
        try:
            try:
                with scaled_limits():
                    ended = self.sched.run(self._done, START + self.deadline_s)
            except Stuck as exc:  # a run that cannot go on is a failure of its seed, not of the explorer
                ended = f"stuck: {exc}"
            found = violations(self, ended)
        finally:
            trace = list(self.sched.trace)
            self.sched.close()
        return Result(
            self.seed,
            self.workload,
            self.plan,
            ended,
            found,
            self.events,
            self.sched.digest(),
            round(self.sched.elapsed, 3),
            time.monotonic() - t0,
            self.sched.points,
            self.sched.switches,
            trace,
        )

    def _done(self) -> bool:
        if self.sched.now() < self._next_check:
            return False
        self._next_check = self.sched.now() + 1.0
        if self.job_down:
            return False
        return not outstanding(self)

    # ----- roles --------------------------------------------------------------------------------------

    def _start(self, role: Role) -> None:
        role.incarnation += 1
        proc = self.sched.process(f"{role.name}.{role.incarnation}", role.name)
        role.proc, role.started_at = proc, self.sched.now()
        rt = SimRuntime(self.sched, proc)
        self.sched.spawn(proc, "main", lambda: role.body(self, proc, rt), main=True)

    def _role(self, proc: Proc) -> Role:
        return self.resume_role if proc.role == "resume" else self.roles[proc.role]

    def _bury(self, proc: Proc) -> None:
        """The process is gone: its actors never run again, its Kafka clients stop."""
        if not proc.dead:
            self.sched.kill(proc)
            self.cluster.kill(proc.name)

    def _exited(self, actor: Actor) -> None:
        proc, error = actor.proc, actor.error
        role = self._role(proc)
        self._bury(proc)
        if role.proc is not proc:
            return  # an earlier incarnation (killed with the job)
        if role is self.resume_role:
            if error is not None:
                transient = isinstance(error, KafkaException) and not error.args[0].fatal()
                if transient and role.series < RESUME_ATTEMPTS:
                    # The broker did not answer: an operator runs `rlstream resume` again.
                    self.note(f"{proc.name} failed ({_first_line(error)}); resume runs again")
                    self._restart(role)
                    return
                self.facts.resume_errors.append(f"{type(error).__name__}: {error}")
                self.note(f"{proc.name} failed: {type(error).__name__}: {error}{_where(actor.trace)}")
            self._job_back()
            return
        if isinstance(error, WorkerFenced):
            role.fenced = True
            self.note(f"{proc.name} stopped as fenced by a live twin: {error}")
            return
        what = "returned" if error is None else f"{type(error).__name__}: {_first_line(error)}"
        self.facts.crashes.setdefault(role.name, []).append(what)
        self.note(f"{proc.name} crashed: {what}{_where(actor.trace)}")
        self._restart(role)

    def _restart(self, role: Role) -> None:
        uptime = self.sched.now() - role.started_at
        if uptime >= 60:
            role.series = 0
        delay = SPARE_DELAY_S if role.series == 0 else min(2.0 ** (role.series - 1), 30.0)
        role.series += 1
        epoch = self.epoch

        def again() -> None:
            if self.epoch == epoch and (not self.job_down or role is self.resume_role):
                self._start(role)

        self.sched.call_at(self.sched.now() + delay, again)

    def _crash(self, proc: Proc) -> None:
        self._bury(proc)
        role = self._role(proc)
        if role.proc is proc:
            self._restart(role)

    def _freeze(self, proc: Proc, seconds: float) -> None:
        self.cluster.freeze(proc.name)

        def thaw() -> None:
            if not proc.dead:
                self.cluster.thaw(proc.name)

        self.sched.freeze(proc, seconds, thaw)

    # ----- faults -------------------------------------------------------------------------------------

    def _at_point(self, actor: Actor, name: str, details: dict) -> None:
        if not self._faults and not self._failing:
            return
        proc = actor.proc
        role = self._role(proc)
        if role.proc is not proc or proc.dead:
            return
        now = self.sched.elapsed
        for f, until in list(self._failing.items()):
            if now >= until:
                del self._failing[f]
            elif f.role == proc.role and name.startswith(f.point):
                self._fail_slowly(actor, f)
        for f in self._faults:
            if f.kind in POINT_KINDS and f.role == proc.role and now >= f.at and name.startswith(f.point):
                self._faults.remove(f)
                self.note(f"fault: {f} (in {actor.name})")
                if f.kind == "error" and f.seconds:
                    self._failing[f] = now + f.seconds  # a failover lasting that long: each such call fails
                if f.kind == "crash":
                    self._crash(proc)
                elif f.kind == "freeze":
                    self._freeze(proc, f.seconds)
                elif f.kind == "slow":
                    self.sched.slow(actor, f.seconds)
                elif f.kind == "error":
                    if f.seconds:
                        self._fail_slowly(actor, f)
                    raise f.error()
                return

    def _fail_slowly(self, actor: Actor, f: Fault) -> None:
        """A call failing while a failover lasts: it fails as a timeout does, after FAILING_CALL_S, never at
        once (no real call fails in no time; a component retrying at once would spin the clock to a halt)."""
        self.sched.slow(actor, FAILING_CALL_S)
        raise f.error()

    def _at_request(self, request: Request) -> float | None:
        if not self._faults:
            return None
        name = request.details.get("process") or request.details.get("client") or ""
        proc = self.sched.procs.get(name)
        if proc is None:
            return None
        now = self.sched.elapsed
        for f in self._faults:
            if f.kind == "hold" and f.role == proc.role and now >= f.at and request.name.startswith(f.point):
                self._faults.remove(f)
                self.note(f"fault: {f} ({request.name} of {name})")
                return f.seconds
        return None

    def _down(self, f: Fault) -> None:
        self.note(f"fault: {f}")
        self.cluster.down()
        self.sched.call_at(self.sched.now() + f.seconds, self._up)

    def _up(self) -> None:
        self.note("broker back")
        self.cluster.up()

    def _job_kill(self, f: Fault) -> None:
        if self.job_down:
            return
        self.note(f"fault: {f}: every process and TQ lost, Kafka kept")
        self.facts.job_kills.append(self.sched.elapsed)
        self.epoch += 1
        self.job_down = True
        for role in [*self.roles.values(), self.resume_role]:
            if role.proc is not None:
                self._bury(role.proc)
        self.tq.lose_everything()
        if self.workload.checkpointed:
            self.model = None  # rolled back with the weights to the latest checkpoint
        self.resume_role.series = 0
        self._start(self.resume_role)

    def _job_back(self) -> None:
        self.job_down = False
        self.note("job restarted after resume")
        for role in self.roles.values():
            role.series = 0
            role.fenced = False
            self._start(role)

    def _compact(self) -> None:
        for name, topic in self.cluster.topics.items():
            if topic.compacted and topic.logs and any(log.end_offset > 1 for log in topic.logs):
                self.cluster.compact(name)
        self.sched.call_at(self.sched.now() + COMPACT_EVERY_S, self._compact)


def _where(trace: str) -> str:
    """The innermost frames of rlstream's own code in a traceback, as `module:line` (where it crashed)."""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith('File "')]
    ours = [f for f in frames if "/workers/" in f or "/streams/" in f]
    shown = []
    for f in ours[-3:]:
        path, _, rest = f[len('File "') :].partition('", line ')
        shown.append(f"{'/'.join(path.split('/')[-2:])}:{rest.split(',')[0]}")
    return f" (at {' < '.join(reversed(shown))})" if shown else ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""
