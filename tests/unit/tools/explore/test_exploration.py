"""The explorer in the suite: a fixed set of seeds over every fault mix breaks no invariant, every seed of a
bug it found once passes now, a seed replays exactly, and a shrink keeps only the faults a failure needs.

The seeds run as `python -m tests.tools.explore` does (a child process, PYTHONHASHSEED=0), so a seed
here is the same run as `make explore` and a seed file's replay. `make explore` runs many more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.tools.explore.cases import Case, run
from tests.tools.explore.faults import Fault
from tests.tools.explore.shrink import Shrunk, _ddmin

ROOT = Path(__file__).resolve().parents[4]
SEEDS = ROOT / "tests" / "explore_seeds"
# Seeds of the short exploration: every mix in turn (faults.MIXES), about 0.2 s each.
SHORT = ["--seeds", "40", "--first", "1000"]


def _explore(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "tests.tools.explore", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_short_exploration_breaks_no_invariant(tmp_path):
    done = _explore(*SHORT, "--out", str(tmp_path), "--shrink-runs", "20")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "40 seed(s) ran, 0 failed" in done.stdout


def test_every_seed_of_a_bug_found_once_passes_now():
    files = sorted(SEEDS.glob("*.json"))
    assert files, f"no seed files in {SEEDS}"
    done = _explore("--replay", str(SEEDS))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(files)} seed file(s) ran, 0 failed" in done.stdout


def test_a_seed_replays_exactly():
    case = Case.draw(7, "all")
    first, again = run(case), run(case)
    assert first.points > 100
    assert (first.digest, first.events, first.violations) == (again.digest, again.events, again.violations)


def test_a_shrink_keeps_only_the_faults_the_failure_needs():
    needed = {Fault("crash", "w0", 1.0, "tq.kv_batch_put.begin"), Fault("down", at=3.0, seconds=40.0)}
    noise = [Fault("slow", "trainer", float(t), "kafka.consumer.consume.begin", 1.0) for t in range(6)]
    plan = sorted([*needed, *noise], key=lambda f: f.at)
    case = Case.draw(0, "crash").with_plan(plan)
    best = Shrunk(case, None, 0)  # type: ignore[arg-type]

    def fails(candidate: Case) -> bool:
        best.runs += 1
        if needed <= set(candidate.plan):
            best.case = candidate
            return True
        return False

    _ddmin(best, fails)
    assert set(best.case.plan) == needed
    assert best.runs < 30


def test_every_revert_of_an_issue_30_fix_still_applies():
    # REVERTS.md's demonstrations undo each fix in a copy of the tree; a fix that moved on must take its patch along.
    done = subprocess.run(
        [sys.executable, "-m", "tests.tools.explore.reverted", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": applies") == len(list((ROOT / "tests/tools/explore/reverts").glob("*.patch")))
