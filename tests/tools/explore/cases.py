"""A case: everything one run depends on (seed, workload, fault plan, switching rate), as data a file keeps.

`Case.draw(seed, mix)` derives a case from a seed and a fault mix; `run(case)` runs it in a fresh
directory and returns its `Result`; `save`/`load` write and read the replayable JSON seed files (the
case, and for a failure what it broke and its history), which `--replay` runs again.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tests.tools.explore.faults import Fault, draw_plan
from tests.tools.explore.workload import Workload, random_workload
from tests.tools.explore.world import Result, World

FORMAT = 1
_GROUP = re.compile(r"p\d{3}(?:~r\d+)?")


@dataclass(frozen=True)
class Case:
    seed: int
    mix: str
    workload: Workload
    plan: tuple[Fault, ...]
    switch: float = 0.2

    @staticmethod
    def draw(seed: int, mix: str) -> Case:
        rng = random.Random(f"case/{seed}/{mix}")
        workload = random_workload(rng)
        roles = [f"w{i}" for i in range(workload.reassemblers)] + ["trainer", "rollout"]
        plan = draw_plan(rng, roles, mix, horizon_s=workload.prompts * workload.generate_s)
        case = Case(seed, mix, workload, tuple(plan), rng.choice((0.05, 0.2, 0.5)))
        # Drawn apart, so the cases of seeds drawn before it existed stay what they were.
        extra = random.Random(f"case/{seed}/{mix}/finalized")
        if workload.reassemblers > 1 and workload.partitions > 1 and extra.random() < 0.3:
            case = replace(case, workload=replace(workload, finalized_partitions=1))
        # A transaction that outlives resume's wait for the old job's members (txnjob only, drawn apart too).
        if mix == "txnjob" and random.Random(f"case/{seed}/{mix}/txn-timeout").random() < 0.5:
            case = replace(case, workload=replace(case.workload, transaction_timeout_s=120.0))
        # Or resume run with --force, reading at once (txnjob only, drawn apart too).
        if mix == "txnjob" and random.Random(f"case/{seed}/{mix}/force").random() < 0.5:
            case = replace(case, workload=replace(case.workload, resume_force=True))
        return case

    def with_plan(self, plan) -> Case:
        return replace(self, plan=tuple(plan))

    def with_workload(self, workload: Workload) -> Case:
        # Faults of roles the smaller workload has no longer are dropped with them.
        roles = {f"w{i}" for i in range(workload.reassemblers)} | {"trainer", "rollout", "resume", ""}
        return replace(self, workload=workload, plan=tuple(f for f in self.plan if f.role in roles))

    def to_json(self) -> dict:
        return {
            "seed": self.seed,
            "mix": self.mix,
            "switch": self.switch,
            "workload": self.workload.to_json(),
            "plan": [f.to_json() for f in self.plan],
        }

    @staticmethod
    def from_json(d: dict) -> Case:
        return Case(
            d["seed"],
            d.get("mix", "all"),
            Workload.from_json(d["workload"]),
            tuple(Fault.from_json(f) for f in d["plan"]),
            d.get("switch", 0.2),
        )

    def __str__(self) -> str:
        w = self.workload
        finalized = f" (finalized {w.finalized_partitions})" if w.finalized_partitions else ""
        return (
            f"seed {self.seed} ({self.mix}): {w.prompts} prompts {list(w.kinds)}, groups of {w.group_size}, "
            f"{w.partitions} partitions{finalized}, {w.reassemblers} reassemblers"
            f"{' (static)' if w.static_membership else ''}"
            f"{f', transactions time out at {w.transaction_timeout_s:g}s' if w.transaction_timeout_s != 10.0 else ''}"
            f"{', resume --force' if w.resume_force else ''}, "
            f"switch {self.switch}; faults: " + ("; ".join(str(f) for f in self.plan) or "none")
        )


def run(case: Case) -> Result:
    with tempfile.TemporaryDirectory(prefix="rlstream-explore-") as root:
        return World(case.seed, case.workload, list(case.plan), Path(root), switch=case.switch).run()


def history(result: Result, *, limit: int = 80) -> list[str]:
    """The events that matter, oldest first: faults, crashes, starts, resumes, and what names a group
    one of the violations names (all of them when the run is short)."""
    named = {m for v in result.violations for m in _GROUP.findall(v)}
    short = len(result.events) <= limit

    def matters(e: str) -> bool:
        lifecycle = e.startswith(("fault", "job", "resume", "broker")) or "crashed" in e or "started" in e
        return short or lifecycle or any(g in e for g in named)

    keep = [(t, e) for t, e in result.events if matters(e)]
    return [f"{t:9.2f}s  {e}" for t, e in keep[-limit:]]


def save(path: Path, case: Case, result: Result | None = None, *, original: Case | None = None) -> None:
    data: dict = {"format": FORMAT, "case": case.to_json()}
    if result is not None:
        data["violations"] = result.violations
        data["history"] = history(result)
        data["digest"] = result.digest
    if original is not None:
        data["original"] = original.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path) -> tuple[Case, dict]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an explorer seed file of format {FORMAT}")
    return Case.from_json(data["case"]), data
