"""Chaos drill: the whole pipeline under SIGKILLs, a zombie, a broker crash and a trainer crash; then an audit.

It starts its own KRaft cluster (`streams.cluster.LocalCluster`) and Ray/TQ (or attaches to one with
`--ray-address`), a consumer group of reassembler processes (`rlstream reassemble`, one slot per
worker id), a trainer process (`tests/tools/chaos/trainer.py`) and a producer thread. While the producer
publishes, the drill, at random times:

- SIGKILLs reassemblers: pool children from outside at a random instant, each time another worker
  id (the pool's warm spare must take over every time), and extra workers started with a crash
  point (`after_tq_put`, `before_commit`, `after_commit`) that kill themselves there, mid-step;
- SIGSTOPs one reassembler longer than its session timeout and its transaction timeout, then
  SIGCONTs it (a zombie that must not get anything through);
- starts a worker that freezes itself at its first put, and once woken builds for longer than a
  session timeout before it asks to put (it must refuse: the audit checks every trained group's
  rows against a digest of what was staged);
- starts a worker that holds its first transaction open, and SIGSTOPs that transaction's
  coordinator (a broker) for longer than the transaction timeout while it does: back, the
  coordinator aborts the transaction, which the worker must ride out, never take for a live twin
  (no exit 78, the pool keeps its size). The hold makes the fault certain: a coordinator frozen
  while no transaction is open on it times nothing out, and a commit queued during the freeze can
  land before the coordinator's timeout sweep when it comes back;
- kill -9s one broker and restarts it on its data;
- SIGKILLs the trainer in the middle of a training step and starts a new one.

Afterwards `tests.tools.chaos.check` counts from the system's own outputs: lost and duplicated finalized
records (a fresh read_committed consumer), groups trained more than once (the trainer's journal),
the trainer's last version (the version topic) against the groups it trained, transaction timeouts
ridden out (the workers' logs), and what is left in TQ staging and train. It prints the figures and
exits 1 if an invariant fails; an invariant whose fault was scheduled must have been seen to hold
(a coordinator freeze that made no transaction time out fails the drill).
It stops only the processes it started, by their pid. An operator drill, not part of the runtime:
it lives with the test tools, apart from the benchmarks, and is run by `make chaos`.

    .venv/bin/python -m tests.tools.chaos [--groups 2000] [--kills 20] [--rate 10]

(from the repository root: its crash and freeze workers run `python -m tests.tools.drill_worker`).
"""

from __future__ import annotations

import argparse
import itertools
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from streams.admin import create_topics
from streams.cluster import ClusterConfig, LocalCluster
from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, init_tq, ray_address
from tests.tools.chaos.check import DrillEvents, account, figures, read_journal, unfinished_batches
from tests.tools.chaos.procs import TRAINER_ID, Producer, Reassemblers, Trainer, coordinator_of, process_state
from tests.tools.faults import CRASH_POINTS, HOLDING
from workers.telemetry.logs import configure_logging
from workers.topics import TopicNames, pipeline_topics

# Random kills between the crash points: the spare must take over one worker id after another.
KILL_KINDS = tuple(k for point in CRASH_POINTS for k in (point, "random"))


@dataclass(order=True)
class Event:
    at_s: float
    kind: str  # a KILL_KINDS entry, zombie, zombie_end, builder, broker, coordinator, trainer
    arg: float = 0.0


def schedule(args: argparse.Namespace, rng: random.Random) -> list[Event]:
    """Every disruption at a random time while the producer runs (not in its first or last tenth)."""
    span = args.groups / args.rate
    at = lambda: rng.uniform(0.1 * span, 0.8 * span)
    kinds = itertools.islice(itertools.cycle(KILL_KINDS), args.kills)
    events = [Event(at(), k) for k in kinds]
    if args.zombie_s > 0:
        t = at()
        events += [Event(t, "zombie"), Event(t + args.zombie_s, "zombie_end")]
    if args.broker_down_s > 0:
        t = at()
        events.append(Event(t, "broker", rng.randint(1, args.brokers)))  # up again broker_down_s after it died
    if args.frozen_build_s > 0:
        events.append(Event(at(), "builder"))
    if args.coordinator_freeze_s > 0:
        events.append(Event(at(), "coordinator"))
    if args.trainer_kill:
        events.append(Event(at(), "trainer"))
    return sorted(events)


class Drill:
    def __init__(self, args: argparse.Namespace, kafka: KafkaConfig, cluster: LocalCluster, workdir: Path):
        self.args, self.kafka, self.cluster = args, kafka, cluster
        self.rng = random.Random(args.seed)
        self.names = TopicNames(f"chaos-{self.rng.getrandbits(32):08x}")
        self.events = DrillEvents(
            kills_requested=args.kills, coordinator_freeze_s=args.coordinator_freeze_s, lost_share=args.lost_share
        )
        self.journal = workdir / "trainer.journal"
        self.workdir = workdir
        self.workers = Reassemblers(
            kafka, self.names, TQConfig(address=ray_address()), args.workers, workdir, self.events
        )
        self.trainer = Trainer(kafka, self.names, self.journal, workdir)
        self.events.batch_groups = self.trainer.batch_groups
        self.producer = Producer(
            kafka,
            self.names,
            args.groups,
            args.rate,
            args.seed,
            self.events,
            lost_share=args.lost_share,
            max_staleness=args.gate_staleness,
        )
        self.ray = ray_address()
        self.zombie_pid: int | None = None
        self.broker_down: int | None = None
        self.broker_up_at: float | None = None  # when the killed broker starts again
        self.builder: tuple[str, object] | None = None  # the frozen builder's id and process
        self.builder_wake_at: float | None = None
        self.frozen_broker: tuple[int, float] | None = None  # broker frozen as a coordinator, until when
        self.holder: str | None = None  # the worker holding a transaction open, until its coordinator froze
        self.events.pool_size = args.workers
        self._restarts: list[threading.Thread] = []
        self._done = threading.Event()
        self.trainer_kill_due = False

    def run(self) -> int:
        t0 = time.monotonic()
        create_topics(self.kafka, pipeline_topics(self.names, self.args.partitions, min(3, self.args.brokers)))
        say(f"topics under prefix {self.names.prefix}: {self.args.partitions} partitions")
        try:
            self.workers.start()
            self.trainer.start(self.ray)
            self.producer.start()
            say(f"{self.args.workers} reassemblers, a trainer and a producer of {self.args.groups} groups started")
            self._wait_until_up(t0)
            self._loop(time.monotonic(), schedule(self.args, self.rng))
        finally:
            self._stop_all()
        self.events.elapsed_s = time.monotonic() - t0
        say("auditing with a fresh read_committed consumer, the trainer's journal and TQ ...")
        self._read_worker_logs()
        acc = account(
            self.kafka,
            self.names,
            TQStore(),
            self.producer.staged,
            self.journal,
            self.events,
            self.producer.digests,
            self.producer.poisoned,
            trainer_id=TRAINER_ID,
        )
        for line in figures(acc, self.events):
            print(line, flush=True)
        return 1 if acc.problems else 0

    def _read_worker_logs(self) -> None:
        """What only the workers themselves can say: transaction timeouts ridden out, and the frozen
        builder's refusal to put once it woke."""
        logs = {p.name: p.read_bytes() for p in self.workdir.glob("*.log")}
        self.events.timeouts_ridden_out = sum(b.count(b"so the coordinator aborted it") for b in logs.values())
        if self.builder is not None:
            wid = self.builder[0]
            froze = "then built" in self.events.frozen_builder
            self.events.frozen_builder_refused = not froze or b"not putting the rows" in logs.get(f"{wid}.log", b"")
            if not froze:
                self.events.crash_workers_never_died.append(f"{wid} (never froze at a put)")

    def _wait_until_up(self, t0: float) -> None:
        """Until the first group went all the way to the trainer; the disruptions' clock starts then."""
        while not read_journal(self.journal)[0]:
            if time.monotonic() - t0 > self.args.timeout:
                raise TimeoutError("the pipeline did not train its first group")
            self._check_trainer()
            time.sleep(0.5)
        say(f"the first group reached the trainer after {time.monotonic() - t0:.0f}s; disruptions start now")
        self.producer.go.set()

    def _loop(self, t0: float, pending: list[Event]) -> None:
        deadline = t0 + self.args.timeout
        last_line = 0.0
        while True:
            now = time.monotonic() - t0
            while pending and pending[0].at_s <= now:
                ev = pending.pop(0)
                if not self._fire(ev):  # not possible yet (no spare ready): a little later
                    pending.append(Event(now + 2.0, ev.kind, ev.arg))
                    pending.sort()
            self._tend_builder()
            self._tend_coordinator()
            if self.broker_up_at is not None and time.monotonic() >= self.broker_up_at:
                self.broker_up_at = None
                self._restart_broker(self.broker_down)
            self.workers.reap(respawn=True)
            self._check_trainer()
            if self.trainer_kill_due:
                self._kill_trainer()
            if time.monotonic() - last_line >= 5:
                last_line = time.monotonic()
                say(self._progress(now))
            if not pending and self._finished():
                return
            if time.monotonic() > deadline:
                self.events.timed_out = True
                say(f"timed out after {self.args.timeout:.0f}s")
                return
            time.sleep(0.2)

    def _finished(self) -> bool:
        busy = (self.zombie_pid, self.broker_down, self.builder_wake_at, self.frozen_broker)
        if self.producer.is_alive() or any(x is not None for x in busy):
            return False
        trained, _ = read_journal(self.journal)
        wanted = set(self.producer.staged) - self.producer.poisoned
        done = len(set(trained) & wanted) >= len(wanted)
        if done and self.trainer_kill_due:  # nothing left to train: the kill can no longer land mid-step
            self.events.crash_workers_never_died.append("trainer (never seen mid-step)")
            self.trainer_kill_due = False
        if done and self.holder is not None:  # nothing left to commit: it can no longer hold a transaction
            self.events.crash_workers_never_died.append(f"{self.holder} (never held a transaction open)")
            self.holder = None
        return done

    def _progress(self, now: float) -> str:
        trained, _ = read_journal(self.journal)
        return (
            f"[{now:5.0f}s] produced {len(self.producer.staged)}/{self.args.groups}, trained {len(trained)}, "
            f"kills {sum(self.events.kills.values())}/{self.args.kills}, workers alive {self.workers.alive()}"
            f"{', zombie stopped' if self.zombie_pid else ''}"
            f"{f', broker {self.broker_down} down' if self.broker_down else ''}"
        )

    def _fire(self, ev: Event) -> bool:
        """Do what `ev` says; False if it cannot happen yet and should be tried again shortly."""
        if ev.kind == "random":
            if not self.workers.spare_ready():
                return False  # each death is the spare's to take over
            pid = self.workers.kill_random(self.rng, spare=self.zombie_pid)
            if pid is None:
                return False
            say(f"SIGKILL reassembler pid {pid} at a random instant")
        elif ev.kind in CRASH_POINTS:
            wid = self.workers.spawn_crasher(ev.kind)
            say(f"started {wid}, which SIGKILLs itself at {ev.kind}")
        elif ev.kind == "zombie":
            self.zombie_pid = self.workers.stop_one(self.rng, self.args.zombie_s)
            say(f"SIGSTOP reassembler pid {self.zombie_pid} for {self.args.zombie_s:.0f}s")
        elif ev.kind == "zombie_end" and self.zombie_pid is not None:
            self.workers.resume(self.zombie_pid)
            say(f"SIGCONT reassembler pid {self.zombie_pid}")
            self.zombie_pid = None
        elif ev.kind == "builder":
            wid, proc = self.workers.spawn_frozen_builder(self.args.frozen_build_s)
            self.builder = (wid, proc)
            self.builder_wake_at = float("inf")  # until it is seen frozen
            self.events.frozen_builder = f"{wid} started"
            say(f"started {wid}, which freezes at its first put and builds {self.args.frozen_build_s:.0f}s on waking")
        elif ev.kind == "broker":
            if self.frozen_broker is not None or self.holder is not None:
                return False  # one broker disruption at a time
            self.broker_down = int(ev.arg)
            self.broker_up_at = time.monotonic() + self.args.broker_down_s
            self.cluster.kill(self.broker_down)
            self.events.broker = f"broker {self.broker_down} killed (kill -9)"
            say(f"kill -9 broker {self.broker_down}")
        elif ev.kind == "coordinator":
            if self.broker_down is not None or self.frozen_broker is not None:
                return False
            # Past the freeze and the coordinator's sweep of timed-out transactions after it.
            hold_s = self.args.coordinator_freeze_s + 10
            self.holder, _ = self.workers.spawn_commit_holder(hold_s)
            self.events.coordinator = f"{self.holder} started, to hold its first transaction {hold_s:.0f}s"
            say(f"started {self.holder}, which holds its first transaction open {hold_s:.0f}s")
        elif ev.kind == "trainer":
            self.trainer_kill_due = True
        return True

    def _tend_builder(self) -> None:
        """Wake the frozen builder `zombie_s` after it froze itself."""
        if self.builder is None or self.builder_wake_at is None:
            return
        wid, proc = self.builder
        if self.builder_wake_at == float("inf"):
            if proc.poll() is None and process_state(proc.pid) == "T":
                self.builder_wake_at = time.monotonic() + self.args.zombie_s
                say(f"{wid} froze at its put; waking it in {self.args.zombie_s:.0f}s")
        elif time.monotonic() >= self.builder_wake_at:
            self.workers.wake(proc.pid)
            self.events.frozen_builder = (
                f"{wid} frozen {self.args.zombie_s:.0f}s, then built {self.args.frozen_build_s:.0f}s"
            )
            say(f"SIGCONT {wid}")
            self.builder_wake_at = None

    def _tend_coordinator(self) -> None:
        """Freeze the coordinator of the holder's open transaction once it holds it; thaw it when due."""
        if self.holder is not None and self.broker_down is None:
            log = self.workdir / f"{self.holder}.log"
            if log.exists() and HOLDING.encode() in log.read_bytes():
                node = coordinator_of(self.kafka, self.workers.transactional_id(self.holder))
                self.cluster.freeze(node)
                secs = self.args.coordinator_freeze_s
                self.frozen_broker = (node, time.monotonic() + secs)
                self.events.coordinator = (
                    f"broker {node} (coordinator of {self.holder}'s open transaction) frozen {secs:.0f}s"
                )
                say(f"SIGSTOP broker {node}, the coordinator of {self.holder}'s open transaction, for {secs:.0f}s")
                self.holder = None
        if self.frozen_broker is not None and time.monotonic() >= self.frozen_broker[1]:
            self.cluster.thaw(self.frozen_broker[0])
            say(f"SIGCONT broker {self.frozen_broker[0]}")
            self.frozen_broker = None

    def _restart_broker(self, node: int) -> None:
        def restart() -> None:
            t = time.monotonic()
            self.cluster.restart(node)
            ready = time.monotonic() - t
            self.events.broker += f", restarted on its data {self.args.broker_down_s:.0f}s later, ready in {ready:.0f}s"
            say(f"broker {node} restarted on its data ({ready:.1f}s to ready)")
            self.broker_down = None
            # The JVM gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG follows the
            # thread): this one lives until the drill stops.
            self._done.wait()

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        self._restarts.append(thread)

    def _kill_trainer(self) -> None:
        # Due until the trainer is seen in the middle of a step (it may be waiting out a broker outage).
        pid = self.trainer.kill_mid_step(timeout_s=0.5)
        if pid is None:
            return
        self.trainer_kill_due = False
        _, lines = read_journal(self.journal)
        self.events.trainer_kills += 1
        self.events.trainer_killed_mid_step += len(unfinished_batches(lines, pid))
        say(f"SIGKILL trainer pid {pid} in the middle of a training step; starting a new one")
        self.trainer.start(self.ray)

    def _check_trainer(self) -> None:
        code = self.trainer.exited()
        if code is not None:
            self.events.other_exits.append(f"trainer pid {self.trainer.proc.pid} exited {code}")
            say(f"the trainer exited with {code}; starting a new one")
            self.trainer.start(self.ray)

    def _stop_all(self) -> None:
        while self.broker_down is not None and any(t.is_alive() for t in self._restarts):
            time.sleep(0.5)  # a restart under way: let it finish before the cluster stops
        self.producer.stop()
        if self.zombie_pid is not None:
            self.workers.resume(self.zombie_pid)
        if self.frozen_broker is not None:
            self.cluster.thaw(self.frozen_broker[0])
        if self.builder is not None:
            self.workers.wake(self.builder[1].pid)
        # A last look before stopping: a crash worker still alive never reached its crash point.
        self.workers.reap(respawn=False)
        self.trainer.stop()
        self.workers.stop()


def say(line: str) -> None:
    print(line, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2000, help="prompt groups to produce")
    p.add_argument("--rate", type=float, default=10.0, help="groups produced per second")
    p.add_argument("--kills", type=int, default=20, help="reassembler SIGKILLs, cycling over crash points and random")
    p.add_argument("--workers", type=int, default=3, help="reassembler processes (slots)")
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--brokers", type=int, default=3, help="brokers in the local cluster")
    p.add_argument("--broker-down-s", type=float, default=10.0, help="how long one broker stays dead (0: no kill)")
    p.add_argument("--zombie-s", type=float, default=15.0, help="how long one reassembler stays stopped (0: none)")
    p.add_argument(
        "--frozen-build-s",
        type=float,
        default=8.0,
        help="a worker frozen at its put for --zombie-s then builds this long before putting (0: none)",
    )
    p.add_argument(
        "--coordinator-freeze-s",
        type=float,
        default=20.0,
        help="how long the transaction coordinator of a live worker stays frozen (0: no freeze)",
    )
    p.add_argument("--no-trainer-kill", dest="trainer_kill", action="store_false")
    p.add_argument(
        "--lost-share", type=float, default=0.1, help="share of groups produced with every rollout failed (lost)"
    )
    p.add_argument("--gate-staleness", type=int, default=1, help="the admission gate's staleness bound, in versions")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--ray-address", default=None, help="attach to this Ray instead of starting one")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    say(f"chaos drill: {args.groups} groups, {args.kills} kills, seed {args.seed}")
    with tempfile.TemporaryDirectory(prefix="rlstream-chaos-") as tmp:
        workdir = Path(tmp)
        say(f"starting a {args.brokers}-broker KRaft cluster ...")
        with LocalCluster(ClusterConfig(data_dir=workdir / "cluster", brokers=args.brokers), log=say) as cluster:
            say(f"bootstrap.servers={cluster.bootstrap_servers}")
            session = init_tq(TQConfig(address=args.ray_address))
            # After Ray's init, which installs its own SIGTERM handler: stop what we started, then exit.
            signal.signal(signal.SIGTERM, _interrupt)
            try:
                code = Drill(args, KafkaConfig(cluster.bootstrap_servers), cluster, workdir).run()
            finally:
                session.close()
        if code:
            keep = Path(tempfile.mkdtemp(prefix="rlstream-chaos-logs-"))
            for log in [*workdir.glob("*.log"), workdir / "trainer.journal"]:
                log.rename(keep / log.name)
            say(f"worker and trainer logs kept in {keep}")
    return code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
