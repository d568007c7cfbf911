"""Scaling benchmark: rlstream end to end while one dimension at a time moves away from a base point.

Base point: 1 producer, 1 reassembler worker, groups of 8 rollouts x 2048 tokens (4 calls, as in
`bench/pipeline.py`). Sweeps: producers = workers in 1, 2, 4 (N publisher threads and N reassembler
processes), group size 4, 8, 16 rollouts, tokens per rollout 512, 2048, 8192 (prompt, answer and
observation lengths scaled alike). Each configuration is a fresh `bench.dataplane.e2e.EndToEnd` (own topics
and consumer groups, `--partitions` partitions so 4 workers all get some) on one broker and one Ray;
a warm-up group through every publisher, once every worker owns partitions, keeps process start,
Ray attach and rebalances out. Then `--groups` groups run, 1 per publish call (a rollout worker
publishing a group as it completes) and 8 per trainer select (a training batch):

  groups/s, tokens/s, MB/s: first publish to last ack (MB = staged token ids, masks and logprobs);
  offered/s: groups / time until the last publish call returned (above groups/s: a backlog built up,
             so latency includes queueing behind it);
  latency p50/p99: from the return of the publish call carrying a group to the return of the select
             handing it out, both on this process's perf_counter (includes waiting for the batch of 8).

Prints a table, then where each point's time went (publish calls and their TQ puts, reassembler
commit steps, trainer select/materialize/ack), and writes a PNG with a column per dimension (`--png`,
default bench-results/scaling.png). The machine may be shared and loaded: the load average is
printed at start and end, and points run one after the other, so drifting load skews a sweep.

    .venv/bin/python -m bench.scaling [--quick] [--groups 64] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import SHAPE, percentile
from bench.dataplane.e2e import EndToEnd
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.tq import TQConfig, init_tq
from workers.rollout.synthetic import SyntheticShape


@dataclass(frozen=True)
class Point:
    workers: int = 1  # publisher threads and reassembler processes alike
    group_size: int = 8
    tokens: int = 2048  # per rollout

    def label(self) -> str:
        return f"workers={self.workers} group={self.group_size} tokens={self.tokens}"


BASE = Point()
# dimension name -> (Point field, values)
SWEEPS = {
    "producers=workers": ("workers", (1, 2, 4)),
    "group size": ("group_size", (4, 8, 16)),
    "tokens/rollout": ("tokens", (512, 2048, 8192)),
}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 groups per point, only each sweep's endpoints")
    parser.add_argument("--groups", type=int, default=64, help="measured groups per point")
    parser.add_argument("--per-publish", type=int, default=1, help="groups per publish call")
    parser.add_argument("--per-select", type=int, default=8, help="groups per trainer select")
    parser.add_argument("--partitions", type=int, default=8, help="partitions of every pipeline topic (>= 4)")
    parser.add_argument("--json", type=Path, help="also write every point's figures and latencies there")
    parser.add_argument("--png", type=Path, default=Path("bench-results/scaling.png"), help="the plot")
    args = parser.parse_args()
    if args.quick:
        args.groups = 16
    if args.partitions < max(v for v in SWEEPS["producers=workers"][1]):
        parser.error("--partitions must be at least the largest number of workers (4)")
    return args


def shape_for(group_size: int, tokens: int) -> SyntheticShape:
    """SHAPE's group with every length scaled by tokens / 2048, so each rollout has exactly `tokens`."""
    calls = SHAPE.calls[0]

    def scaled(span: tuple[int, int]) -> tuple[int, int]:
        n = span[0] * tokens // 2048
        return (n, n)

    shape = dataclasses.replace(
        SHAPE,
        group_size=group_size,
        prompt_len=scaled(SHAPE.prompt_len),
        answer_len=scaled(SHAPE.answer_len),
        observation_len=scaled(SHAPE.observation_len),
    )
    total = shape.prompt_len[0] + calls * shape.answer_len[0] + (calls - 1) * shape.observation_len[0]
    if total != tokens:
        raise ValueError(f"{tokens} tokens per rollout do not scale SHAPE exactly (got {total})")
    return shape


def points(quick: bool) -> list[tuple[str, Point]]:
    """(dimension, point) for every sweep value, the base point first; quick keeps the endpoints."""
    out = [("base", BASE)]
    for dim, (name, values) in SWEEPS.items():
        for v in (values[0], values[-1]) if quick else values:
            p = dataclasses.replace(BASE, **{name: v})
            if p != BASE:
                out.append((dim, p))
    return out


def measure(kafka: KafkaConfig, point: Point, args: argparse.Namespace) -> dict:
    """One configuration on its own pipeline: set-up and warm-up, then one measured round."""
    t0 = time.perf_counter()
    pipeline = EndToEnd(
        kafka,
        args.per_select,
        workers=point.workers,
        shape=shape_for(point.group_size, point.tokens),
        producers=point.workers,
        partitions=args.partitions,
        groups_per_publish=args.per_publish,
    )
    try:
        pipeline.warm_up()
        setup_s = time.perf_counter() - t0
        r = pipeline.run_round(args.groups)
    finally:
        pipeline.close()
    lat = r.latencies
    return {
        **dataclasses.asdict(point),
        "groups": r.groups,
        "seconds": r.seconds,
        "setup_s": setup_s,
        "groups_per_s": r.groups_per_s,
        "tokens_per_s": r.tokens / r.seconds,
        "mb_per_s": r.staged_bytes / r.seconds / 1e6,
        "offered_per_s": r.groups / r.publish_done_s,
        "p50_ms": 1000 * percentile(lat, 0.5),
        "p99_ms": 1000 * percentile(lat, 0.99),
        "publisher": r.publisher,
        "trainer": r.trainer,
        "commits": r.commits,
        "latencies_ms": [1000 * x for x in lat],
    }


def run_all(kafka: KafkaConfig, args: argparse.Namespace) -> dict[Point, dict]:
    todo = points(args.quick)
    results: dict[Point, dict] = {}
    for i, (dim, point) in enumerate(todo, 1):
        print(f"point {i}/{len(todo)}: {dim}: {point.label()} ...", flush=True)
        m = results[point] = measure(kafka, point, args)
        print(
            f"point {i}/{len(todo)}: {point.label()}: {m['groups_per_s']:.1f} groups/s, "
            f"p50 {m['p50_ms']:.0f} ms, p99 {m['p99_ms']:.0f} ms (set-up {m['setup_s']:.1f}s, "
            f"load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    return results


def sweep_rows(results: dict[Point, dict]) -> list[tuple[str, int, dict]]:
    """(dimension, value, figures) per sweep value measured; the base point appears in every sweep."""
    rows = []
    for dim, (name, values) in SWEEPS.items():
        for v in values:
            p = dataclasses.replace(BASE, **{name: v})
            if p in results:
                rows.append((dim, v, results[p]))
    return rows


def print_table(rows: list[tuple[str, int, dict]], args: argparse.Namespace) -> None:
    print(
        f"\nrlstream end to end, {args.groups} groups per point, {args.per_publish} per publish call, "
        f"{args.per_select} per select, {args.partitions} partitions; base point {BASE.label()}"
    )
    head = ("dimension", "value", "groups/s", "tokens/s", "MB/s", "offered/s", "p50 ms", "p99 ms")
    print(f"{head[0]:<18} {head[1]:>6} " + " ".join(f"{h:>10}" for h in head[2:]))
    for dim, value, m in rows:
        print(
            f"{dim:<18} {value:>6} {m['groups_per_s']:>10.1f} {m['tokens_per_s']:>10,.0f} {m['mb_per_s']:>10.1f} "
            f"{m['offered_per_s']:>10.1f} {m['p50_ms']:>10.0f} {m['p99_ms']:>10.0f}"
        )


def print_breakdown(results: dict[Point, dict]) -> None:
    """Where each point's seconds went; publisher and reassembler seconds are summed over threads and
    processes, so above the wall time they ran side by side (on 2 cores: also waited for a core)."""
    print("\nwhere the time went (seconds; publisher summed over threads, reassembler over processes):")
    head = ("wall", "publish", "TQ put", "steps", "commit", "select", "material.", "ack")
    print(f"{'point':<34} " + " ".join(f"{h:>9}" for h in head))
    for point, m in results.items():
        steps, _, commit_s = m["commits"]
        cells = (m["seconds"], m["publisher"]["publish"], m["publisher"]["tq put"], steps, commit_s)
        cells += tuple(m["trainer"].get(k, 0.0) for k in ("select", "materialize", "ack"))
        print(f"{point.label():<34} " + " ".join(f"{c:>9.2f}" if i != 3 else f"{c:>9.0f}" for i, c in enumerate(cells)))


def write_png(rows: list[tuple[str, int, dict]], path: Path, title: str) -> Path:
    """Per dimension a column: groups/s above, latency p50 and p99 below, log2 x axis."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the run may be on a headless machine
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SWEEPS), figsize=(4 * len(SWEEPS), 7), squeeze=False)
    for col, dim in enumerate(SWEEPS):
        mine = [(v, m) for d, v, m in rows if d == dim]
        xs = [v for v, _ in mine]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(xs, [m["groups_per_s"] for _, m in mine], "o-", label="groups/s")
        top.plot(xs, [m["offered_per_s"] for _, m in mine], "x:", color="grey", label="offered/s")
        top.set_title(dim)
        top.set_ylabel("groups/s")
        top.set_ylim(bottom=0)
        bottom.plot(xs, [m["p50_ms"] for _, m in mine], "o-", label="p50")
        bottom.plot(xs, [m["p99_ms"] for _, m in mine], "s--", label="p99")
        bottom.set_ylabel("latency, publish -> select (ms)")
        bottom.set_ylim(bottom=0)
        bottom.set_xlabel(dim)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    args = _args()
    load_before = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start: {', '.join(f'{x:.1f}' for x in load_before)}", flush=True)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        kafka = KafkaConfig(stack.enter_context(LocalBroker(BrokerConfig(data_dir=Path(tmp)))).bootstrap_servers)
        # 4 CPUs: TQ's controller and 2 storage units take one each; Ray prestarts a worker per CPU.
        stack.callback(init_tq(TQConfig(num_cpus=4)).close)
        results = run_all(kafka, args)
    rows = sweep_rows(results)
    print_table(rows, args)
    print_breakdown(results)
    load_after = os.getloadavg()
    print(f"\nload average (1, 5, 15 min) at end: {', '.join(f'{x:.1f}' for x in load_after)}; {os.cpu_count()} CPUs")
    title = f"rlstream scaling, {args.groups} groups per point (load {load_before[0]:.1f} -> {load_after[0]:.1f})"
    print(f"plot written to {write_png(rows, args.png, title)}")
    if args.json:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "points": list(results.values())}
        args.json.write_text(json.dumps(data, indent=1))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
