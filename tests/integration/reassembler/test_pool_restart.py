"""`rlstream reassemble --workers 2` supervises its children: one SIGKILLed is replaced under the same
worker id by the pool's warm spare (logged at WARNING), and the pool keeps finalizing every group
exactly once.

The pool is the real command, on the session's broker and Ray/TQ.
"""

import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from streams.tq import ray_address
from tests.integration.helpers import finalized_records, publish_groups, setup_topics


def _wait_for(what: str, holds, log: Path, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = holds()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}:\n{log.read_text()}"
        time.sleep(0.5)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_killed_child_is_replaced_by_the_spare_under_its_worker_id_and_groups_keep_finalizing(
    kafka, tq_store, unique, tmp_path
):
    names = setup_topics(kafka, f"pool-{unique}", partitions=4)
    log = tmp_path / "pool.log"
    argv = [
        sys.executable, "-m", "workers.cli.main", "reassemble", "--workers", "2",
        "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix,
        "--consumer-group", f"pool.{unique}", "--worker-id", "p", "--ray-address", ray_address(),
    ]  # fmt: skip
    with open(log, "wb") as out:
        pool = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        started = _wait_for(
            "the pool's children",
            lambda: re.search(r"started 2 reassembler processes: pids (\d+), (\d+)", log.read_text()),
            log,
        )
        victim = int(started.group(1))  # worker p-0
        groups = publish_groups(kafka, tq_store, names, 12, prefix="before-")
        _wait_for("the first groups", lambda: len(finalized_records(kafka, names)) >= 12, log)

        pool_pid = pool.pid
        assert _parent(victim) == pool_pid
        spare = int(
            _wait_for(
                "the spare", lambda: re.search(r"spare worker process started as pid (\d+)", log.read_text()), log
            ).group(1)
        )
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        restarted = _wait_for(
            "p-0's restart",
            lambda: re.search(r"\[p-0\] spare pid (\d+) took over \(restart 1\)", log.read_text()),
            log,
        )
        successor = int(restarted.group(1))
        assert successor == spare
        assert _parent(successor) == pool_pid  # running, and the pool's child
        text = log.read_text()
        assert re.search(
            rf"WARNING rlstream\.reassemble \[p-0\] worker process {victim} died with exit code 137 after "
            r"[\d.]+s; handing its id to the spare \(restart 1\)",
            text,
        ), text

        # The successor joins the consumer group under the same id and takes partitions back.
        after_kill = text.index("took over (restart 1)")
        _wait_for(
            "the successor's partitions",
            lambda: (
                "[p-0] consuming " in log.read_text()[after_kill:] and " p-0 assigned [" in log.read_text()[after_kill:]
            ),
            log,
        )
        groups.update(publish_groups(kafka, tq_store, names, 12, seed=1, prefix="after-"))
        _wait_for("every group", lambda: {r.group_id for r in finalized_records(kafka, names)} >= set(groups), log, 240)
        counts = Counter(r.group_id for r in finalized_records(kafka, names))
        assert set(counts) == set(groups) and max(counts.values()) == 1
        text = log.read_text()
        assert text.count("[p-0] consuming ") == 2 and text.count("[p-1] consuming ") == 1
    finally:
        pool.send_signal(signal.SIGTERM)
        code = pool.wait(timeout=90)
    text = log.read_text()
    assert code == 0, text
    assert "worker processes restarted 1 time(s): p-0 1" in text


def test_two_workers_killed_in_turn_are_each_replaced_by_a_spare(kafka, unique, tmp_path):
    """The spare is not only for the first death: after a promotion the pool's new spare takes the next one."""
    names = setup_topics(kafka, f"pool2-{unique}", partitions=2)
    log = tmp_path / "pool.log"
    argv = [
        sys.executable, "-m", "workers.cli.main", "reassemble", "--workers", "2",
        "--bootstrap-servers", kafka.bootstrap_servers, "--prefix", names.prefix,
        "--consumer-group", f"pool2.{unique}", "--worker-id", "q", "--ray-address", ray_address(),
    ]  # fmt: skip
    spares = re.compile(r"spare worker process started as pid (\d+)")
    with open(log, "wb") as out:
        pool = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        started = _wait_for(
            "the pool's children",
            lambda: re.search(r"started 2 reassembler processes: pids (\d+), (\d+)", log.read_text()),
            log,
        )
        for n, (worker, victim) in enumerate((("q-0", started.group(1)), ("q-1", started.group(2))), start=1):
            spare = _wait_for(f"spare {n}", lambda n=n: spares.findall(log.read_text())[n - 1 : n], log)[0]
            subprocess.run(["kill", "-KILL", victim], check=True)
            took = _wait_for(
                f"{worker}'s takeover",
                lambda w=worker: re.search(rf"\[{w}\] spare pid (\d+) took over \(restart 1\)", log.read_text()),
                log,
            )
            assert took.group(1) == spare
            assert _parent(int(spare)) == pool.pid
        text = log.read_text()
        assert "restarting it in" not in text, text  # neither death waited for a cold restart
    finally:
        pool.send_signal(signal.SIGTERM)
        code = pool.wait(timeout=90)
    text = log.read_text()
    assert code == 0, text
    assert "worker processes restarted 2 time(s): q-0 1, q-1 1" in text, text
