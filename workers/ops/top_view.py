"""What `rlstream top` shows: one snapshot of a run's figures, and its rendering as lines of text.

Pure: `render(snapshot, previous)` turns the figures gathered by `workers.ops.top` into the screen's
lines, rates from the difference to the previous snapshot. A figure that could not be read is None
and shows as `n/a` with the reason, never as a zero.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

NA = "n/a"
BAR_WIDTH = 32


@dataclass(frozen=True)
class PartitionLag:
    consumer_group: str
    topic: str
    partition: int
    committed: int | None  # None: the group has committed nothing on this partition
    end: int
    lag: int


@dataclass(frozen=True)
class TrainerState:
    """The latest record of one trainer on the version topic."""

    trainer_id: str
    consumer_group: str
    version: int
    batch_groups: int
    lost_groups: int
    time_ms: int


@dataclass(frozen=True)
class Endpoint:
    url: str
    error: str | None = None  # None: it answered


@dataclass(frozen=True)
class Metrics:
    """What the metrics endpoints report for the run, each None when none of them does."""

    receipts_consumed: float | None = None
    groups_finalized: float | None = None
    groups_trained: float | None = None
    evicted: float | None = None
    dead_letters: Mapping[str, float] | None = None  # by reason
    trainer_undecodable: float | None = None
    trainer_missing_rows: float | None = None
    staleness: Mapping[float, float] | None = None  # cumulative count per upper bound (math.inf last)
    trainer_version: float | None = None
    tq_rows: Mapping[str, float] | None = None  # by TQ partition
    open_groups: float | None = None
    paused: float | None = None
    aborts: float | None = None
    fences: float | None = None
    pool_restarts: float | None = None
    pool_fenced_exits: float | None = None


@dataclass(frozen=True)
class Snapshot:
    at: float  # wall time, seconds
    prefix: str
    bootstrap_servers: str
    kafka_error: str | None = None
    receipts_end: int | None = None  # records on the receipts topic (sum of its end offsets)
    lags: tuple[PartitionLag, ...] = ()
    lag_errors: tuple[str, ...] = ()
    trainers: tuple[TrainerState, ...] = ()
    endpoints: tuple[Endpoint, ...] = ()
    metrics: Metrics = field(default_factory=Metrics)


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return NA if x is None else fmt.format(x)


def _rate(now: Snapshot, prev: Snapshot | None, get) -> str:
    """Per-second rate of a counter between two snapshots; `…` until there are two, n/a when unread."""
    cur = get(now)
    if cur is None:
        return NA
    if prev is None or get(prev) is None or now.at <= prev.at:
        return "…"
    delta = cur - get(prev)
    if delta < 0:  # a process restarted and its counter began again
        return "…"
    return f"{delta / (now.at - prev.at):.1f}/s"


def _ago(ms: int, now_s: float) -> str:
    s = max(0.0, now_s - ms / 1000)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def _staleness_lines(cumulative: Mapping[float, float]) -> list[str]:
    """One bar per bucket of versions behind, from cumulative Prometheus buckets."""
    bounds = sorted(cumulative)
    counts, prev_le, prev_c = [], -1.0, 0.0
    for le in bounds:
        c = cumulative[le]
        if math.isinf(le):
            label = f">{prev_le:g}"
        elif le - prev_le <= 1:
            label = f"{le:g}"
        else:
            label = f"{prev_le + 1:g}-{le:g}"
        counts.append((label, max(0.0, c - prev_c)))
        prev_le, prev_c = le, c
    while counts and counts[-1][1] == 0:
        counts.pop()
    total = sum(n for _, n in counts)
    if total == 0:
        return ["  (no group trained yet)"]
    top = max(n for _, n in counts)
    lines = []
    for label, n in counts:
        bar = "█" * (round(BAR_WIDTH * n / top) if n else 0)
        lines.append(f"  {label:>6} │{bar:<{BAR_WIDTH}} {n:.0f} ({100 * n / total:.0f}%)")
    return lines


def _lag_lines(snap: Snapshot) -> list[str]:
    if snap.kafka_error is not None:
        return [f"  {NA}: Kafka {snap.kafka_error}"]
    lines = [f"  {'topic':<34} {'consumer group':<26} {'part':>4} {'committed':>10} {'end':>10} {'lag':>8}"]
    for row in snap.lags:
        committed = "-" if row.committed is None else str(row.committed)
        lines.append(
            f"  {row.topic:<34} {row.consumer_group:<26} {row.partition:>4} {committed:>10} {row.end:>10} {row.lag:>8}"
        )
    lines.extend(f"  {NA}: {e}" for e in snap.lag_errors)
    return lines


# Other jobs' TQ partitions listed by name up to this many; past it, one count (a TQ shared by many
# jobs listed hundreds, a line that wrapped over a third of the screen and pushed the rest off it).
_OTHER_PARTITIONS_LISTED = 4


def _tq_held(rows: Mapping[str, float]) -> str:
    """rlstream's own partitions first, then the others by name, or counted when there are many."""
    own = [(k, v) for k, v in sorted(rows.items()) if k.startswith("rlstream.")]
    others = [(k, v) for k, v in sorted(rows.items()) if not k.startswith("rlstream.")]
    parts = [", ".join(f"{k} {v:.0f}" for k, v in own)] if own else []
    if len(others) > _OTHER_PARTITIONS_LISTED:
        parts.append(f"{len(others)} other partitions: {sum(v for _, v in others):.0f} rows")
    elif others:
        parts.append(", ".join(f"{k} {v:.0f}" for k, v in others))
    return " · ".join(parts) or "no partition"


def render(snap: Snapshot, prev: Snapshot | None = None, *, interval_s: float = 1.0) -> list[str]:
    """The screen for `snap`; rates need `prev`, the snapshot shown before."""
    m = snap.metrics
    up = [e for e in snap.endpoints if e.error is None]
    why = "no metrics endpoint given" if not snap.endpoints else "no endpoint that answered reports it"
    clock = time.strftime("%H:%M:%S", time.localtime(snap.at))
    lines = [
        f"rlstream top · prefix {snap.prefix or '(none)'} · broker {snap.bootstrap_servers} · {clock} "
        f"· every {interval_s:g}s, Ctrl-C quits",
        "",
    ]
    if snap.trainers:
        for t in snap.trainers:
            lines.append(
                f"trainer      version {t.version}  ({t.trainer_id}, {t.batch_groups} groups a version, "
                f"{t.lost_groups} lost, published {_ago(t.time_ms, snap.at)})"
            )
    else:
        lines.append(f"trainer      version {_num(m.trainer_version)}  (nothing on the version topic)")

    def rate(get):
        return _rate(snap, prev, get)

    lines.append(
        f"throughput   receipts in {rate(lambda s: s.receipts_end)}  consumed "
        f"{rate(lambda s: s.metrics.receipts_consumed)}  groups finalized "
        f"{rate(lambda s: s.metrics.groups_finalized)}  trained {rate(lambda s: s.metrics.groups_trained)}"
    )
    lines += ["", "lag per partition (records)"] + _lag_lines(snap)
    lines += ["", "staleness of trained groups (versions behind the trainer, since it started)"]
    lines += [f"  {NA}: {why}"] if m.staleness is None else _staleness_lines(m.staleness)
    lines.append("")
    if m.evicted is None:
        lines.append(f"evictions    {NA}: {why}")
    else:
        seen = m.evicted + (m.groups_trained or 0)
        share = f" ({100 * m.evicted / seen:.1f}% of {seen:.0f} taken in)" if seen else ""
        lines.append(f"evictions    {m.evicted:.0f} stale{share}")
    if m.dead_letters is None and m.trainer_undecodable is None:
        lines.append(f"dead letters {NA}: {why}")
    else:
        reasons = (
            NA
            if m.dead_letters is None
            else ", ".join(f"{k} {v:.0f}" for k, v in sorted(m.dead_letters.items()) if v) or "none"
        )
        lines.append(
            f"dead letters reassemblers: {reasons} · trainer: undecodable {_num(m.trainer_undecodable)}, "
            f"rows missing {_num(m.trainer_missing_rows)}"
        )
    if m.tq_rows is None:
        lines.append(f"TQ rows held {NA}: {why} (TQ's exporter: rlstream demo --metrics-port, start_tq_metrics)")
    else:
        lines.append(f"TQ rows held {_tq_held(m.tq_rows)}")
    lines.append(
        f"reassemblers open groups {_num(m.open_groups)}, paused {_num(m.paused)}, aborts {_num(m.aborts)}, "
        f"fences {_num(m.fences)}; pool restarts {_num(m.pool_restarts)}, fenced exits {_num(m.pool_fenced_exits)}"
    )
    lines += ["", f"metrics endpoints: {len(up)} of {len(snap.endpoints)} up"]
    lines += [f"  {e.url}  {'up' if e.error is None else 'DOWN: ' + e.error}" for e in snap.endpoints]
    return lines
