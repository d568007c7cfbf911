"""Data-plane benchmark: rlstream end to end against the raw TQ cycle, Ray RPC by value and memcpy.

One run, one Ray/TQ and one local broker, the shapes of `bench_pipeline.py` (groups of 8 rollouts x
2048 tokens, 4 calls each; token ids int64, mask bool, logprobs float32):

  (a) raw TQ cycle: put a group's 32 staged rows, get them, put its 8 training rows, get them, clear
      both, with TQ's KV API in this process (`dataplane_cycles.py`), at 1 and at 8 groups per call;
  (b) the same cycle against a Ray actor that receives and returns the tensors by value;
  (c) rlstream: `RolloutPublisher` -> reassembler process(es) -> `ExperienceConsumer` select,
      materialize and ack, 8 groups per publish and per select, first publish to last ack
      (`dataplane_e2e.py`);
  (d) the memcpy of the same bytes (each of the cycle's four moves as one copy);
  (f) fetch: the trainer's select + materialize against a raw TQ get of the same rows, 8 groups
      per call (`dataplane_fetch.py`); the ratio is the trainer's share of the raw get's throughput.

The bounds and the end-to-end run alternate in rounds, so load that drifts during the run touches
them alike; each figure is the median over rounds and the ratios are per round, then their median.
The machine is shared and loaded: compare ratios from one run, not figures across runs. Per-call
breakdowns (seconds in each TQ operation per role, Kafka commit steps) follow the summary.

    .venv/bin/python bench/bench_dataplane.py [--quick] [--rounds 3] [--only raw,rpc,memcpy,e2e,fetch]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path

from dataplane_cycles import OPS, TOKENS_PER_GROUP, CycleResult, make_payload, memcpy_cycle, raw_tq_cycle, ray_rpc_cycle
from dataplane_e2e import E2EResult, EndToEnd
from dataplane_fetch import FetchBench, FetchRound, print_round
from dataplane_fetch import print_summary as print_fetch_summary
from dataplane_profile import Profiler, summarize

from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.tq import TQConfig, init_tq

PHASES = ("raw", "rpc", "memcpy", "e2e", "fetch")
KAFKA_PHASES = ("e2e", "fetch")
Measured = tuple[dict, list[E2EResult], list[FetchRound], int]  # bounds, e2e rounds, fetch rounds, bytes per group
CYCLES = {"raw": raw_tq_cycle, "rpc": ray_rpc_cycle, "memcpy": memcpy_cycle}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 16 groups per bound, 32 end to end")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every phase, alternating")
    parser.add_argument("--groups", type=int, default=32, help="groups per bound and round (a multiple of 8)")
    parser.add_argument("--e2e-groups", type=int, default=128, help="groups per end-to-end round (multiple of 8)")
    parser.add_argument("--fetch-groups", type=int, default=128, help="groups per fetch round (multiple of 8)")
    parser.add_argument("--workers", type=int, default=1, help="reassembler processes of the end-to-end run")
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--json", type=Path, help="also write every measurement there")
    parser.add_argument("--profile", type=Path, help="py-spy every phase into this directory, then summarize")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.groups, args.e2e_groups, args.fetch_groups = 1, 16, 32, 16
    args.only = [p for p in args.only.split(",") if p]
    args.profiler = Profiler(args.profile) if args.profile is not None else None
    if unknown := set(args.only) - set(PHASES):
        parser.error(f"unknown phase(s) {sorted(unknown)}; choose from {PHASES}")
    if args.groups % 8 or args.e2e_groups % 8 or args.fetch_groups % 8:
        parser.error("--groups, --e2e-groups and --fetch-groups must be multiples of 8")
    return args


def _measure(args: argparse.Namespace, kafka: KafkaConfig | None) -> Measured:
    payloads = {k: make_payload(k) for k in (1, 8)}
    bytes_per_group = (payloads[8].staging_bytes + payloads[8].train_bytes) // 8
    cycles: dict[tuple[str, int], list[CycleResult]] = {}
    e2e: list[E2EResult] = []
    fetches: list[FetchRound] = []
    pipeline = EndToEnd(kafka, 8, workers=args.workers) if "e2e" in args.only else None
    fetch = FetchBench(kafka, 8) if "fetch" in args.only else None
    try:
        if pipeline is not None:
            pipeline.warm_up()
        if fetch is not None:
            fetch.warm_up()
        for r in range(args.rounds):
            for phase in (p for p in PHASES if p in args.only and p in CYCLES):
                for k, payload in payloads.items():
                    with _profiled(args, f"{phase}@{k}-r{r}-{args.groups}g", args.groups, {}):
                        cycles.setdefault((phase, k), []).append(CYCLES[phase](payload, args.groups // k))
            if pipeline is not None:
                children = {f"reassembler-{p.pid}": p.pid for p in pipeline.procs}
                with _profiled(args, f"e2e@8-r{r}-{args.e2e_groups}g", args.e2e_groups, children):
                    e2e.append(pipeline.run_round(args.e2e_groups))
            if fetch is not None:
                with _profiled(args, f"fetch@8-r{r}-{args.fetch_groups}g", args.fetch_groups, {}):
                    fetches.append(fetch.run_round(args.fetch_groups))
                print_round(fetches[-1])
            print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if pipeline is not None:
            pipeline.close()
        if fetch is not None:
            fetch.close()
    return cycles, e2e, fetches, bytes_per_group


def _profiled(args: argparse.Namespace, name: str, groups: int, clients: dict[str, int]):
    if args.profile is None:
        return contextlib.nullcontext()
    return args.profiler.phase(name, groups, {"driver": os.getpid(), **clients})


def _row(name: str, k: int, rates: list[float], bytes_per_group: int) -> str:
    med = statistics.median(rates)
    spread = f"{min(rates):.1f}-{max(rates):.1f}"
    return (
        f"{name:<22} {k:>5} {med:>9.1f} {spread:>13} {med * TOKENS_PER_GROUP:>12,.0f} "
        f"{med * bytes_per_group / 1e6:>9.1f} {1000 * k / med:>9.1f}"
    )


def _print_summary(cycles: dict, e2e: list[E2EResult], bytes_per_group: int) -> None:
    if not cycles and not e2e:
        return
    print(
        f"\ndata plane: groups of 8 rollouts x 2048 tokens (4 calls); {bytes_per_group / 1e3:.0f} kB per group "
        f"(staged deltas + packed rows); median over rounds, spread = min-max"
    )
    print(f"{'':<22} {'grp/c':>5} {'groups/s':>9} {'spread':>13} {'tokens/s':>12} {'MB/s':>9} {'ms/call':>9}")
    names = {"raw": "(a) raw TQ cycle", "rpc": "(b) Ray RPC by value", "memcpy": "(d) memcpy"}
    for (phase, k), results in cycles.items():
        print(_row(names[phase], k, [r.groups_per_s for r in results], bytes_per_group))
    if e2e:
        print(_row("(c) rlstream e2e", 8, [r.groups_per_s for r in e2e], bytes_per_group))
    for phase, label in (("raw", "raw-TQ"), ("rpc", "Ray-RPC")):
        if e2e and (phase, 8) in cycles:
            ratios = [e.groups_per_s / c.groups_per_s for e, c in zip(e2e, cycles[(phase, 8)])]
            per_round = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"e2e/{label} (8 per call): {statistics.median(ratios):.2f}  (per round: {per_round})")


def _print_cycle_ops(cycles: dict) -> None:
    if not cycles:
        return
    print("\nbounds, ms per call in each operation (median round):")
    print(f"{'':<22} {'grp/c':>5} " + " ".join(f"{op:>12}" for op in OPS))
    for (_, k), results in cycles.items():
        per_call = [{op: 1000 * r.ops.get(op, 0.0) / (r.groups / k) for op in OPS} for r in results]
        cells = " ".join(f"{statistics.median(p[op] for p in per_call):>12.2f}" for op in OPS)
        print(f"{results[0].name:<22} {k:>5} {cells}")


def _print_e2e_ops(e2e: list[E2EResult]) -> None:
    if not e2e:
        return
    r = min(e2e, key=lambda x: x.seconds)
    print(
        f"\nend to end, fastest round: {r.groups} groups in {r.seconds:.2f}s; publisher done at "
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
        # 4 CPUs: TQ's controller and 2 storage units take one each; Ray prestarts a worker per CPU.
        stack.callback(init_tq(TQConfig(num_cpus=4)).close)
        cycles, e2e, fetches, bytes_per_group = _measure(args, kafka)
    _print_summary(cycles, e2e, bytes_per_group)
    print_fetch_summary(fetches)
    _print_cycle_ops(cycles)
    _print_e2e_ops(e2e)
    load = ", ".join(f"{x:.1f}" for x in load_before)
    print(f"\nload average (1, 5, 15 min) at start: {load}; at end: {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")
    if args.profiler is not None:
        summarize(args.profile, groups=args.profiler.groups)
    if args.json:
        data = {
            "cycles": {f"{p}@{k}": [vars(r) for r in rs] for (p, k), rs in cycles.items()},
            "e2e": [vars(r) for r in e2e],
            "fetch": [vars(r) for r in fetches],
            "bytes_per_group": bytes_per_group,
        }
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
