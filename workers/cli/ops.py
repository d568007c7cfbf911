"""Command-line verbs for debugging and operating a run: replay, tail, inspect, deadletter, lag, top, refinalize.

Each verb says on stderr what it does and where (broker, topics, consumer group), then calls one
library function. `--group-id` always names a prompt group; `--consumer-group` a Kafka consumer group.
"""

from __future__ import annotations

import json

import click

from workers.cli.options import KafkaTarget, kafka_options, say
from workers.topics import TopicNames

# Open-ended ends of the --since-ms/--until-ms and --min-wv/--max-wv ranges.
_FAR = 2**62


def _print_json(obj) -> None:
    print(json.dumps(obj, default=str), flush=True)


def _names(target: KafkaTarget) -> TopicNames:
    return TopicNames(target.prefix or "")


def _partition_offsets(ctx, param, value: str | None):
    if value is None:
        return None
    from workers.ops.replay import parse_partition_offsets

    try:
        return parse_partition_offsets(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _span(lo: int | None, hi: int | None) -> tuple[int, int] | None:
    """A range from two optional ends; `replay` refuses an empty one."""
    if lo is None and hi is None:
        return None
    return (lo or 0, hi if hi is not None else _FAR)


@click.command()
@kafka_options()
@click.argument("source")
@click.option("--to", "dest", required=True, metavar="NAME", help="replay name: writes [prefix.]replay.NAME")
@click.option(
    "--partition-offsets",
    metavar="P:FIRST-LAST,...",
    callback=_partition_offsets,
    help="inclusive offset ranges per partition; only those partitions are read",
)
@click.option("--since-ms", type=click.IntRange(min=0), help="records with timestamp >= this (epoch ms)")
@click.option("--until-ms", type=click.IntRange(min=0), help="records with timestamp < this (epoch ms)")
@click.option("--group-id", multiple=True, help="only records of this prompt group; repeatable")
@click.option("--min-wv", type=click.IntRange(min=0), help="weight-version range overlapping [min, max]")
@click.option("--max-wv", type=click.IntRange(min=0))
def replay(
    target: KafkaTarget, source: str, dest: str, partition_offsets, since_ms, until_ms, group_id, min_wv, max_wv
):
    """Copy a slice of topic SOURCE into [prefix.]replay.NAME (same partitions, keys, headers, timestamps)."""
    from workers.ops.replay import replay as copy

    times = _span(since_ms, until_ms)
    wv = _span(min_wv, max_wv)
    say(
        f"replay: copying {source} to {_names(target).replay(dest)} on {target.servers}"
        + (f", offsets {partition_offsets}" if partition_offsets else "")
        + (f", time {times}" if times else "")
        + (f", groups {sorted(group_id)}" if group_id else "")
        + (f", weight versions {wv}" if wv else "")
    )
    report = copy(
        target.kafka,
        source,
        dest,
        prefix=target.prefix or "",
        offsets=partition_offsets,
        time_range_ms=times,
        group_ids=set(group_id) or None,
        weight_versions=wv,
    )
    print("\n".join(report.lines()))
    return 0


@click.command()
@kafka_options()
@click.argument("topic")
@click.option("--from-beginning", is_flag=True, help="start at the oldest record instead of the end")
@click.option("--group-id", help="only records of this prompt group")
@click.option("--max-records", type=click.IntRange(min=1), help="stop after this many records")
@click.option("--idle-exit", type=click.FloatRange(min=0), metavar="S", help="stop after S seconds without a record")
def tail(target: KafkaTarget, topic: str, from_beginning: bool, group_id, max_records, idle_exit) -> int:
    """Print TOPIC's records decoded by its role, one JSON object per line, following new ones."""
    from workers.ops.tail import tail as follow

    say(
        f"tail: {topic} on {target.servers} from the {'beginning' if from_beginning else 'end'}"
        + (f", prompt group {group_id}" if group_id else "")
        + " (Ctrl-C to stop)"
    )
    n = follow(
        target.kafka,
        topic,
        _print_json,
        from_beginning=from_beginning,
        group_id=group_id,
        max_records=max_records,
        idle_exit_s=idle_exit,
    )
    say(f"tail: {n} record(s)")
    return 0


@click.group()
def inspect() -> None:
    """Everything about one object of a run."""


@inspect.command("group")
@kafka_options()
@click.argument("group_id")
@click.option("--ray-address", default="auto", show_default=True, help="Ray cluster holding TQ")
@click.option("--no-tq", is_flag=True, help="do not look into TQ")
def inspect_group(target: KafkaTarget, group_id: str, ray_address: str, no_tq: bool) -> int:
    """A prompt group's receipts, state, finalized record or dead letters, and its rows in TQ (exit 1 if unknown)."""
    from workers.ops.inspect import inspect_group as describe

    names = _names(target)
    store = None
    where = "no TQ"
    if not no_tq:
        from streams.tq import TQConfig, TQStore, init_tq

        init_tq(TQConfig(address=ray_address))
        store = TQStore()
        where = f"TQ on ray {ray_address}"
    say(
        f"inspect: prompt group {group_id} in {names.receipts}, {names.state}, {names.finalized}, "
        f"{names.deadletter} on {target.servers}, {where}"
    )
    report = describe(target.kafka, names, group_id, store=store)
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["summary"]["outcome"] != "unknown" else 1


@click.group()
def deadletter() -> None:
    """Operate on the dead-letter topic."""


@deadletter.command("redrive")
@kafka_options()
@click.option("--reason", help="only letters of this error kind")
@click.option("--to-source", is_flag=True, help="to the topic each letter came from")
@click.option("--to", "to_topic", metavar="TOPIC", help="all to this topic instead")
@click.option(
    "--max-redrives",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="skip letters already redriven this many times",
)
@click.option(
    "--consumer-group",
    default="rlstream.redrive",
    show_default=True,
    help="prefix of the consumer groups that remember which letters were handled",
)
def redrive(target: KafkaTarget, reason, to_source: bool, to_topic, max_redrives: int, consumer_group: str) -> int:
    """Re-publish dead letters (once each, bounded redrives); a dry run unless --to-source or --to."""
    from workers.ops.redrive import redrive as republish

    if to_source and to_topic:
        raise click.UsageError("pass --to-source or --to TOPIC, not both")
    names = _names(target)
    where = "their source topics" if to_source else (to_topic or "nowhere (dry run)")
    say(
        f"deadletter redrive: {names.deadletter} on {target.servers}, kind {reason or 'any'}, to {where}, "
        f"max redrives {max_redrives}, tracked by consumer groups {consumer_group}.<kind>"
    )
    report = republish(
        target.kafka,
        names,
        reason=reason,
        to_source=to_source,
        to_topic=to_topic,
        max_redrives=max_redrives,
        consumer_group=consumer_group,
    )
    print("\n".join(report.lines()))
    return 0


@click.command()
@kafka_options()
@click.option("--consumer-group", default="reassemblers", show_default=True, help="the reassemblers' consumer group")
@click.option("--trainer-consumer-group", default="trainer", show_default=True, help="the trainer's consumer group")
@click.option("--input-topic", help="the reassemblers' input, if not the receipts topic")
def lag(target: KafkaTarget, consumer_group: str, trainer_consumer_group: str, input_topic) -> int:
    """Committed offset, end offset and lag per partition of the reassembler and trainer consumer groups."""
    from workers.ops.lag import lag as measure

    names = _names(target)
    say(
        f"lag: consumer group {consumer_group!r} on {input_topic or names.receipts}, consumer group "
        f"{trainer_consumer_group!r} on {names.finalized}, broker {target.servers}"
    )
    rows = measure(
        target.kafka,
        names,
        reassembler_consumer_group=consumer_group,
        trainer_consumer_group=trainer_consumer_group,
        input_topic=input_topic,
    )
    print("group\ttopic\tpartition\tcommitted\tend\tlag")
    for row in rows:
        print(row.line())
    return 0


@click.command()
@kafka_options()
@click.option("--consumer-group", default="reassemblers", show_default=True, help="the reassemblers' consumer group")
@click.option(
    "--trainer-consumer-group",
    help="the trainer's consumer group (default: the one its latest record on the version topic names)",
)
@click.option(
    "--metrics",
    "endpoints",
    multiple=True,
    metavar="URL",
    help="a Prometheus endpoint of the run (host:port or URL: a reassembler, the pool, the trainer, TQ); repeatable",
)
@click.option(
    "--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True, help="seconds between refreshes"
)
@click.option("--once", is_flag=True, help="print one screen as plain text and exit")
def top(
    target: KafkaTarget, consumer_group: str, trainer_consumer_group, endpoints, interval: float, once: bool
) -> int:
    """A live view of a run: throughput, lag per partition, staleness, evictions, dead letters, trainer version,
    TQ rows held; from Kafka and the metrics endpoints, redrawn until Ctrl-C."""
    import logging
    import os
    import sys

    from workers.cli.failures import keep_log_file
    from workers.ops.top import TopSource, run_top
    from workers.telemetry.logs import configure_logging

    names = _names(target)
    if not once:
        say(
            f"top: {names.receipts} ({consumer_group!r}), {names.finalized} and {names.trainer_version} on "
            f"{target.servers}, {len(endpoints)} metrics endpoint(s) (Ctrl-C to quit)"
        )
        # The screen says what Kafka does; librdkafka's lines (a broker away) would write over it: they go
        # to the log file only while the view runs.
        configure_logging(level=logging.WARNING, stream=open(os.devnull, "w"))  # noqa: SIM115 - for the process
        keep_log_file()
    source = TopSource(
        target.kafka,
        names,
        consumer_group=consumer_group,
        trainer_consumer_group=trainer_consumer_group,
        endpoints=endpoints,
    )
    return run_top(source, sys.stdout, interval_s=interval, once=once)


@click.command()
@kafka_options()
@click.option(
    "--from",
    "source",
    required=True,
    metavar="replay.NAME",
    help="replay topic of receipts (replay.NAME is taken under --prefix)",
)
@click.option(
    "--tq-checkpoint",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="directory written by transfer_queue.save_checkpoint",
)
@click.option("--num-cpus", type=click.IntRange(min=1), default=8, show_default=True, help="CPUs of the local Ray")
def refinalize(target: KafkaTarget, source: str, tq_checkpoint: str, num_cpus: int) -> int:
    """Rebuild replayed groups from a TQ checkpoint in a fresh local Ray/TQ and diff them (exit 1 if different)."""
    import logging

    import ray

    from streams.tq import TQConfig, TQStore, init_tq
    from workers.ops.refinalize import load_tq_checkpoint
    from workers.ops.refinalize import refinalize as rebuild

    names = _names(target)
    topic = f"{names.prefix}.{source}" if source.startswith("replay.") and names.prefix else source
    say(
        f"refinalize: receipts of {topic}, records of {names.finalized} on {target.servers}, tensors "
        f"from TQ checkpoint {tq_checkpoint} in a fresh local Ray/TQ"
    )
    # A fresh local instance: loading a checkpoint replaces TQ state, which must never be production's.
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace="rlstream-refinalize",
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    session = init_tq(TQConfig())
    try:
        load_tq_checkpoint(tq_checkpoint)
        diffs = rebuild(target.kafka, topic, prefix=names.prefix, store=TQStore())
    finally:
        session.close()
        if ray.is_initialized():
            ray.shutdown()
    for d in diffs:
        print(d)
    say(f"refinalize: {len(diffs)} difference(s)")
    return 1 if diffs else 0


@click.command()
@kafka_options()
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="the trainer checkpoint directory the job restarts from (its rlstream-consumer.json and rows.spill);"
    " without one every row still needed is taken as lost",
)
@click.option("--consumer-group", default="reassemblers", show_default=True, help="the reassemblers' consumer group")
@click.option("--trainer-consumer-group", default="trainer", show_default=True, help="the trainer's consumer group")
@click.option(
    "--rollout-consumer-group",
    default=None,
    help="the rollout workers' RegenerateFeed consumer group: hand-backs they generated before the job died are"
    " settled there, so none is generated twice (default: not settled)",
)
@click.option(
    "--reassembler-worker-id",
    "worker_ids",
    multiple=True,
    help="a worker id of the dead job's reassemblers (repeat it; `--worker-id W --workers 2` runs W-0 and W-1):"
    " a transaction it left open is aborted at once instead of waited out",
)
@click.option(
    "--transaction-wait-s",
    type=click.FloatRange(0, 3600),
    default=960.0,
    show_default=True,
    help="how long resume may wait in all: for the dead job's members to leave their consumer groups (a"
    " killed one goes at its session timeout), for transactions it left open, for offsets they held",
)
@click.option(
    "--force",
    is_flag=True,
    help="do not wait for the consumer groups' members to leave (they are known gone for good), and settle a"
    " rollout consumer group that has no commit",
)
@click.option("--ray-address", default="auto", show_default=True, help="the restarted job's Ray, with TQ up")
def resume(
    target: KafkaTarget,
    checkpoint,
    consumer_group: str,
    trainer_consumer_group: str,
    rollout_consumer_group: str | None,
    worker_ids: tuple[str, ...],
    transaction_wait_s: float,
    force: bool,
    ray_address: str,
) -> int:
    """After a whole-job restart, before reassemblers, trainer and rollout workers start: put back the rows the
    checkpoint kept and account for every group (exit 1 if any is unaccounted for)."""
    from streams.tq import TQConfig, TQStore, init_tq
    from workers.trainer.config import ConsumerConfig
    from workers.trainer.resume import resume as reconcile

    names = _names(target)
    say(
        f"resume: topics {names.prefix or '(no prefix)'}.* on {target.servers}, trainer consumer group"
        f" {trainer_consumer_group!r}, reassemblers {consumer_group!r}, rollout workers"
        f" {rollout_consumer_group or '(not settled)'}, checkpoint {checkpoint or 'none'}, Ray {ray_address}"
    )
    session = init_tq(TQConfig(address=ray_address))
    if session.started_tq:
        # Closing a TQ this process created would take every row it restored with it.
        session.close()
        say(f"resume: no TQ runs in the Ray at {ray_address}: start the job's Ray and TQ first, then resume")
        return 1
    try:
        config = ConsumerConfig(prefix=names.prefix, consumer_group=trainer_consumer_group, checkpointed=True)
        report = reconcile(
            target.kafka,
            TQStore(),
            config,
            checkpoint,
            reassembler_consumer_group=consumer_group,
            rollout_consumer_group=rollout_consumer_group,
            reassembler_worker_ids=worker_ids,
            transaction_wait_s=transaction_wait_s,
            force=force,
            say=say,
        )
    finally:
        session.close()
    for line in report.lines():
        print(line)
    if report.unaccounted:
        say(f"resume: {len(report.unaccounted)} group(s) unaccounted for")
        return 1
    return 0
