"""Failover benchmark: after a SIGKILL of one of two reassemblers, how soon its partitions finalize again.

The real pool (`rlstream reassemble --workers 2`) runs on a 4-partition receipts topic on a local
broker and Ray/TQ; a publisher thread offers small groups at a steady rate and a read_committed
consumer notes when each group's finalized record becomes visible. Per variant of the pool's
settings, worker p-1 is SIGKILLed `--kills` times at arbitrary moments, and the pool replaces it:

  range         eager rebalancing (every partition stops and is restored at each change), the dead
                worker restarted after 1 s: what the workers ran before this benchmark;
  cooperative   cooperative-sticky rebalancing, restarted after 1 s;
  spare         cooperative-sticky with static membership and a warm spare process that takes the
                dead worker's id at once (the default).

Recovery is the longest a group waited past a kill (counted from the kill, or from its publish if
later): detection, the rebalance, the restore and the worker's return all count.

    .venv/bin/python -m bench.failover [--quick] [--variants range,cooperative,spare] [--kills 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.common import Arrivals
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.pids import die_with_parent
from streams.tq import TQConfig, TQStore, init_tq, ray_address
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames, pipeline_topics

SHAPE = SyntheticShape(group_size=4, calls=(1, 2), prompt_len=(64, 64), answer_len=(128, 128))
VARIANTS: dict[str, list[str]] = {
    "range": ["--partition-assignment", "range", "--no-spare"],
    "cooperative": ["--partition-assignment", "cooperative-sticky", "--no-spare"],
    "spare": ["--partition-assignment", "cooperative-sticky", "--spare"],
}


@dataclass
class Kill:
    variant: str
    recovery_s: float  # longest wait of a group past the kill
    back_s: float  # from the kill until p-1 had partitions again
    stalled: int  # groups that waited more than a second past the kill


class Timeline:
    """When each group was published and when its finalized record became visible (wall-clock times)."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, rate: float):
        self.published: dict[str, float] = {}
        self._arrivals = Arrivals(kafka, names.finalized)
        self.finalized = self._arrivals.seen
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish, args=(kafka, names, rate), daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._arrivals.start()
        self._publisher.start()

    def _publish(self, kafka: KafkaConfig, names: TopicNames, rate: float) -> None:
        pub = RolloutPublisher(kafka, TQStore(), names.receipts)
        try:
            for i in range(1_000_000):
                if self._stop.is_set():
                    return
                t_next = time.time() + 1.0 / rate
                gid = f"f{i:06d}"
                pub.publish(make_group(gid, i, 1, shape=SHAPE))
                self.published[gid] = time.time()
                self._stop.wait(max(0.0, t_next - time.time()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            pub.close()

    def settled(self, until: float) -> bool:
        """Whether every group published before `until` is finalized."""
        return all(g in self.finalized for g, t in list(self.published.items()) if t < until)

    def pending(self) -> int:
        return sum(1 for g in list(self.published) if g not in self.finalized)

    def stop(self) -> None:
        self._stop.set()
        self._arrivals.stop.set()
        for t in (self._publisher, self._arrivals):
            t.join(timeout=30)

    def recovery(self, t_kill: float, until: float) -> tuple[float, int]:
        """The longest wait past `t_kill` of groups published before `until`, and how many waited over 1 s."""
        waits = [
            self.finalized.get(g, until) - max(t_pub, t_kill)
            for g, t_pub in list(self.published.items())
            if t_pub < until and self.finalized.get(g, until) > t_kill
        ]
        return max(waits, default=0.0), sum(1 for w in waits if w > 1.0)


class PoolProcess:
    """`rlstream reassemble --workers 2` (workers p-0 and p-1) as a child process logging to a file."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, flags: list[str], log: Path):
        self.log = log
        argv = [
            sys.executable, "-m", "workers.cli.main", "reassemble", "--workers", "2",
            "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix,
            "--consumer-group", f"fo.{names.prefix}", "--worker-id", "p", "--ray-address", ray_address(), *flags,
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pid_of(self, worker_id: str) -> int | None:
        """The current process of `worker_id`, from the pool's log."""
        text, pid = self.text(), None
        if started := re.search(r"started 2 reassembler processes: pids (\d+), (\d+)", text):
            pid = int(started.group(1 + int(worker_id[-1])))
        for m in re.finditer(rf"\[{worker_id}\] (?:spare pid|worker process restarted as pid) (\d+)", text):
            pid = int(m.group(1))
        return pid

    def assignments(self, worker_id: str) -> int:
        """How many non-empty assignments `worker_id`'s processes have logged."""
        return len(re.findall(rf" {worker_id} assigned \[\d", self.text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait(what: str, holds, timeout_s: float, timeline: Timeline, pool: PoolProcess) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        if timeline.error is not None:
            raise RuntimeError(f"publisher failed: {timeline.error!r}")
        if pool.proc.poll() is not None:
            raise RuntimeError(f"the pool exited with code {pool.proc.returncode}; its log: {pool.log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}; the pool's log: {pool.log}")
        time.sleep(0.02)


def _kill(variant: str, pool: PoolProcess, timeline: Timeline, args: argparse.Namespace, rng: random.Random) -> Kill:
    before = pool.assignments("p-1")
    victim = pool.pid_of("p-1")
    time.sleep(rng.uniform(0.0, 1.0))
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    _wait("p-1's successor", lambda: pool.assignments("p-1") > before, 180, timeline, pool)
    back = time.time() - t_kill
    until = t_kill + args.window
    time.sleep(max(0.0, until - time.time()))
    _wait("the window's groups", lambda: timeline.settled(until), 120, timeline, pool)
    recovery, stalled = timeline.recovery(t_kill, until)
    return Kill(variant, recovery, back, stalled)


def run_variant(kafka: KafkaConfig, variant: str, args: argparse.Namespace, workdir: Path) -> list[Kill]:
    names = TopicNames(f"fo-{uuid.uuid4().hex[:6]}")
    create_topics(kafka, pipeline_topics(names, 4))
    pool = PoolProcess(kafka, names, VARIANTS[variant], workdir / f"{variant}.log")
    timeline = Timeline(kafka, names, args.rate)
    kills: list[Kill] = []
    try:
        timeline.start()
        ready = lambda: pool.assignments("p-0") and pool.assignments("p-1")  # noqa: E731
        _wait("both workers' partitions", ready, 300, timeline, pool)
        _wait("a steady flow", lambda: len(timeline.finalized) >= 10 and timeline.pending() <= 3, 300, timeline, pool)
        if variant == "spare":
            _wait("the spare", lambda: "[spare] attached" in pool.text(), 300, timeline, pool)
        rng = random.Random(args.seed)
        for i in range(args.kills):
            kill = _kill(variant, pool, timeline, args, rng)
            kills.append(kill)
            print(
                f"  {variant:<12} kill {i + 1}/{args.kills}: recovery {kill.recovery_s:5.1f}s, "
                f"p-1 back after {kill.back_s:4.1f}s, {kill.stalled} groups waited > 1s",
                flush=True,
            )
            if variant == "spare":  # the next kill finds a spare again, as a long run would
                _wait("a new spare", lambda n=i + 2: pool.text().count("[spare] attached") >= n, 300, timeline, pool)
    finally:
        timeline.stop()
        pool.stop()
    return kills


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per variant")
    parser.add_argument("--rate", type=float, default=5.0, help="groups per second offered")
    parser.add_argument("--window", type=float, default=20.0, help="seconds watched after each kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the default settings only, one kill")
    args = parser.parse_args()
    if args.quick:
        args.variants, args.kills = "spare", 1
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variant(s) {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


def main() -> None:
    args = _args()
    # A SIGTERM unwinds like Ctrl-C, so the broker, Ray and the pool this run started are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    load = os.getloadavg()[0]
    kills: list[Kill] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        broker = stack.enter_context(LocalBroker(BrokerConfig(data_dir=tmp / "broker")))
        kafka = KafkaConfig(broker.bootstrap_servers)
        stack.callback(init_tq(TQConfig(num_cpus=4)).close)
        print(f"broker {kafka.bootstrap_servers}; 2 workers, 4 partitions, {args.rate:g} groups/s offered", flush=True)
        for variant in args.variants:
            print(f"variant {variant}: rlstream reassemble --workers 2 {' '.join(VARIANTS[variant])}", flush=True)
            kills += run_variant(kafka, variant, args, tmp)
    print("\nfailover: longest wait of a group past a SIGKILL of 1 of 2 workers (target < 10 s)")
    print(f"{'variant':<12} {'kills':>5} {'recovery s: max':>16} {'median':>7} {'back s: median':>15} {'stalled':>8}")
    for variant in args.variants:
        ks = [k for k in kills if k.variant == variant]
        rec = [k.recovery_s for k in ks]
        print(
            f"{variant:<12} {len(ks):>5} {max(rec):>16.1f} {statistics.median(rec):>7.1f} "
            f"{statistics.median(k.back_s for k in ks):>15.1f} {sum(k.stalled for k in ks):>8}"
        )
    print(f"load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
