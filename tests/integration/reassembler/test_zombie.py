"""A zombie worker against the real broker and TQ: frozen just before its put, it must not write on waking,
however long it goes on building after it wakes."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from streams.consumer import wait_until
from streams.tq import TRAIN, TQConfig, ray_address
from tests.integration.helpers import drive, finalized_records, publish_groups, setup_topics
from tests.tools.drill_worker import spawn_drill_worker
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker


def _state(pid: int) -> str:
    # /proc/<pid>/stat: "pid (comm) S ..." - the state letter follows the closing parenthesis.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# 0: it puts as soon as it wakes. 7: it wakes and goes on building for longer than a session timeout
# first, which a guard that refused puts only for a while after the freeze let through.
@pytest.mark.parametrize("then_build_s", [0.0, 7.0])
def test_a_worker_frozen_before_its_put_does_not_write_once_a_successor_committed(
    kafka, tq_store, unique, tmp_path, then_build_s
):
    names = setup_topics(kafka, f"zombie-{unique}", partitions=1)
    group = f"reassemblers.zombie.{unique}"
    config = ReassemblerConfig(prefix=names.prefix, worker_id="zombie", consumer_group=group, session_timeout_ms=6000)
    log_path = tmp_path / "zombie.log"
    faults = ["--freeze-before-put", "--then-build-s", str(then_build_s)]
    with open(log_path, "wb") as log:
        zombie = spawn_drill_worker(
            kafka, config, TQConfig(address=ray_address()), faults=faults, stdout=log, stderr=subprocess.STDOUT
        )
    successor = None
    try:
        groups = publish_groups(kafka, tq_store, names, 1, prefix=f"{unique}-")
        (gid,) = groups
        sample_ids = [f"{gid}_g{i}" for i in range(8)]
        # It read the group, fetched and built its rows, and froze just before putting them.
        wait_until(lambda: _state(zombie.pid) == "T", timeout_s=90, what="the worker to freeze before its put")
        successor = ReassemblerWorker(
            kafka, tq_store, ReassemblerConfig(prefix=names.prefix, worker_id="successor", consumer_group=group)
        )
        drive([successor], lambda: len(finalized_records(kafka, names)) == 1, timeout_s=90)
        # The trainer trains on the successor's rows and releases them.
        assert tq_store.present(TRAIN, sample_ids) == set(sample_ids)
        tq_store.clear(TRAIN, sample_ids)

        os.kill(zombie.pid, signal.SIGCONT)
        # Woken, it either refuses the put or puts and then fails its transaction (fenced): wait for either.
        deadline = time.monotonic() + 60
        while not any(line in log_path.read_bytes() for line in (b"not putting the rows", b"transaction failed")):
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            successor.step()
        assert tq_store.present(TRAIN, sample_ids) == set(), "the zombie recreated released rows"
        assert b"not putting the rows of group" in log_path.read_bytes()
        assert [r.group_id for r in finalized_records(kafka, names)] == [gid]
    finally:
        if zombie.poll() is None:
            os.kill(zombie.pid, signal.SIGCONT)
            zombie.terminate()
            try:
                zombie.wait(30)
            except subprocess.TimeoutExpired:
                zombie.kill()
                zombie.wait()
        if successor is not None:
            successor.close()
