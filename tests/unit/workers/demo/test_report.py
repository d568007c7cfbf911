"""The demo's verdict: every produced group reaches exactly one outcome; its table and JSON figures."""

import json
import re

from workers.demo.report import DemoReport, accounting_problems, percentile, summary_table, write_json

PRODUCED = ["g1", "g2", "g3", "g4"]


def test_every_group_once_is_no_problem():
    assert accounting_problems(PRODUCED, ["g1", "g3"], ["g2"], {"g4"}) == []


def test_a_group_with_two_outcomes_is_a_duplicate():
    problems = accounting_problems(PRODUCED, ["g1", "g3", "g1"], ["g2"], {"g4"})
    assert problems == ["1 group(s) accounted more than once, e.g. ['g1']"]
    problems = accounting_problems(PRODUCED, ["g1", "g3"], ["g2", "g3"], {"g4"})
    assert problems == ["1 group(s) accounted more than once, e.g. ['g3']"]
    problems = accounting_problems(PRODUCED, ["g1", "g3", "g4"], ["g2"], {"g4"})
    assert problems == ["1 group(s) accounted more than once, e.g. ['g4']"]


def test_a_produced_group_without_an_outcome_is_missing():
    problems = accounting_problems(PRODUCED, ["g1"], ["g2"], set())
    assert problems == ["2 produced group(s) never reached an outcome, e.g. ['g3', 'g4']"]


def test_an_outcome_for_a_group_not_produced_is_unknown():
    problems = accounting_problems(PRODUCED, ["g1", "g2", "g3", "g4", "x9"], [], set())
    assert problems == ["1 group(s) not produced by this run, e.g. ['x9']"]


def test_all_three_problems_are_reported_together():
    problems = accounting_problems(PRODUCED, ["g1", "g1", "zz"], [], set())
    assert [p.split(" group(s)")[0] for p in problems] == ["1", "3 produced", "1"]


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0 and percentile(values, 0.99) == 99.0
    assert percentile(reversed(values), 0.0) == 1.0 and percentile(values, 1.0) == 100.0
    assert percentile([], 0.5) == 0.0 and percentile([7.0], 0.99) == 7.0


def test_summary_table_and_json_carry_the_verdict(tmp_path):
    report = DemoReport(groups_produced=4, groups_consumed=3, groups_dead_lettered=1, accounted=True)
    table = summary_table(report)
    assert re.search(r"\n  every group accounted for once +yes$", table)
    assert re.search(r"\n  groups consumed by the trainer +3\n", table)
    report.accounted, report.problems = False, ["timed out after 5s"]
    table = summary_table(report)
    assert re.search(r"\n  every group accounted for once +NO\n  problem: timed out after 5s$", table)
    write_json(report, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["groups_produced"] == 4 and back["accounted"] is False and back["problems"] == ["timed out after 5s"]
