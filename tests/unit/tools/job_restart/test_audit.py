"""The job-restart drill's audit: a round whose fault did not fire fails (issue 30 review, item 8)."""

import pytest

from tests.tools.job_restart.audit import Audit, fired_in_resume
from workers.trainer.resume_report import ResumeReport

ALL = frozenset({"failed", "held", "duplicate"})


def _fired(**changes) -> Audit:
    audit = Audit("jr-x", produced=3, trained_once=3, faults=ALL, failed_groups=1, held_partitions=1)
    audit.duplicate, audit.duplicates_found = "jr-x-p0", 1
    for k, v in changes.items():
        setattr(audit, k, v)
    return audit


def test_a_round_whose_every_fault_fired_holds():
    assert _fired().problems() == []


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"failed_groups": 0}, "failed"),
        ({"held_partitions": 0}, "held"),
        ({"held_partitions": None}, "held"),
        ({"duplicates_found": 0}, "duplicate"),
        ({"duplicate": None}, "duplicate"),
    ],
)
def test_a_fault_asked_for_that_did_not_fire_fails_the_round(changes, fault):
    (problem,) = _fired(**changes).problems()
    assert problem.startswith(f"fault did not fire: {fault}:")


def test_a_fault_not_asked_for_is_not_looked_for():
    assert _fired(faults=frozenset({"failed"}), held_partitions=None, duplicates_found=None).problems() == []


def test_resume_s_own_report_lines_say_what_fired():
    # The lines as the restarted job prints them (workers/examples/grpo/run.py: "resume: " + each line).
    report = ResumeReport(duplicates=2, open_at_start={("t.experience.finalized", 0): (4, 7)}, aborted=["re.w0"])
    out = "\n".join(f"resume: {line}" for line in report.lines())
    assert fired_in_resume(out) == (1, 2)
    quiet = "\n".join(f"resume: {line}" for line in ResumeReport().lines())
    assert fired_in_resume(quiet) == (0, 0)
    assert fired_in_resume("no resume here") == (None, None)
