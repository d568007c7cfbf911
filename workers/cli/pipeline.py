"""Command-line verbs that run the pipeline: smoke, reassemble, demo."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from streams.config import KafkaConfig, parse_client_settings
from streams.tq import TQConfig


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_smoke(args) -> int:
    from workers.demo.smoke import run_smoke

    res = run_smoke(args.bootstrap_servers, log=_err)
    print(f"smoke ok in {res.seconds:.1f}s: bootstrap.servers={res.bootstrap_servers}")
    return 0


def cmd_reassemble(args) -> int:
    from workers.ops.replay_run import prepare_replay_run
    from workers.reassembler.config import ReassemblerConfig
    from workers.reassembler.run import run_pool, run_worker
    from workers.telemetry.logs import configure_logging

    configure_logging(json_lines=args.log_json)
    say = logging.getLogger("rlstream.reassemble").info if args.log_json else _err
    kafka = KafkaConfig(args.bootstrap_servers, parse_client_settings(args.kafka_setting))
    config = ReassemblerConfig(
        prefix=args.prefix,
        worker_id=args.worker_id or f"w{uuid.uuid4().hex[:6]}",
        consumer_group=args.group,
        input_topic=args.input_topic,
        group_timeout_s=args.group_timeout,
        max_open_groups=args.max_open_groups,
        crash_point=args.crash_point,
    )
    # A replay topic as input: refuse production's group and prefix, write rows to a TQ partition of its own.
    config = prepare_replay_run(kafka, config)
    tq = TQConfig(address=args.ray_address)
    say(
        f"reassemble: {args.workers} worker(s), group {config.group_id!r}, input {config.receipts_topic}, "
        f"outputs {config.topics.finalized} / {config.topics.deadletter} / {config.topics.state}, "
        f"TQ train partition {config.actor.partition_id!r}, broker {kafka.bootstrap_servers}, ray {tq.address}"
    )
    if args.workers == 1:
        metrics = None
        if args.metrics_port is not None:
            from workers.telemetry.prometheus import reassembler_metrics, start_metrics_server

            metrics = reassembler_metrics()
            say(f"metrics: http://0.0.0.0:{start_metrics_server(args.metrics_port)}/metrics")
        run_worker(kafka, config, tq, log=say, metrics=metrics)
        return 0
    return run_pool(kafka, config, tq, args.workers, log=say, metrics_port=args.metrics_port, log_json=args.log_json)


def cmd_demo(args) -> int:
    from pathlib import Path

    from workers.demo.run import DemoConfig, run_demo, summary_table, write_json

    cfg = DemoConfig(
        bootstrap_servers=args.bootstrap_servers,
        prefix=args.prefix or None,
        ray_address=args.ray_address,
        groups=args.groups,
        producers=args.producers,
        reassemblers=args.reassemblers,
        external_reassemblers=args.external_reassemblers,
        policy=args.policy,
        max_staleness=args.max_staleness,
        timeout_s=args.timeout,
    )
    report = run_demo(cfg, log=_err)
    print(summary_table(report), flush=True)
    if args.json:
        write_json(report, Path(args.json))
        _err(f"figures written to {args.json}")
    if not report.accounted:
        _err(f"rlstream demo: not every group was accounted for exactly once: {'; '.join(report.problems)}")
        return 1
    return 0


def register(sub, add_kafka_args) -> None:
    from workers.reassembler.config import CRASH_POINTS

    p = sub.add_parser("smoke", help="start broker and TQ, round-trip one message and one tensor batch, stop")
    p.add_argument("--bootstrap-servers", default=None, help="use this cluster instead of starting a broker")
    p.set_defaults(func=cmd_smoke)

    p = sub.add_parser("reassemble", help="run reassembler workers (a consumer group) until interrupted")
    add_kafka_args(p)
    p.add_argument("--workers", type=int, default=1, help="number of worker processes")
    p.add_argument("--group", default="reassemblers", help="consumer group id")
    p.add_argument(
        "--worker-id",
        default=None,
        help="stable id; a restarted worker with the same id fences its predecessor's transactions at once",
    )
    p.add_argument("--ray-address", default="auto", help="Ray cluster holding TQ (default: the local one)")
    p.add_argument("--input-topic", default=None, help="read receipts from this topic (e.g. a replay topic)")
    p.add_argument(
        "--group-timeout",
        type=float,
        default=30.0,
        help="seconds from a group's first receipt until it is finalized incomplete",
    )
    p.add_argument("--max-open-groups", type=int, default=10_000)
    p.add_argument("--crash-point", choices=CRASH_POINTS, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port "
        "(0: a free one, logged); with --workers N, worker i uses PORT+i (or a free one for 0)",
    )
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.set_defaults(func=cmd_reassemble)

    p = sub.add_parser("demo", help="run the whole pipeline locally and account for every group")
    p.add_argument("--bootstrap-servers", default=None, help="use this cluster instead of starting a local broker")
    p.add_argument("--prefix", default="", help="topic prefix (default: a fresh demo-<id>)")
    p.add_argument("--ray-address", default=None, help="attach to this Ray cluster instead of starting one")
    p.add_argument("--groups", type=int, default=160, help="prompt groups to produce")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--reassemblers", type=int, default=2, help="reassembler Ray actors")
    p.add_argument(
        "--external-reassemblers",
        action="store_true",
        help="do not start reassemblers; they run elsewhere (e.g. docker compose)",
    )
    p.add_argument("--policy", default="windowed", choices=("windowed", "in_order", "ready_first"))
    p.add_argument("--max-staleness", type=int, default=2, help="staleness bound (or in_order lookahead)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.set_defaults(func=cmd_demo)
