"""What the chaos drill runs and disrupts: reassembler processes, the trainer process and the producer thread.

Every process here is started by the drill, remembered by its `Popen`, signalled by its pid and
nothing else, and gets SIGTERM from the kernel if the drill itself dies (`die_with_parent`).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from chaos_check import DrillEvents, read_journal

from streams.config import KafkaConfig
from streams.pids import die_with_parent
from streams.tq import TQConfig, TQStore
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import CHILD_ARGS, spawn_worker
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames

# The drill worker, run from the repository root (the cwd of every drill).
DRILL_WORKER = ("-m", "tests.tools.drill_worker")
# Its crash points (tests/tools/faults.py, not imported: bench scripts do not see tests/).
CRASH_POINTS = ("after_tq_put", "before_commit", "after_commit")

SHAPE = SyntheticShape(group_size=8, calls=(1, 3), prompt_len=(4, 12), answer_len=(2, 16), observation_len=(1, 6))
TRAINER = Path(__file__).resolve().with_name("chaos_trainer.py")
STOP_GRACE_S = 60.0


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each live process, wait, SIGKILL what is left after the grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Reassemblers:
    """Slots of reassembler processes (worker ids w0..wN-1, restarted with the same id) and crash workers."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, tq: TQConfig, n: int, workdir: Path, ev: DrillEvents):
        self.kafka, self.names, self.tq, self.workdir, self.ev = kafka, names, tq, workdir, ev
        self.group = f"reassemblers.{names.prefix}"
        self.slots: dict[str, subprocess.Popen] = {f"w{i}": None for i in range(n)}  # type: ignore[misc]
        self.crashers: dict[str, tuple[str, subprocess.Popen]] = {}
        self.killed: set[int] = set()  # pids this drill SIGKILLed
        self.zombie: int | None = None
        self._logs: list = []

    def _spawn(self, worker_id: str, crash_point: str | None = None) -> subprocess.Popen:
        cfg = ReassemblerConfig(prefix=self.names.prefix, worker_id=worker_id, consumer_group=self.group)
        # A crash worker is the drills' own child (tests/tools/drill_worker.py): no production
        # setting can make a worker kill itself.
        args = (*DRILL_WORKER, "--crash-at", crash_point) if crash_point else CHILD_ARGS
        log = open(self.workdir / f"{worker_id}.log", "ab")  # noqa: SIM115 - the child writes it; closed at stop
        self._logs.append(log)
        return spawn_worker(
            self.kafka, cfg, self.tq, args=args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

    def start(self) -> None:
        for wid in self.slots:
            self.slots[wid] = self._spawn(wid)

    def alive(self) -> int:
        procs = [*self.slots.values(), *(p for _, p in self.crashers.values())]
        return sum(1 for p in procs if p.poll() is None)

    def reap(self, *, respawn: bool) -> None:
        """Account for every exited process; restart a slot whose process ended (with the same worker id)."""
        for wid, proc in self.slots.items():
            if proc.poll() is None:
                continue
            if proc.returncode == -signal.SIGKILL and proc.pid in self.killed:
                self.ev.kills["random"] += 1
            elif proc.pid not in self.killed or proc.returncode != -signal.SIGKILL:
                self.ev.other_exits.append(f"{wid} pid {proc.pid} exited {proc.returncode}")
            if proc.pid == self.zombie:
                self.ev.zombie += f"; then exited with {proc.returncode}"
            self.killed.discard(proc.pid)
            if respawn:
                self.slots[wid] = self._spawn(wid)
        for wid, (point, proc) in list(self.crashers.items()):
            if proc.poll() is None:
                if not respawn:
                    self.ev.crash_workers_never_died.append(f"{wid} ({point})")
                continue
            if proc.returncode == -signal.SIGKILL:
                self.ev.kills[point] += 1
            else:
                self.ev.other_exits.append(f"{wid} ({point}) pid {proc.pid} exited {proc.returncode}")
            del self.crashers[wid]

    def _live_slot(self, rng: random.Random, spare: int | None) -> subprocess.Popen | None:
        live = [p for p in self.slots.values() if p.poll() is None and p.pid != spare]
        return rng.choice(live) if live else None

    def kill_random(self, rng: random.Random, *, spare: int | None) -> int | None:
        proc = self._live_slot(rng, spare)
        if proc is None:
            return None
        self.killed.add(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        return proc.pid

    def spawn_crasher(self, point: str) -> str:
        wid = f"x{len(self.crashers) + sum(self.ev.kills.values())}"
        self.crashers[wid] = (point, self._spawn(wid, crash_point=point))
        return wid

    def stop_one(self, rng: random.Random, seconds: float) -> int | None:
        proc = self._live_slot(rng, None)
        if proc is None:
            return None
        os.kill(proc.pid, signal.SIGSTOP)
        self.zombie = proc.pid
        self.ev.zombie = f"pid {proc.pid} stopped for {seconds:.0f}s (session timeout 6s, transaction timeout 10s)"
        return proc.pid

    def resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        self.ev.zombie += ", resumed"

    def stop(self) -> None:
        _terminate([*self.slots.values(), *(p for _, p in self.crashers.values())])
        for log in self._logs:
            log.close()


class Trainer:
    """The trainer process (`chaos_trainer.py`); restarted after a kill, journal shared by all of them."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, journal: Path, workdir: Path, train_step_s: float = 0.3):
        self.argv = [
            sys.executable,
            str(TRAINER),
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--prefix",
            names.prefix,
            "--journal",
            str(journal),
            "--train-step-s",
            str(train_step_s),
        ]
        self.journal, self.workdir = journal, workdir
        self.proc: subprocess.Popen | None = None

    def start(self, ray: str) -> None:
        log = open(self.workdir / "trainer.log", "ab")  # noqa: SIM115 - the child writes it
        self.proc = subprocess.Popen(
            [*self.argv, "--ray-address", ray], stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        log.close()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill_mid_step(self, *, timeout_s: float) -> int | None:
        """SIGKILL the trainer right after it began a training step; its pid, or None if it never began one."""
        deadline = time.monotonic() + timeout_s
        pid = self.proc.pid
        while time.monotonic() < deadline:
            _, lines = read_journal(self.journal)
            mine = [kind for kind, p, _ in lines if p == pid]
            if mine and mine[-1] == "begin":
                os.kill(pid, signal.SIGKILL)
                self.proc.wait()
                return pid
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        if self.proc is not None:
            _terminate([self.proc])


class Producer(threading.Thread):
    """Publishes `groups` prompt groups at `rate` groups/s; remembers each group's staging keys."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, groups: int, rate: float, seed: int, ev: DrillEvents):
        super().__init__(name="chaos-producer", daemon=True)
        self.kafka, self.names, self.groups, self.rate, self.seed, self.ev = kafka, names, groups, rate, seed, ev
        self.staged: dict[str, list[str]] = {}
        self._halt = threading.Event()
        # The first group goes out at once; the rest wait until the drill saw it trained (all is up).
        self.go = threading.Event()

    def run(self) -> None:
        pub = RolloutPublisher(self.kafka, TQStore(), self.names.receipts)
        t0 = time.monotonic()
        try:
            for i in range(self.groups):
                if self._halt.is_set():
                    return
                gid = f"{self.names.prefix}-g{i:05d}"
                rollouts = make_group(gid, i, 0, shape=SHAPE, seed=self.seed)
                self.staged[gid] = [c.staging_key for r in rollouts for c in r.receipt.manifest]
                self._publish(pub, rollouts)
                if i == 0:
                    while not self.go.wait(0.5) and not self._halt.is_set():
                        pass
                    t0 = time.monotonic()
                self._halt.wait(max(0.0, t0 + i / self.rate - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported as a failed invariant
            self.ev.producer_errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            pub.close()

    def _publish(self, pub: RolloutPublisher, rollouts, attempts: int = 5) -> None:
        # A broker dying mid-send can fail an acked send; a retry may duplicate receipts, which the
        # reassemblers dead-letter as duplicates: the group is still finalized once.
        for attempt in range(attempts):
            try:
                pub.publish(rollouts, timeout_s=60)
                return
            except Exception:
                if attempt == attempts - 1:
                    raise
                self.ev.publish_retries += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=120)
