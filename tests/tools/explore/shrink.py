"""Shrinking a failing case: the fewest faults and the smallest workload that still break the same invariant.

Delta debugging (Zeller's ddmin) over the fault plan: drop chunks of faults, keep any subset that
still fails the same way, halve the chunk size until single faults; then the workload, one step
smaller at a time (fewer prompts, reassemblers, partitions, smaller groups) while it still fails;
then the plan once more. "The same way" is sharing a kind of violation with the original (a crash
loop stays a crash loop), so a shrink never trades one bug for another. Each try is a whole run,
so the number of runs is bounded (`budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tests.tools.explore.cases import Case, run
from tests.tools.explore.world import Result


@dataclass
class Shrunk:
    case: Case
    result: Result
    runs: int


def shrink(case: Case, result: Result, *, budget: int = 60, say: Callable[[str], None] = lambda s: None) -> Shrunk:
    target = result.kinds()
    best = Shrunk(case, result, 0)

    def fails(candidate: Case) -> bool:
        if best.runs >= budget:
            return False
        best.runs += 1
        r = run(candidate)
        if r.kinds() & target:
            best.case, best.result = candidate, r
            say(f"shrink: still fails with {len(candidate.plan)} fault(s), {candidate.workload.prompts} prompt(s)")
            return True
        return False

    _ddmin(best, fails)
    progress = True
    while progress and best.runs < budget:
        progress = False
        for smaller in best.case.workload.smaller():
            if fails(best.case.with_workload(smaller)):
                progress = True
                break
    _ddmin(best, fails)
    return best


def _ddmin(best: Shrunk, fails: Callable[[Case], bool]) -> None:
    n = 2
    while len(best.case.plan) >= 1:
        plan = list(best.case.plan)
        if len(plan) == 1:
            if fails(best.case.with_plan([])):
                return
            return
        chunk = max(1, len(plan) // n)
        reduced = False
        for start in range(0, len(plan), chunk):
            complement = plan[:start] + plan[start + chunk :]
            if fails(best.case.with_plan(complement)):
                n = max(2, n - 1)
                reduced = True
                break
        if not reduced:
            if chunk == 1:
                return
            n = min(len(plan), n * 2)
