"""Data-plane benchmark: rlstream end to end against the raw TQ cycle, Ray RPC by value and memcpy.

One run, one Ray/TQ and one local broker, two group shapes side by side (`cycles.SHAPES`):
`dense` (8 rollouts x 2048 tokens, 4 calls each; token ids int64, mask bool, logprobs float32) and
`moe` (8 rollouts x 8,192 tokens, plus routed experts 48 layers x top-8 per token as uint8):

  (a) raw TQ cycle: put a group's 32 staged rows, get them, put its 8 training rows, get them, clear
      both, with TQ's KV API in this process and TQ's own layout (one item per row and field)
      (`cycles.py`), at 1 and at 8 groups per call (moe: 1);
  (a') the same cycle with rlstream's packed rows (`schemas/rowpack.py`: one uint8 TQ field per
      row), packed before each call: the honest bound of rlstream's own path (e2e / packed);
  (b) the same cycle against a Ray actor that receives and returns the tensors by value;
  (c) rlstream: `RolloutPublisher` -> reassembler process(es) -> `ExperienceConsumer` select,
      materialize and ack, 8 groups per publish and per select (moe: 1), first publish to last ack
      (`e2e.py`);
  (d) the memcpy of the same bytes (each of the cycle's four moves as one copy);
  (f) fetch (dense): the trainer's select + materialize against a raw TQ get of the same rows, 8
      groups per call (`fetch.py`);
  latency: last receipt acked -> committed finalized record visible, p50/p99 at half of the peak
      drain rate measured just before, with where the time goes (`latency.py`).

The bounds and the end-to-end run alternate in rounds, so load that drifts during the run touches
them alike; each figure is the median over rounds and the ratios are per round, then their median.
The machine is shared and loaded: compare ratios from one run, not figures across runs. Per-call
breakdowns (seconds in each TQ operation per role, Kafka commit steps) follow the summary.

    .venv/bin/python -m bench.dataplane [--quick] [--rounds 3] [--shapes dense,moe]
        [--only raw,packed,rpc,memcpy,e2e,fetch,latency]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.dataplane.cycles import (
    OPS,
    SHAPES,
    BenchShape,
    CycleResult,
    make_payload,
    memcpy_cycle,
    packed_tq_cycle,
    raw_tq_cycle,
    ray_rpc_cycle,
)
from bench.dataplane.e2e import E2EResult, EndToEnd
from bench.dataplane.fetch import FetchBench, FetchRound, print_round
from bench.dataplane.fetch import print_summary as print_fetch_summary
from bench.dataplane.latency import LatencyResult, measure_latency, print_latency
from bench.dataplane.profile import Profiler, summarize
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.tq import TQConfig, init_tq

PHASES = ("raw", "packed", "rpc", "memcpy", "e2e", "fetch", "latency")
KAFKA_PHASES = ("e2e", "fetch", "latency")
CYCLES = {"raw": raw_tq_cycle, "packed": packed_tq_cycle, "rpc": ray_rpc_cycle, "memcpy": memcpy_cycle}
NAMES = {
    "raw": "(a) raw TQ cycle",
    "packed": "(a') packed TQ cycle",
    "rpc": "(b) Ray RPC by value",
    "memcpy": "(d) memcpy",
}


class Measured:
    """Everything one run measured, per shape: bounds by (phase, groups per call), e2e rounds, bytes."""

    def __init__(self) -> None:
        self.cycles: dict[str, dict[tuple[str, int], list[CycleResult]]] = {}
        self.e2e: dict[str, list[E2EResult]] = {}
        self.bytes_per_group: dict[str, int] = {}
        self.fetches: list[FetchRound] = []
        self.latency: LatencyResult | None = None


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, fewer groups: a few minutes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every phase, alternating")
    parser.add_argument("--groups", type=int, default=32, help="dense groups per bound and round (a multiple of 8)")
    parser.add_argument("--e2e-groups", type=int, default=128, help="dense groups per end-to-end round (multiple of 8)")
    parser.add_argument("--moe-groups", type=int, default=8, help="moe groups per bound and per end-to-end round")
    parser.add_argument("--fetch-groups", type=int, default=128, help="groups per fetch round (multiple of 8)")
    parser.add_argument("--latency-groups", type=int, default=60, help="groups of the latency phase's drain and pace")
    parser.add_argument("--workers", type=int, default=1, help="reassembler processes of the end-to-end run")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument(
        "--tq-profile",
        choices=("auto", "single_node", "cluster"),
        default="auto",
        help="TQ's sizing (TQConfig.profile; auto on one machine: single_node)",
    )
    parser.add_argument("--json", type=Path, help="also write every measurement there")
    parser.add_argument("--profile", type=Path, help="py-spy every phase into this directory, then summarize")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.groups, args.e2e_groups, args.fetch_groups = 1, 16, 32, 16
        args.moe_groups, args.latency_groups = 4, 24
    args.only = [p for p in args.only.split(",") if p]
    args.shapes = [SHAPES[s] for s in args.shapes.split(",") if s in SHAPES]
    args.profiler = Profiler(args.profile) if args.profile is not None else None
    if unknown := set(args.only) - set(PHASES):
        parser.error(f"unknown phase(s) {sorted(unknown)}; choose from {PHASES}")
    if args.groups % 8 or args.e2e_groups % 8 or args.fetch_groups % 8:
        parser.error("--groups, --e2e-groups and --fetch-groups must be multiples of 8")
    return args


def _groups(args: argparse.Namespace, shape: BenchShape, e2e: bool) -> int:
    if shape.name == "moe":
        return args.moe_groups
    return args.e2e_groups if e2e else args.groups


def _measure(args: argparse.Namespace, kafka: KafkaConfig | None) -> Measured:
    m = Measured()
    payloads = {(s.name, k): make_payload(k, s) for s in args.shapes for k in s.bound_groups_per_call}
    for s in args.shapes:
        p = payloads[s.name, s.bound_groups_per_call[-1]]
        m.bytes_per_group[s.name] = (p.staging_bytes + p.train_bytes) // p.groups
    pipelines: dict[str, EndToEnd] = {}
    fetch = FetchBench(kafka, 8) if "fetch" in args.only else None
    try:
        if "e2e" in args.only:
            for s in args.shapes:
                pipelines[s.name] = EndToEnd(
                    kafka, s.e2e_groups_per_call, workers=args.workers, shape=s.synthetic, actor=s.actor_config
                )
                pipelines[s.name].warm_up()
        if fetch is not None:
            fetch.warm_up()
        for r in range(args.rounds):
            for s in args.shapes:
                for phase in (p for p in PHASES if p in args.only and p in CYCLES):
                    for k in s.bound_groups_per_call:
                        calls = max(1, _groups(args, s, False) // k)
                        with _profiled(args, f"{s.name}-{phase}@{k}-r{r}", calls * k, {}):
                            result = CYCLES[phase](payloads[s.name, k], calls)
                        m.cycles.setdefault(s.name, {}).setdefault((phase, k), []).append(result)
                if s.name in pipelines:
                    pipeline = pipelines[s.name]
                    children = {f"reassembler-{p.pid}": p.pid for p in pipeline.procs}
                    n = _groups(args, s, True)
                    with _profiled(args, f"{s.name}-e2e@{s.e2e_groups_per_call}-r{r}", n, children):
                        m.e2e.setdefault(s.name, []).append(pipeline.run_round(n))
            if fetch is not None:
                with _profiled(args, f"fetch@8-r{r}-{args.fetch_groups}g", args.fetch_groups, {}):
                    m.fetches.append(fetch.run_round(args.fetch_groups))
                print_round(m.fetches[-1])
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for pipeline in pipelines.values():
            pipeline.close()
        if fetch is not None:
            fetch.close()
    if "latency" in args.only:
        m.latency = measure_latency(kafka, SHAPES["dense"].synthetic, args.latency_groups)
    return m


def _profiled(args: argparse.Namespace, name: str, groups: int, clients: dict[str, int]):
    if args.profile is None:
        return contextlib.nullcontext()
    return args.profiler.phase(name, groups, {"driver": os.getpid(), **clients})


def _row(name: str, k: int, rates: list[float], shape: BenchShape, bytes_per_group: int) -> str:
    med = statistics.median(rates)
    spread = f"{min(rates):.1f}-{max(rates):.1f}"
    return (
        f"{name:<22} {k:>5} {med:>9.1f} {spread:>13} {med * shape.tokens_per_group:>12,.0f} "
        f"{med * bytes_per_group / 1e6:>9.1f} {1000 * k / med:>9.1f}"
    )


def _print_summary(m: Measured, shapes: list[BenchShape]) -> None:
    for s in shapes:
        cycles, e2e, nbytes = m.cycles.get(s.name, {}), m.e2e.get(s.name, []), m.bytes_per_group[s.name]
        if not cycles and not e2e:
            continue
        print(
            f"\n{s.name}: {s.describe()}; {nbytes / 1e6:.2f} MB per group (staged deltas + training rows); "
            f"median over rounds, spread = min-max"
        )
        print(f"{'':<22} {'grp/c':>5} {'groups/s':>9} {'spread':>13} {'tokens/s':>12} {'MB/s':>9} {'ms/call':>9}")
        for (phase, k), results in cycles.items():
            print(_row(NAMES[phase], k, [r.groups_per_s for r in results], s, nbytes))
        k = s.e2e_groups_per_call
        if e2e:
            print(_row("(c) rlstream e2e", k, [r.groups_per_s for r in e2e], s, nbytes))
        for phase, label in (("raw", "raw-TQ"), ("packed", "packed-TQ"), ("rpc", "Ray-RPC"), ("memcpy", "memcpy")):
            if e2e and (phase, k) in cycles:
                ratios = [e.groups_per_s / c.groups_per_s for e, c in zip(e2e, cycles[(phase, k)])]
                per_round = ", ".join(f"{x:.3g}" for x in ratios)
                print(f"{s.name} e2e/{label} ({k} per call): {statistics.median(ratios):.3g}  (per round: {per_round})")


def _ratio(m: Measured, shape: str, phase: str) -> float | None:
    """The median over rounds of e2e / the bound `phase` of `shape`, at the e2e's groups per call."""
    e2e, k = m.e2e.get(shape, []), SHAPES[shape].e2e_groups_per_call
    bound = m.cycles.get(shape, {}).get((phase, k), [])
    if not e2e or not bound:
        return None
    return statistics.median(e.groups_per_s / c.groups_per_s for e, c in zip(e2e, bound))


def _print_targets(m: Measured) -> None:
    """Issue 33's targets, each figure beside its target and whether this run met it."""
    fetch = statistics.median(r.ratio for r in m.fetches) if m.fetches else None
    rows = [
        ("dense e2e / Ray RPC by value, 8 groups per call", _ratio(m, "dense", "rpc"), ">=", 1.0, "x"),
        ("dense e2e / packed-row TQ cycle", _ratio(m, "dense", "packed"), ">=", 0.9, "x"),
        ("MoE e2e / raw TQ cycle", _ratio(m, "moe", "raw"), ">=", 0.8, "x"),
        ("p99 last receipt -> committed record, half of peak", m.latency and m.latency.p99_ms, "<", 100.0, " ms"),
        ("trainer select + materialize / raw TQ get", fetch, ">=", 0.9, "x"),
    ]
    print("\ntargets (issue 33), this run:")
    for name, value, op, target, unit in rows:
        if value is None:
            continue
        met = value >= target if op == ">=" else value < target
        print(f"  {name:<52} {value:>8.3g}{unit:<3} target {op} {target:g}{unit}: {'met' if met else 'NOT met'}")


def _print_cycle_ops(shape: str, cycles: dict) -> None:
    if not cycles:
        return
    print(f"\n{shape} bounds, ms per call in each operation (median round):")
    print(f"{'':<22} {'grp/c':>5} " + " ".join(f"{op:>12}" for op in OPS))
    for (_, k), results in cycles.items():
        per_call = [{op: 1000 * r.ops.get(op, 0.0) / (r.groups / k) for op in OPS} for r in results]
        cells = " ".join(f"{statistics.median(p[op] for p in per_call):>12.2f}" for op in OPS)
        print(f"{results[0].name:<22} {k:>5} {cells}")


def _print_e2e_ops(shape: str, e2e: list[E2EResult]) -> None:
    if not e2e:
        return
    r = min(e2e, key=lambda x: x.seconds)
    print(
        f"\n{shape} end to end, fastest round: {r.groups} groups in {r.seconds:.2f}s; publisher done at "
        f"{r.publish_done_s:.2f}s ({r.groups / r.publish_done_s:.1f} groups/s offered)"
    )
    print(f"  publisher: publish calls {r.publisher['publish']:.2f}s, of which TQ puts {r.publisher['tq put']:.2f}s")
    steps, finalized, secs = r.commits
    print(
        f"  reassembler: {steps:.0f} commit steps, {finalized:.0f} groups, {secs:.2f}s in them "
        f"(staging fetch + build + train put + Kafka transaction)"
    )
    print("  trainer: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.trainer.items()) + " (select waits for groups)")
    print(f"  {'role':<12} {'TQ op':<24} {'calls':>6} {'rows':>7} {'ms/call':>9} {'total s':>8}")
    for role, stats in r.stores.items():
        for op, (calls, rows, secs) in sorted(stats.items()):
            print(f"  {role:<12} {op:<24} {calls:>6.0f} {rows:>7.0f} {1000 * secs / calls:>9.2f} {secs:>8.2f}")


def main() -> None:
    args = _args()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        kafka = None
        if any(p in args.only for p in KAFKA_PHASES):
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            kafka = KafkaConfig(stack.enter_context(LocalBroker(BrokerConfig(data_dir=Path(tmp)))).bootstrap_servers)
        # 4 CPUs: TQ's controller and storage unit(s) take one each; Ray prestarts a worker per CPU.
        # TQ's single-node profile unless --tq-profile says otherwise, as a local run gets it.
        stack.callback(init_tq(TQConfig(num_cpus=4, profile=args.tq_profile)).close)
        m = _measure(args, kafka)
    _print_summary(m, args.shapes)
    print_fetch_summary(m.fetches)
    if m.latency is not None:
        print_latency(m.latency)
    _print_targets(m)
    for s in args.shapes:
        _print_cycle_ops(s.name, m.cycles.get(s.name, {}))
        _print_e2e_ops(s.name, m.e2e.get(s.name, []))
    load = ", ".join(f"{x:.1f}" for x in load_before)
    env = ", ".join(f"{k}={os.environ.get(k)}" for k in ("TQ_CLIENT_ZMQ_IO_THREADS", "TQ_NUM_THREADS"))
    print(f"\nTQ profile {args.tq_profile}: {env}")
    print(f"load average (1, 5, 15 min) at start: {load}; at end: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")
    if args.profiler is not None:
        summarize(args.profile, groups=args.profiler.groups)
    if args.json:
        data = {
            "cycles": {f"{n}-{p}@{k}": [vars(r) for r in rs] for n, c in m.cycles.items() for (p, k), rs in c.items()},
            "e2e": {n: [vars(r) for r in rs] for n, rs in m.e2e.items()},
            "fetch": [vars(r) for r in m.fetches],
            "latency": vars(m.latency) if m.latency is not None else None,
            "bytes_per_group": m.bytes_per_group,
        }
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
