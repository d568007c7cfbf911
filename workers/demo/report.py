"""The demo's figures and its verdict: what it counted, whether every group ended exactly once, the summary table."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class DemoReport:
    bootstrap_servers: str = ""
    prefix: str = ""
    groups_produced: int = 0
    groups_finalized: int = 0
    groups_consumed: int = 0
    groups_evicted_stale: int = 0
    groups_dead_lettered: int = 0
    poison_receipts_dead_lettered: int = 0
    duplicates_dropped: int = 0
    final_weight_version: int = 0
    # Whether producers went through the admission gate, and how long they waited on it (all together).
    admission: bool = False
    admission_wait_s: float = 0.0
    elapsed_s: float = 0.0
    groups_per_s: float = 0.0
    tokens_per_s: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    # What each reassembler actor returned when stopped (its totals), empty with external reassemblers.
    reassemblers: list[dict] = field(default_factory=list)
    # With --metrics-port: the /metrics URLs of the trainer, each reassembler actor and TQ.
    metrics_endpoints: dict[str, object] = field(default_factory=dict)
    accounted: bool = False
    problems: list[str] = field(default_factory=list)


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1) of `values`; 0.0 for none."""
    s = sorted(values)
    if not s:
        return 0.0
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def accounting_problems(
    produced: Iterable[str], consumed: Iterable[str], evicted: Iterable[str], dead: Iterable[str]
) -> list[str]:
    """Why the outcomes are not exactly one per produced group: twice, never, or for a group not produced."""
    produced_set = set(produced)
    outcomes = Counter([*consumed, *evicted, *dead])
    problems = []
    twice = sorted(g for g, n in outcomes.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} group(s) accounted more than once, e.g. {twice[:3]}")
    missing = sorted(produced_set - set(outcomes))
    if missing:
        problems.append(f"{len(missing)} produced group(s) never reached an outcome, e.g. {missing[:3]}")
    unknown = sorted(set(outcomes) - produced_set)
    if unknown:
        problems.append(f"{len(unknown)} group(s) not produced by this run, e.g. {unknown[:3]}")
    return problems


def summary_table(report: DemoReport) -> str:
    rows = [
        ("groups produced", report.groups_produced),
        ("groups finalized", report.groups_finalized),
        ("groups consumed by the trainer", report.groups_consumed),
        ("groups evicted as stale", report.groups_evicted_stale),
        ("groups dead-lettered", report.groups_dead_lettered),
        ("poison receipts dead-lettered", report.poison_receipts_dead_lettered),
        ("final trainer weight version", report.final_weight_version),
        ("admission control", f"on, producers waited {report.admission_wait_s} s" if report.admission else "off"),
        ("throughput", f"{report.groups_per_s} groups/s, {report.tokens_per_s:,.0f} tokens/s"),
        ("latency last receipt -> trainer", f"p50 {report.latency_p50_ms} ms, p99 {report.latency_p99_ms} ms"),
        ("wall time", f"{report.elapsed_s} s"),
        ("every group accounted for once", "yes" if report.accounted else "NO"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  problem: {p}" for p in report.problems]
    return "\n".join(["rlstream demo summary", *lines])


def write_json(report: DemoReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(report), indent=2) + "\n")
