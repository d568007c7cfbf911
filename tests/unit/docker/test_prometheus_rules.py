"""docker/prometheus/rlstream-alerts.yml: every alert has a runbook line and a severity, and promtool's unit
tests (synthetic series, docker/prometheus/rlstream-alerts.test.yml) hold each alert firing and not
firing; an alert made never to fire, or made to fire before its `for` has passed, fails them.
promtool is Debian's `prometheus` package (.ci/run installs it); without it those checks skip.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.tools import dashboard as d

SEVERITIES = {"warning", "critical"}


def _tests() -> list[dict]:
    return yaml.safe_load(d.ALERT_TESTS.read_text())["tests"]


def test_every_alert_has_a_summary_a_runbook_line_and_a_severity():
    rules = d.alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for r in rules:
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        runbook = r["annotations"]["runbook"]
        assert "\n" not in runbook and "Look first" in runbook, f"{r['alert']}: what to look at first, one line"


def test_every_alert_has_a_firing_and_a_not_firing_case():
    firing, quiet = set(), set()
    for t in _tests():
        for case in t["alert_rule_test"]:
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {r["alert"] for r in d.alert_rules()}
    assert alerts - firing == set(), "alerts no test expects to fire"
    assert alerts - quiet == set(), "alerts no test expects to stay quiet"
    assert yaml.safe_load(d.ALERT_TESTS.read_text())["rule_files"] == [d.ALERTS.name]


def test_the_alerts_watch_what_the_issue_asks_for():
    exprs = {r["alert"]: r["expr"] for r in d.alert_rules()}
    watched = {name for e in exprs.values() for name in d.metric_names(e)}
    for metric in (
        "rlstream_consumer_lag_records",  # lag growing
        "rlstream_groups_finalized_total",  # nothing finalized while receipts arrive
        "rlstream_dead_letters_total",
        "rlstream_trainer_missing_rows_total",
        "rlstream_trainer_evicted_groups_total",
        "rlstream_pool_worker_exits_total",  # fenced, crash-looping
        "rlstream_trainer_version",  # stuck
        "tq_partition_samples_total",  # TQ staging growing
    ):
        assert metric in watched, metric


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool here (Debian's prometheus package; .ci/run installs it)")
    return found


def _run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules(promtool):
    proc = _run(promtool, "check", "rules", str(d.ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(d.alert_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass(promtool):
    proc = _run(promtool, "test", "rules", str(d.ALERT_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


NEVER_FIRES = "vector(1) < 0"
MUTATIONS = [(r["alert"], "never fires") for r in d.alert_rules()] + [
    (r["alert"], "no for") for r in d.alert_rules() if "for" in r
]


def _mutate(rule: dict, how: str) -> None:
    if how == "never fires":
        rule["expr"] = NEVER_FIRES
    else:
        del rule["for"]  # fires as soon as its condition holds


@pytest.fixture(scope="module")
def mutants(promtool, tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """promtool's unit tests against each alert mutated, run side by side (each run mostly waits)."""

    def run(mutation: tuple[str, str]) -> subprocess.CompletedProcess:
        alert, how = mutation
        where = tmp_path_factory.mktemp("mutant")
        doc = yaml.safe_load(d.ALERTS.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == alert:
                    _mutate(rule, how)
        (where / d.ALERTS.name).write_text(yaml.safe_dump(doc))
        shutil.copy(d.ALERT_TESTS, where / d.ALERT_TESTS.name)
        return _run(promtool, "test", "rules", str(where / d.ALERT_TESTS.name))

    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(MUTATIONS, pool.map(run, MUTATIONS)))


@pytest.mark.parametrize("alert,how", MUTATIONS)
def test_the_unit_tests_fail_for_an_alert_that_never_fires_or_fires_before_its_for(mutants, alert, how):
    proc = mutants[(alert, how)]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"alertname: {alert}," in out, out
