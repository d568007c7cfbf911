"""The Grafana dashboard and the Prometheus rules of docker/, read the way the checks need them.

`queries()` lists every panel query of the dashboard, `concrete()` substitutes Grafana's variables the way
Grafana would (a run's prefix for `$prefix`, a window for `$__rate_interval` and `$__range`), and
`exported_metrics()` lists every sample name the code exports, from the real sensors and TQ's own
exporter, so that a query naming anything else is caught.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "rlstream.json"
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
ALERTS = PROMETHEUS_DIR / "rlstream-alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "rlstream-alerts.test.yml"

# The variables a query may use: the dashboard's own and the Grafana built-ins it relies on.
VARIABLES = ("$prefix", "$__rate_interval", "$__range")
_METRIC = re.compile(r"\b((?:rlstream|tq)_[a-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b(rlstream_[a-z0-9_]+)(\{[^}]*\})?")


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p.get("type") != "row"]


def queries(dash: dict | None = None) -> list[Query]:
    dash = dash if dash is not None else load_dashboard()
    return [Query(p["title"], t["refId"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


def concrete(expr: str, *, prefix: str, rate_interval: str = "30s", range_: str = "5m") -> str:
    """`expr` as Grafana sends it with `$prefix` set to one run (regex-escaped, as Grafana does)."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", range_)
        .replace("$prefix", re.escape(prefix).replace("\\", "\\\\"))
    )


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def rlstream_selectors(expr: str) -> list[tuple[str, str]]:
    """Each rlstream metric named in `expr` with its label matchers ("" when it has none)."""
    return [(m.group(1), m.group(2) or "") for m in _SELECTOR.finditer(expr)]


def alert_rules(path: Path = ALERTS) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "alert" in r]


def exported_metrics() -> dict[str, str]:
    """Every sample name the code exports -> its metric family: rlstream's sensors, each exercised so that
    every labelled family has a series, and TQ's exporter (`tq_*`, started by `start_tq_metrics`)."""
    from prometheus_client import CollectorRegistry
    from transfer_queue.metrics import TQMetricsExporter

    from workers.telemetry.prometheus import PrometheusPoolSensor, PrometheusReassemblerSensor, PrometheusTrainerSensor

    r = CollectorRegistry()
    s = PrometheusReassemblerSensor(r, prefix="p")
    s.on_commit(seconds=0.1, finalized=1, dead_letters={"decode_error": 1})
    s.on_retry("restore")
    s.on_lag("p.rollout.receipts", {0: 1})
    PrometheusTrainerSensor(r, prefix="p").on_version(1)
    pool = PrometheusPoolSensor(r, prefix="p")
    pool.on_worker("w-0")
    pool.on_running(1, spare_ready=False)
    names = {s.name: fam.name for fam in r.collect() for s in fam.samples}
    tq = TQMetricsExporter(role="controller")
    tq.collect_controller_metrics()
    names.update({s.name: fam.name for fam in tq.registry.collect() for s in fam.samples})
    # Families whose series appear only with a storage unit registered: declared, so listed by name.
    names.update({fam.name: fam.name for fam in tq.registry.collect()})
    return names
