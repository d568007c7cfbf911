"""The chaos drill (`make chaos`) at a small scale: it must pass, and its audit must really have counted.

It runs `python -m tests.tools.chaos` as a program, as `make chaos` does, attached to the session's Ray, with its
own one-broker cluster (the broker is killed and restarted on its data, a full outage, and frozen
past the transaction timeout as the lost coordinator of a worker's open transaction, which that
worker must ride out; `make chaos` does it to one of three): 80 groups, five reassembler kills (one
at each crash point and two pool children at random instants, each taken over by the spare), a
zombie, a worker frozen at its put that builds on after waking, and a trainer killed mid-step; with
groups lost to the gate, the trainer's version must keep moving.
"""

import re
import signal
import subprocess
import sys
from pathlib import Path

from streams.tq import ray_address

ROOT = Path(__file__).resolve().parents[2]


def _figure(out: str, name: str) -> str:
    match = re.search(rf"^  {re.escape(name)}\s+(.*)$", out, re.M)
    assert match, f"no figure {name!r} in:\n{out}"
    return match.group(1)


def test_a_short_chaos_drill_loses_nothing_duplicates_nothing_and_leaves_tq_empty(tq_session):
    args = ["--groups", "80", "--rate", "8", "--kills", "5", "--workers", "2", "--partitions", "4"]
    args += ["--brokers", "1", "--broker-down-s", "5", "--zombie-s", "10", "--seed", "11", "--timeout", "300"]
    # With the gate's staleness bound at 0 the producer runs at most one batch ahead of the trainer:
    # the 8 groups lost (every rollout failed) stall it for good unless losses give capacity back.
    args += ["--frozen-build-s", "8", "--coordinator-freeze-s", "15", "--lost-share", "0.1", "--gate-staleness", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tools.chaos", *args, "--ray-address", ray_address()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the drill stops its cluster and processes on SIGTERM
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:] + err[-3000:]
    assert "invariants: all hold" in out
    assert re.search(r"^\[\s*\d+s\] produced \d+/80", out, re.M), "no progress line"
    assert _figure(out, "groups produced") == "80"
    failed = re.fullmatch(
        r"(\d+) produced, (\d+) dead-lettered", _figure(out, "all rollouts failed (lost to the gate)")
    )
    assert failed and failed[1] == failed[2] and int(failed[1]) >= 4, _figure(
        out, "all rollouts failed (lost to the gate)"
    )
    good = str(80 - int(failed[1]))
    assert _figure(out, "distinct finalized groups") == good
    assert _figure(out, "finalized records (read_committed)") == good
    assert (_figure(out, "lost"), _figure(out, "duplicated")) == ("0", "0")
    assert _figure(out, "trained exactly once") == good
    assert (_figure(out, "TQ staging keys left"), _figure(out, "TQ train rows left")) == ("0", "0")
    kills = _figure(out, "reassembler SIGKILLs")
    assert all(kind in kills for kind in ("after_tq_put", "before_commit", "after_commit", "random 2")), kills
    assert _figure(out, "spare takeovers").startswith("2 (w-"), _figure(out, "spare takeovers")
    assert _figure(out, "workers fenced (exit 78)") == "0"
    assert _figure(out, "pool size at the end") == "2 of 2"
    assert _figure(out, "groups trained on overwritten rows") == "0"
    assert "then built 8s" in _figure(out, "frozen builder")
    assert "frozen 15s" in _figure(out, "coordinator")
    assert int(_figure(out, "transaction timeouts ridden out")) >= 1
    version = re.fullmatch(r"(\d+) \(floor (\d+)\)", _figure(out, "trainer version"))
    assert version and int(version[1]) >= int(version[2]) >= 1, _figure(out, "trainer version")
    assert int(kills.split()[0]) >= 5
    assert "resumed" in _figure(out, "zombie")
    assert "restarted on its data" in _figure(out, "broker")
    assert _figure(out, "trainer kills").startswith("1 ")
