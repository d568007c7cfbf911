"""What the chaos drill runs and disrupts: reassembler processes, the trainer process and the producer thread.

Every process here is started by the drill, remembered by its `Popen`, signalled by its pid and
nothing else, and gets SIGTERM from the kernel if the drill itself dies (`die_with_parent`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

from streams.config import KafkaConfig
from streams.pids import die_with_parent
from streams.tq import TQConfig, TQStore
from tests.tools.chaos.check import DrillEvents, read_journal
from tests.tools.chaos.trainer import rows_digest
from tests.tools.faults import CRASH_POINTS
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.pool import FENCED_EXIT, SPARE_MIN_UPTIME_S, Pool, SpareSupply
from workers.reassembler.run import promote, spawn_worker
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames

# The drill worker, run from the repository root (the cwd of every drill).
DRILL_WORKER = ("-m", "tests.tools.drill_worker")

SHAPE = SyntheticShape(group_size=8, calls=(1, 3), prompt_len=(4, 12), answer_len=(2, 16), observation_len=(1, 6))
FAILING = dataclasses.replace(SHAPE, failure_rate=1.0)  # every rollout failed: a dead-lettered group
# The trainer's id on the version topic, which the producer's admission gate follows.
TRAINER_ID = "chaos-trainer"
TRAINER = ("-m", "tests.tools.chaos.trainer")
STOP_GRACE_S = 60.0


def process_state(pid: int) -> str:
    """The state letter of a process (R, S, T for stopped, ...) from /proc, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _java_hash(text: str) -> int:
    """Java's `String.hashCode`, over UTF-16 code units, as an unsigned 32-bit int."""
    data = text.encode("utf-16-be")
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h


def coordinator_of(kafka: KafkaConfig, transactional_id: str) -> int:
    """The broker id leading the transaction-state partition of `transactional_id`, its coordinator.

    Kafka places a transactional id at `abs(id.hashCode()) % partitions` of __transaction_state
    (`Utils.abs` masks the sign bit).
    """
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka.admin())
    md = admin.list_topics("__transaction_state", timeout=10).topics["__transaction_state"]
    partition = (_java_hash(transactional_id) & 0x7FFFFFFF) % len(md.partitions)
    return md.partitions[partition].leader


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
    """A real pool of reassembler processes (`workers.reassembler.pool.Pool`: worker ids w-0..w-N-1 as
    static members, a warm spare, restarts) run in a thread of the drill, plus crash and freeze workers
    (`tests/tools/drill_worker.py`) that join the same consumer group with ids of their own."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, tq: TQConfig, n: int, workdir: Path, ev: DrillEvents):
        self.kafka, self.names, self.tq, self.workdir, self.ev = kafka, names, tq, workdir, ev
        self.group = f"reassemblers.{names.prefix}"
        self.n = n
        # Stable ids and a spare: the pool's children are static members, as `rlstream reassemble
        # --workers N --worker-id w` runs them, so the spare takes a dead child's partitions at once.
        self.base = ReassemblerConfig(
            prefix=names.prefix, worker_id="w", consumer_group=self.group, static_membership=True
        )
        self.extra: dict[str, tuple[str, subprocess.Popen]] = {}  # crash and freeze workers: id -> (kind, proc)
        self.killed: dict[int, subprocess.Popen] = {}  # pool children this drill SIGKILLed, by pid
        self.deaths: dict[str, int] = {}  # kills per worker id
        self.zombie: int | None = None
        self._logs: list = []
        self._lock = threading.Lock()
        self.pool = Pool(
            log=self._pool_line,
            warn=self._pool_line,
            stop_grace_s=STOP_GRACE_S,
            spawn=self._spawn_child,
            spares=SpareSupply(spawn=self._spawn_spare, promote=lambda proc, wid: promote(proc, wid)),
        )
        self._thread = threading.Thread(target=self._run_pool, name="chaos-pool", daemon=True)

    def _log(self, name: str):
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child writes it; closed at stop
        self._logs.append(log)
        return log

    def _spawn_child(self, worker_id: str) -> subprocess.Popen:
        config = msgspec.structs.replace(self.base, worker_id=worker_id)
        log = self._log(worker_id)
        return spawn_worker(
            self.kafka, config, self.tq, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

    def _spawn_spare(self) -> subprocess.Popen:
        config = msgspec.structs.replace(self.base, worker_id="w-spare")
        log = self._log("spare")
        return spawn_worker(
            self.kafka, config, self.tq, as_spare=True, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

    def _pool_line(self, line: str) -> None:
        """The pool's own account of every exit, restart and promotion (what `rlstream reassemble` logs)."""
        with self._lock:
            self.ev.pool_lines.append(line)
            if " took over" in line and "spare pid" in line:
                self.ev.spare_takeovers.append(line.split("]", 1)[0].lstrip("["))
            if f"exit code {FENCED_EXIT}" in line:
                self.ev.fenced_exits.append(line)

    def _run_pool(self) -> None:
        self.pool.wait()

    def start(self) -> None:
        self.pool.keep_spare()  # before the workers, as run_pool does
        for i in range(self.n):
            wid = f"w-{i}"
            self.pool.add(wid, self._spawn_child(wid))
        self._thread.start()

    def children(self) -> dict[str, subprocess.Popen]:
        return {wid: p for wid, p in list(self.pool.procs.items()) if p.poll() is None}

    def alive(self) -> int:
        return len(self.children()) + sum(1 for _, p in self.extra.values() if p.poll() is None)

    def spare_ready(self) -> bool:
        proc = self.pool.spare_proc
        return proc is not None and proc.poll() is None

    def reap(self, *, respawn: bool) -> None:
        """Account for killed pool children and exited crash workers (the pool restarts its own)."""
        for pid, proc in list(self.killed.items()):
            if proc.poll() is not None:
                del self.killed[pid]
                if proc.returncode == -signal.SIGKILL:
                    self.ev.kills["random"] += 1
                else:
                    self.ev.other_exits.append(f"pid {pid} exited {proc.returncode}")
        for wid, (kind, proc) in list(self.extra.items()):
            lives_on = kind in ("frozen_builder", "commit_holder")  # workers once woken or committed
            if proc.poll() is None:
                if not respawn and not lives_on:
                    self.ev.crash_workers_never_died.append(f"{wid} ({kind})")
                continue
            if kind in CRASH_POINTS and proc.returncode == -signal.SIGKILL:
                self.ev.kills[kind] += 1
            elif proc.returncode == FENCED_EXIT:
                self.ev.fenced_exits.append(f"{wid} ({kind}) pid {proc.pid} exited {FENCED_EXIT}")
            elif not lives_on:
                self.ev.other_exits.append(f"{wid} ({kind}) pid {proc.pid} exited {proc.returncode}")
            del self.extra[wid]

    def kill_random(self, rng: random.Random, *, spare: int | None) -> int | None:
        """SIGKILL a live pool child (not the zombie), one whose worker id died least so far, so that
        the spare takes over one worker after another; the pool hands the id to the spare."""
        # A child that crashed soon after its start is a crash loop to the pool, which then waits out
        # a delay instead of using its spare: only children up for a while are killed.
        now = time.monotonic()
        live = {
            wid: p
            for wid, p in self.children().items()
            if p.pid != spare and now - self.pool.started.get(wid, now) >= SPARE_MIN_UPTIME_S
        }
        if not live:
            return None
        fewest = min(self.deaths.get(wid, 0) for wid in live)
        wid = rng.choice(sorted(w for w in live if self.deaths.get(w, 0) == fewest))
        proc = live[wid]
        self.deaths[wid] = self.deaths.get(wid, 0) + 1
        self.killed[proc.pid] = proc
        os.kill(proc.pid, signal.SIGKILL)
        return proc.pid

    def spawn_crasher(self, point: str) -> str:
        wid = f"x{len(self.extra) + sum(self.ev.kills.values())}"
        config = msgspec.structs.replace(self.base, worker_id=wid, static_membership=False)
        proc = spawn_worker(
            self.kafka,
            config,
            self.tq,
            args=(*DRILL_WORKER, "--crash-at", point),
            stdout=self._log(wid),
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        self.extra[wid] = (point, proc)
        return wid

    def _spawn_extra(self, letter: str, kind: str, fault_args: tuple[str, ...]) -> tuple[str, subprocess.Popen]:
        wid = f"{letter}{len(self.extra)}"
        config = msgspec.structs.replace(self.base, worker_id=wid, static_membership=False)
        proc = spawn_worker(
            self.kafka, config, self.tq, args=(*DRILL_WORKER, *fault_args), stdout=self._log(wid),
            stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )  # fmt: skip
        self.extra[wid] = (kind, proc)
        return wid, proc

    def spawn_frozen_builder(self, then_build_s: float) -> tuple[str, subprocess.Popen]:
        """A worker that freezes itself (SIGSTOP) at its first put and, once woken, builds `then_build_s` more."""
        return self._spawn_extra("z", "frozen_builder", ("--freeze-before-put", "--then-build-s", str(then_build_s)))

    def spawn_commit_holder(self, hold_s: float) -> tuple[str, subprocess.Popen]:
        """A worker that holds its first transaction open `hold_s` before committing (and says so in its
        log, `faults.HOLDING`), then goes on as a worker."""
        return self._spawn_extra("c", "commit_holder", ("--slow-commit-s", str(hold_s)))

    def stop_one(self, rng: random.Random, seconds: float) -> int | None:
        live = list(self.children().values())
        if not live:
            return None
        proc = rng.choice(live)
        os.kill(proc.pid, signal.SIGSTOP)
        self.zombie = proc.pid
        self.ev.zombie = f"pid {proc.pid} stopped for {seconds:.0f}s (session timeout 6s, transaction timeout 10s)"
        return proc.pid

    def resume(self, pid: int) -> None:
        """SIGCONT the zombie."""
        if self.wake(pid):
            self.ev.zombie += ", resumed"

    @staticmethod
    def wake(pid: int) -> bool:
        """SIGCONT a process; False if it is gone."""
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

    def transactional_id(self, worker_id: str) -> str:
        return msgspec.structs.replace(self.base, worker_id=worker_id).transactional_id

    def stop(self) -> None:
        self.ev.pool_size_at_end = len(self.children())
        self.pool.forward(signal.SIGTERM)
        self._thread.join(timeout=STOP_GRACE_S + 30)
        _terminate([p for _, p in self.extra.values()])
        for log in self._logs:
            log.close()


class Trainer:
    """The trainer process (`tests/tools/chaos/trainer.py`); restarted after a kill, journal shared by all of them."""

    def __init__(
        self,
        kafka: KafkaConfig,
        names: TopicNames,
        journal: Path,
        workdir: Path,
        train_step_s: float = 0.3,
        batch_groups: int = 8,
    ):
        self.batch_groups = batch_groups
        self.argv = [
            sys.executable,
            *TRAINER,
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--prefix",
            names.prefix,
            "--journal",
            str(journal),
            "--train-step-s",
            str(train_step_s),
            "--batch-groups",
            str(batch_groups),
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
    """Publishes `groups` prompt groups at `rate` groups/s, each admitted by the gate following the
    trainer's version; `lost_share` of them have every rollout failed, which the reassemblers
    dead-letter (lost to the gate, which must give their capacity back). Remembers each group's
    staging keys and the digest of its rows."""

    def __init__(
        self,
        kafka: KafkaConfig,
        names: TopicNames,
        groups: int,
        rate: float,
        seed: int,
        ev: DrillEvents,
        *,
        lost_share: float = 0.0,
        max_staleness: int = 1,
    ):
        super().__init__(name="chaos-producer", daemon=True)
        self.kafka, self.names, self.groups, self.rate, self.seed, self.ev = kafka, names, groups, rate, seed, ev
        self.lost_share, self.max_staleness = lost_share, max_staleness
        self.staged: dict[str, list[str]] = {}
        self.poisoned: set[str] = set()  # groups whose rollouts all failed: dead-lettered, never trained
        # Per group, the digest of the token ids of the rows its staged rollouts make (what the
        # trainer must read, whoever finalized it).
        self.digests: dict[str, str] = {}
        self._halt = threading.Event()
        # The first group goes out at once; the rest wait until the drill saw it trained (all is up).
        self.go = threading.Event()

    def run(self) -> None:
        pub = RolloutPublisher(self.kafka, TQStore(), self.names.receipts)
        gate = AdmissionGate(self.kafka, self.names, max_staleness=self.max_staleness, trainer_id=TRAINER_ID)
        lots = random.Random(self.seed)
        t0 = time.monotonic()
        try:
            for i in range(self.groups):
                while not gate.acquire(1, timeout=0.5):
                    if self._halt.is_set():
                        return
                gid = f"{self.names.prefix}-g{i:05d}"
                if lots.random() < self.lost_share:
                    rollouts = make_group(gid, i, 0, shape=FAILING, seed=self.seed)
                    self.poisoned.add(gid)
                else:
                    rollouts = make_group(gid, i, 0, shape=SHAPE, seed=self.seed)
                    self.digests[gid] = rows_digest([torch.cat([s["token_ids"] for s in r.segments]) for r in rollouts])
                self.staged[gid] = [c.staging_key for r in rollouts for c in r.receipt.manifest]
                self._publish(pub, rollouts)
                # Published is accepted: what becomes of it (dead-lettered, evicted) the gate learns itself.
                gate.on_finished(accepted=True)
                if i == 0:
                    while not self.go.wait(0.5) and not self._halt.is_set():
                        pass
                    t0 = time.monotonic()
                self._halt.wait(max(0.0, t0 + i / self.rate - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported as a failed invariant
            self.ev.producer_errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.ev.gate = gate.counts()
            gate.close()
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
