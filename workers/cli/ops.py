"""Command-line verbs for debugging and operating a run: replay, tail, inspect, deadletter, lag, refinalize.

Each verb says on stderr what it does and where (broker, topics, group), then calls one library
function; `cli.main` turns ValueError/RuntimeError into a one-line reason and a non-zero exit.
"""

from __future__ import annotations

import functools
import json
import sys

from streams.config import KafkaConfig, parse_client_settings
from workers.topics import TopicNames


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _kafka(args) -> KafkaConfig:
    return KafkaConfig(args.bootstrap_servers, parse_client_settings(args.kafka_setting))


def _kafka_errors(fn):
    """Turn a client error (KafkaException is no RuntimeError) into the one-line failure cli.main prints."""

    @functools.wraps(fn)
    def run(args) -> int:
        from confluent_kafka import KafkaException

        try:
            return fn(args)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else exc
            raise RuntimeError(err.str() if hasattr(err, "str") else str(err)) from None

    return run


def _print_json(obj) -> None:
    print(json.dumps(obj, default=str), flush=True)


@_kafka_errors
def cmd_replay(args) -> int:
    from workers.ops.replay import parse_partition_offsets, replay

    offsets = parse_partition_offsets(args.partition_offsets) if args.partition_offsets else None
    times = None
    if args.since_ms is not None or args.until_ms is not None:
        times = (args.since_ms or 0, args.until_ms if args.until_ms is not None else 2**62)
    wv = None
    if args.min_wv is not None or args.max_wv is not None:
        wv = (args.min_wv or 0, args.max_wv if args.max_wv is not None else 2**62)
    dest = TopicNames(args.prefix).replay(args.to)
    _err(
        f"replay: copying {args.source} to {dest} on {args.bootstrap_servers}"
        + (f", offsets {args.partition_offsets}" if offsets else "")
        + (f", time {times}" if times else "")
        + (f", groups {sorted(args.group_id)}" if args.group_id else "")
        + (f", weight versions {wv}" if wv else "")
    )
    report = replay(
        _kafka(args),
        args.source,
        args.to,
        prefix=args.prefix,
        offsets=offsets,
        time_range_ms=times,
        group_ids=set(args.group_id) if args.group_id else None,
        weight_versions=wv,
    )
    print("\n".join(report.lines()))
    return 0


@_kafka_errors
def cmd_tail(args) -> int:
    from workers.ops.inspect import tail

    _err(
        f"tail: {args.topic} on {args.bootstrap_servers} from the "
        f"{'beginning' if args.from_beginning else 'end'}"
        + (f", group {args.group_id}" if args.group_id else "")
        + " (Ctrl-C to stop)"
    )
    n = tail(
        _kafka(args),
        args.topic,
        _print_json,
        from_beginning=args.from_beginning,
        group_id=args.group_id,
        max_records=args.max_records,
        idle_exit_s=args.idle_exit,
    )
    _err(f"tail: {n} record(s)")
    return 0


@_kafka_errors
def cmd_inspect_group(args) -> int:
    from workers.ops.inspect import inspect_group

    names = TopicNames(args.prefix)
    store = None
    where = "no TQ"
    if not args.no_tq:
        from streams.tq import TQConfig, TQStore, init_tq

        init_tq(TQConfig(address=args.ray_address))
        store = TQStore()
        where = f"TQ on ray {args.ray_address}"
    _err(
        f"inspect: group {args.group_id} in {names.receipts}, {names.state}, {names.finalized}, "
        f"{names.deadletter} on {args.bootstrap_servers}, {where}"
    )
    report = inspect_group(_kafka(args), names, args.group_id, store=store)
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["summary"]["outcome"] != "unknown" else 1


@_kafka_errors
def cmd_redrive(args) -> int:
    from workers.ops.redrive import redrive

    names = TopicNames(args.prefix)
    target = "their source topics" if args.to_source else (args.to or "nowhere (dry run)")
    _err(
        f"deadletter redrive: {names.deadletter} on {args.bootstrap_servers}, kind {args.reason or 'any'}, "
        f"to {target}, max redrives {args.max_redrives}, tracked by groups {args.consumer_group}.<kind>"
    )
    report = redrive(
        _kafka(args),
        names,
        reason=args.reason,
        to_source=args.to_source,
        to_topic=args.to,
        max_redrives=args.max_redrives,
        consumer_group=args.consumer_group,
    )
    print("\n".join(report.lines()))
    return 0


@_kafka_errors
def cmd_lag(args) -> int:
    from workers.ops.inspect import lag

    names = TopicNames(args.prefix)
    _err(
        f"lag: group {args.group!r} on {args.input_topic or names.receipts}, group {args.trainer_group!r} "
        f"on {names.finalized}, broker {args.bootstrap_servers}"
    )
    rows = lag(
        _kafka(args),
        names,
        reassembler_group=args.group,
        trainer_group=args.trainer_group,
        input_topic=args.input_topic,
    )
    print("group\ttopic\tpartition\tcommitted\tend\tlag")
    for row in rows:
        print(row.line())
    return 0


@_kafka_errors
def cmd_refinalize(args) -> int:
    import logging

    import ray

    from streams.tq import TQConfig, TQStore, init_tq
    from workers.ops.refinalize import load_tq_checkpoint, refinalize

    names = TopicNames(args.prefix)
    topic = args.source
    if topic.startswith("replay.") and args.prefix:
        topic = f"{args.prefix}.{topic}"
    _err(
        f"refinalize: receipts of {topic}, records of {names.finalized} on {args.bootstrap_servers}, tensors "
        f"from TQ checkpoint {args.tq_checkpoint} in a fresh local Ray/TQ"
    )
    # A fresh local instance: loading a checkpoint replaces TQ state, which must never be production's.
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        namespace="rlstream-refinalize",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    session = init_tq(TQConfig())
    try:
        load_tq_checkpoint(args.tq_checkpoint)
        diffs = refinalize(_kafka(args), topic, prefix=args.prefix, store=TQStore())
    finally:
        session.close()
        if ray.is_initialized():
            ray.shutdown()
    for d in diffs:
        print(d)
    _err(f"refinalize: {len(diffs)} difference(s)")
    return 1 if diffs else 0


def register(sub, add_kafka_args) -> None:
    p = sub.add_parser(
        "replay", help="copy a slice of a topic into replay.<NAME> (same partitions, keys, headers, timestamps)"
    )
    add_kafka_args(p)
    p.add_argument("source", help="source topic (full name)")
    p.add_argument("--to", required=True, metavar="NAME", help="replay name: writes [prefix.]replay.NAME")
    p.add_argument("--partition-offsets", metavar="P:FIRST-LAST,...", help="inclusive offset ranges per partition")
    p.add_argument("--since-ms", type=int, help="records with timestamp >= this (epoch ms)")
    p.add_argument("--until-ms", type=int, help="records with timestamp < this (epoch ms)")
    p.add_argument("--group-id", action="append", help="only this prompt group; repeatable")
    p.add_argument("--min-wv", type=int, help="weight-version range overlapping [min, max]")
    p.add_argument("--max-wv", type=int)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("tail", help="print a topic's records decoded, one JSON object per line, following new ones")
    add_kafka_args(p)
    p.add_argument("topic")
    p.add_argument("--from-beginning", action="store_true")
    p.add_argument("--group-id", help="only records of this prompt group")
    p.add_argument("--max-records", type=int, help="stop after this many records")
    p.add_argument("--idle-exit", type=float, metavar="S", help="stop after S seconds without a new record")
    p.set_defaults(func=cmd_tail)

    inspect = sub.add_parser("inspect", help="everything about one object of a run").add_subparsers(
        dest="what", required=True
    )
    p = inspect.add_parser(
        "group", help="a prompt group's receipts, state, finalized record or dead letters, and its rows in TQ"
    )
    add_kafka_args(p)
    p.add_argument("group_id")
    p.add_argument("--ray-address", default="auto", help="Ray cluster holding TQ (default: the local one)")
    p.add_argument("--no-tq", action="store_true", help="do not look into TQ")
    p.set_defaults(func=cmd_inspect_group)

    dl = sub.add_parser("deadletter", help="operate on the dead-letter topic").add_subparsers(
        dest="action", required=True
    )
    p = dl.add_parser(
        "redrive", help="re-publish dead letters (once each, bounded redrives); dry run unless --to-source or --to"
    )
    add_kafka_args(p)
    p.add_argument("--reason", help="only letters of this error kind")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--to-source", action="store_true", help="to the topic each letter came from")
    target.add_argument("--to", metavar="TOPIC", help="all to this topic instead")
    p.add_argument("--max-redrives", type=int, default=1, help="skip letters already redriven this many times")
    p.add_argument(
        "--consumer-group",
        default="rlstream.redrive",
        help="prefix of the groups that remember which letters were handled",
    )
    p.set_defaults(func=cmd_redrive)

    p = sub.add_parser(
        "lag", help="committed offset, end offset and lag per partition of the reassembler and trainer groups"
    )
    add_kafka_args(p)
    p.add_argument("--group", default="reassemblers", help="reassembler consumer group")
    p.add_argument("--trainer-group", default="trainer", help="trainer consumer group")
    p.add_argument("--input-topic", help="the reassemblers' input, if not the receipts topic")
    p.set_defaults(func=cmd_lag)

    p = sub.add_parser(
        "refinalize",
        help="rebuild replayed groups from a TQ checkpoint in a fresh local Ray/TQ "
        "and diff against the finalized records; exit 1 if they differ",
    )
    add_kafka_args(p)
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="replay.NAME",
        help="replay topic of receipts (replay.NAME is taken under --prefix)",
    )
    p.add_argument("--tq-checkpoint", required=True, help="directory written by transfer_queue.save_checkpoint")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray instance")
    p.set_defaults(func=cmd_refinalize)
