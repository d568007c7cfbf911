"""py-spy profiles of `python -m bench.dataplane`'s phases, per process, and their summary.

`Profiler.phase(name, pids)` runs one `py-spy record --format raw` per process (this one, the
reassembler children, the TQ controller and storage units, the Ray RPC actor) for exactly the
phase's measurement, writing `DIR/<phase>/<role>.txt` (collapsed stacks; speedscope opens them).
Client processes are sampled with `--idle`, so time blocked on a socket shows as the frame waiting;
Ray actors without it, so their samples are CPU time. `summarize` prints, per phase and process,
the top frames by self time and by inclusive time, in ms per group. Re-summarize a directory with

    .venv/bin/python -m bench.dataplane.profile DIR [--top 8]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil

RATE = 50  # samples/s: low enough not to crowd two loaded cores, enough for phases of seconds
_LINE = re.compile(r":\d+\)$")


def py_spy() -> str | None:
    """The py-spy next to this interpreter (Ray installs it), else one on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    if local.exists():
        return str(local)
    found = subprocess.run(["which", "py-spy"], capture_output=True, text=True).stdout.strip()
    return found or None


def ray_actor_pids() -> dict[str, int]:
    """The Ray worker processes of this driver's Ray instance that host an actor, by role name."""
    import ray

    node = ray._private.worker._global_node
    roots = [i.process.pid for i in node.all_processes.get("raylet", []) if i.process is not None]
    found: dict[str, int] = {}
    for root in roots:
        for child in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = (child.cmdline() or [""])[0]
                if title.startswith("ray::") and not any(w in title for w in ("IDLE", "Dashboard")):
                    found[f"{title[5:].split('.')[0]}-{child.pid}"] = child.pid
    return found


class Profiler:
    """Samples processes with py-spy for the length of a `phase`; files under `out_dir/<phase>/`."""

    def __init__(self, out_dir: Path, rate: int = RATE):
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy not found (it comes with ray[default]; pip install py-spy)")
        self.exe, self.out_dir, self.rate = exe, out_dir, rate
        self.groups: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str, groups: int, clients: dict[str, int]) -> Iterator[None]:
        """Profile `clients` (with idle samples) and every Ray actor process while the block runs."""
        folder = self.out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        self.groups[name] = groups
        targets = [(role, pid, True) for role, pid in clients.items()]
        targets += [(role, pid, False) for role, pid in ray_actor_pids().items()]
        procs = [self._start(folder / f"{role}.txt", pid, idle) for role, pid, idle in targets]
        try:
            yield
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)  # py-spy writes its file on SIGINT
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()

    def _start(self, out: Path, pid: int, idle: bool) -> subprocess.Popen:
        argv = [self.exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(self.rate)]
        argv += ["--nonblocking", "--threads", "-o", str(out)] + (["--idle"] if idle else [])
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame(f: str) -> str:
    """A frame without its line number, so one function's lines add up."""
    return _LINE.sub(")", f.strip())


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(_frame(f) for f in stack.split(";"))] += int(count)
    return stacks


# Leaf frames of a thread that waits: blocked in C (Ray's main loop, zmq poll, a lock), not working.
IDLE = re.compile(
    r"^(Condition\.wait|Event\.wait|\w*Selector\.select|Thread\.join|Future\.result|Worker\.main_loop"
    r"|listen_error_messages|GarbageCollectorThread\.run|Poller\.poll|sleep|wait|select|poll) \("
)
# Leaf frames that call into librdkafka: a consume or flush waits for the broker, in C.
KAFKA_LEAF = re.compile(r"\((streams/(producer|consumer)|workers/trainer/intake|workers/reassembler/worker)\.py\)$")
# What a working sample is spent on: the innermost frame that matches names its category.
CATEGORIES = (
    ("serialization", re.compile(r"serial_utils|pickle|serializ|msgpack")),
    ("zmq send/recv", re.compile(r"zmq")),
    ("nested tensor / tensordict", re.compile(r"torch/nested|tensordict/|torch/")),
    ("TQ controller & metadata", re.compile(r"transfer_queue/(controller|metadata|sampler)")),
    ("TQ storage unit", re.compile(r"transfer_queue/storage/simple_storage")),
    ("TQ client & managers", re.compile(r"transfer_queue/")),
    ("Ray core", re.compile(r"ray/")),
    ("Kafka client", re.compile(r"confluent_kafka|streams/")),
    ("rlstream logic", re.compile(r"schemas/|workers/")),
    ("asyncio", re.compile(r"asyncio/")),
)
IDLE_CATEGORY = "idle"


def category(stack: tuple[str, ...]) -> str:
    if len(stack) == 1 or IDLE.match(stack[-1]):
        return IDLE_CATEGORY
    if KAFKA_LEAF.search(stack[-1]):
        return "Kafka (librdkafka, incl. waits)"
    for frame in reversed(stack):
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
    return "other"


def top_frames(stacks: Counter[tuple[str, ...]], top: int) -> tuple[Counter[str], list, int]:
    """Samples per category, the top working frames by self samples, and the total samples."""
    cats: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, n in stacks.items():
        cat = category(stack)
        cats[cat] += n
        if cat != IDLE_CATEGORY:
            own[stack[-1]] += n
    return cats, own.most_common(top), sum(stacks.values())


def summarize(out_dir: Path, top: int = 8, rate: int = RATE, groups: dict[str, int] | None = None) -> None:
    """Per phase and process: ms per group in each category, then the top working frames (self time)."""
    for folder in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        n = (groups or {}).get(folder.name) or _groups_of(folder.name)
        print(f"\n=== profile {folder.name}: ms per group ({n} groups, {rate} samples/s, all threads)")
        for path in sorted(folder.glob("*.txt")):
            cats, own, total = top_frames(read_stacks(path), top)
            if not total:
                continue
            ms = 1000 / rate / n
            print(f"--- {path.stem}: " + ", ".join(f"{c} {v * ms:.1f}" for c, v in cats.most_common()))
            for frame, samples in own:
                print(f"  {samples * ms:8.2f}  {frame[:140]}")


def _groups_of(phase: str) -> int:
    """The group count written into the phase's folder name (`raw@8-64g`), else 1."""
    m = re.search(r"-(\d+)g$", phase)
    return int(m.group(1)) if m else 1


def main() -> None:
    parser = argparse.ArgumentParser(description="summarize python -m bench.dataplane --profile output")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--rate", type=int, default=RATE)
    args = parser.parse_args()
    summarize(args.dir, args.top, args.rate)


if __name__ == "__main__":
    main()
