"""The `rlstream` command line: each verb parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import KafkaException

from streams.admin import create_topics, list_topics
from streams.broker import BrokerConfig, BrokerError, broker_status, ensure_kafka_jars, start_broker, stop_broker
from streams.config import KafkaConfig, parse_client_settings
from workers.topics import TopicNames, pipeline_topics

DEFAULT_DATA_DIR = Path(".rlstream/broker")


def _kafka(args) -> KafkaConfig:
    return KafkaConfig(args.bootstrap_servers, parse_client_settings(args.kafka_setting))


def _add_kafka_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--bootstrap-servers", required=required, help="Kafka bootstrap servers, host:port[,...]")
    p.add_argument(
        "-X",
        "--kafka-setting",
        action="append",
        metavar="KEY=VALUE",
        help="extra client setting passed to every Kafka client (SASL, TLS, ...); repeatable",
    )
    p.add_argument("--prefix", default="", help="topic name prefix, so several runs can share a cluster")


def cmd_broker_start(args) -> int:
    cfg = BrokerConfig(data_dir=args.data_dir, port=args.port, detached=True)
    print(f"starting Kafka broker (KRaft, single node) in {cfg.data_dir.resolve()}", file=sys.stderr)
    handle = start_broker(cfg, log=lambda m: print(m, file=sys.stderr))
    print(f"bootstrap.servers={handle.bootstrap_servers}")
    print(f"pid {handle.pid}, log {handle.log_path}", file=sys.stderr)
    return 0


def cmd_broker_stop(args) -> int:
    stopped = stop_broker(args.data_dir)
    print(f"broker in {args.data_dir} {'stopped' if stopped else 'was not running'}")
    return 0


def cmd_broker_status(args) -> int:
    st = broker_status(args.data_dir)
    if not st.running:
        print(f"stopped (no broker running from {args.data_dir})")
        return 1
    print(f"{'ready' if st.ready else 'not answering'} bootstrap.servers={st.bootstrap_servers} pid={st.pid}")
    return 0 if st.ready else 1


def cmd_broker_fetch(args) -> int:
    path = ensure_kafka_jars(BrokerConfig(data_dir=DEFAULT_DATA_DIR).cache_dir, log=lambda m: print(m, file=sys.stderr))
    print(f"Kafka jars in {path}")
    return 0


def cmd_topics_create(args) -> int:
    names = TopicNames(args.prefix)
    print(f"creating pipeline topics on {args.bootstrap_servers} (prefix {args.prefix!r})", file=sys.stderr)
    for name, outcome in create_topics(_kafka(args), pipeline_topics(names, args.partitions)).items():
        print(f"{name}: {outcome}")
    return 0


def cmd_topics_list(args) -> int:
    for name, parts in list_topics(_kafka(args)).items():
        print(f"{name}\t{parts} partition(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlstream", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)

    broker = sub.add_parser("broker", help="run a local single-node Kafka broker").add_subparsers(
        dest="action", required=True
    )
    for name, fn, hlp in (
        ("start", cmd_broker_start, "start in the background and print its address"),
        ("stop", cmd_broker_stop, "stop gracefully, kill after a bound"),
        ("status", cmd_broker_status, "say whether it runs and answers"),
    ):
        p = broker.add_parser(name, help=hlp)
        p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
        if name == "start":
            p.add_argument("--port", type=int, default=None, help="listener port (default: a free one)")
        p.set_defaults(func=fn)
    broker.add_parser("fetch", help="fetch the Kafka jars into the cache (once)").set_defaults(func=cmd_broker_fetch)

    topics = sub.add_parser("topics", help="create or list the pipeline topics").add_subparsers(
        dest="action", required=True
    )
    p = topics.add_parser("create", help="create receipts, finalized, dead-letter and state topics")
    _add_kafka_args(p)
    p.add_argument("--partitions", type=int, default=4)
    p.set_defaults(func=cmd_topics_create)
    p = topics.add_parser("list", help="list topics and partition counts")
    _add_kafka_args(p)
    p.set_defaults(func=cmd_topics_list)

    for register in _extra_verbs():
        register(sub, _add_kafka_args)
    return parser


def _extra_verbs() -> list[Callable]:
    # Heavier verbs live in their own modules and import torch/ray only when they run.
    from workers.cli import ops as cli_tools
    from workers.cli import pipeline as cli_pipeline

    return [cli_pipeline.register, cli_tools.register]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BrokerError, ValueError, RuntimeError, TimeoutError, OSError, KeyError, KafkaException) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"rlstream {args.verb}: {first}", file=sys.stderr)
        rest = str(exc).splitlines()[1:]
        if rest:
            print("\n".join(rest), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
