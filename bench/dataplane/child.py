"""A reassembler worker process for `python -m bench.dataplane`: the real `ReassemblerWorker` over a `TimedStore`.

Started like `rlstream reassemble --config-stdin` (its `WorkerSpec` arrives on stdin), with one
argument: a file path. On SIGUSR1 it writes there, as JSON, the store and commit timings since the
previous SIGUSR1 (then resets them); SIGTERM or SIGINT stops it.

    python -m bench.dataplane.child OUT.json < spec.json
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.dataplane.timing import CommitTimer, TimedStore
from streams.config import KafkaConfig
from streams.pids import die_with_parent
from streams.tq import TQConfig, TQStore, init_tq, set_torch_threads
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.run import child_process, read_spec


def spawn(kafka: KafkaConfig, config: ReassemblerConfig, tq: TQConfig, out: Path) -> subprocess.Popen:
    """Start this module as a worker process; its timings go to `out` on SIGUSR1."""
    _, document = child_process(kafka, config, tq)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.dataplane.child", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    proc.stdin.write(document)
    proc.stdin.close()
    return proc


def request_timings(proc: subprocess.Popen, out: Path, timeout_s: float = 60.0) -> dict:
    """Ask the worker for its timings since the previous request, and wait for them."""
    out.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"reassembler {proc.pid} wrote no timings (exit code {proc.poll()})")
        time.sleep(0.05)
    return json.loads(out.read_text())


def main() -> None:
    from workers.reassembler.worker import ReassemblerWorker

    out = Path(sys.argv[1])
    spec = read_spec(sys.stdin.buffer.read())
    set_torch_threads(spec.reassembler.torch_threads)  # as a pool's child sets it
    init_tq(spec.tq)
    stop, dump = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: dump.set())
    store, commits = TimedStore(TQStore()), CommitTimer()
    worker = ReassemblerWorker(spec.kafka, store, spec.reassembler, sensor=commits)
    try:
        while not stop.is_set():
            worker.step()
            if dump.is_set():
                dump.clear()
                tmp = out.with_suffix(".tmp")
                snapshot = {
                    "store": store.snapshot(),
                    "commits": commits.snapshot(),
                    "commit_ends": commits.commit_ends(),
                }
                tmp.write_text(json.dumps(snapshot))
                os.replace(tmp, out)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
