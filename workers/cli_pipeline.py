"""Command-line verbs that run the pipeline: smoke, demo, reassemble."""

from __future__ import annotations

import sys


def cmd_smoke(args) -> int:
    from workers.smoke import run_smoke

    res = run_smoke(args.bootstrap_servers, log=lambda m: print(m, file=sys.stderr))
    print(f"smoke ok in {res.seconds:.1f}s: bootstrap.servers={res.bootstrap_servers}")
    return 0


def register(sub, add_kafka_args) -> None:
    p = sub.add_parser("smoke", help="start broker and TQ, round-trip one message and one tensor batch, stop")
    p.add_argument("--bootstrap-servers", default=None, help="use this cluster instead of starting a broker")
    p.set_defaults(func=cmd_smoke)
