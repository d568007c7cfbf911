"""Command-line verbs that run the pipeline: smoke, reassemble, demo.

Loaded only when one of them runs: the settings their flags derive from import torch.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import click
import msgspec

from streams.settings import load
from workers.cli.failures import STDERR, keep_log_file
from workers.cli.options import KafkaTarget, given_flags, kafka_options, say, settings_options
from workers.demo.config import DemoConfig
from workers.reassembler.config import ReassemblerConfig


@click.command()
@kafka_options(required=False, prefix=False)
def smoke(target: KafkaTarget) -> int:
    """Start broker and TQ, round-trip one message and one tensor batch, stop (a one-minute machine check)."""
    from workers.demo.smoke import run_smoke

    k = target.kafka
    res = run_smoke(k.bootstrap_servers if k else None, client_settings=k.client_settings if k else None, log=say)
    print(f"smoke ok in {res.seconds:.1f}s: bootstrap.servers={res.bootstrap_servers}")
    return 0


@click.command(
    epilog="Settings come from defaults < the [reassembler] section of --config < RLSTREAM_REASSEMBLER_<FIELD> "
    "variables < flags; the cluster likewise from [kafka] and RLSTREAM_KAFKA_*."
)
@kafka_options()
@settings_options(ReassemblerConfig, into="settings", exclude=("prefix",))
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="worker processes")
@click.option("--ray-address", default="auto", show_default=True, help="Ray cluster holding TQ")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="serve Prometheus /metrics on this port (0: a free one, logged); with --workers N, worker i uses "
    "PORT+i and the pool's supervision (restarts, exits, spare) PORT+N (or a free one each for 0)",
)
@click.option(
    "--spare/--no-spare",
    "keep_spare",
    default=True,
    show_default=True,
    help="with --workers N: keep one more process attached to Ray that takes over a crashed worker's id and "
    "partitions at once (the workers join with static membership)",
)
@click.option("--log-json", is_flag=True, help="log one JSON object per line")
@click.option("--config-stdin", is_flag=True, hidden=True, help="internal: read the whole worker spec from stdin")
@click.pass_context
def reassemble(
    ctx: click.Context,
    target: KafkaTarget,
    settings: dict,
    workers: int,
    ray_address: str,
    metrics_port: int | None,
    keep_spare: bool,
    log_json: bool,
    config_stdin: bool,
) -> int:
    """Run reassembler workers (one consumer group) until interrupted."""
    from streams.tq import TQConfig
    from workers.ops.replay_run import prepare_replay_run
    from workers.reassembler.run import run_pool, serve_pool_metrics

    if config_stdin:
        return _run_child(ctx)
    debug = bool(ctx.find_root().params.get("debug"))
    say = _configure_logging(log_json, debug)
    config = load(ReassemblerConfig, file=target.config_file, overrides={**settings, "prefix": target.prefix})
    if keep_spare and workers > 1 and config.worker_id:
        # Stable ids: a spare (or a whole pool started again) rejoins as the same static members.
        # Not with random ones: static members do not leave on a clean stop, so a new pool's
        # members would wait a session timeout for the old ones' partitions.
        config = msgspec.structs.replace(config, static_membership=True)
    if not config.worker_id:
        config = msgspec.structs.replace(config, worker_id=f"w{uuid.uuid4().hex[:6]}")
    # A replay topic as input: refuse production's group and prefix, write rows to a TQ partition of its own.
    config = prepare_replay_run(target.kafka, config)
    tq = TQConfig(address=ray_address)
    say(
        f"reassemble: {workers} worker(s), consumer group {config.consumer_group!r}, input {config.receipts_topic}, "
        f"outputs {config.topics.finalized} / {config.topics.deadletter} / {config.topics.state}, "
        f"TQ train partition {config.actor.partition_id!r}, broker {target.kafka.bootstrap_servers}, ray {tq.address}"
    )
    if workers == 1:
        from workers.reassembler.run import serve_worker

        return serve_worker(target.kafka, config, tq, metrics_port, say)
    return run_pool(
        target.kafka,
        config,
        tq,
        workers,
        log=say,
        metrics_port=metrics_port,
        log_json=log_json,
        debug=debug,
        keep_spare=keep_spare,
        sensor=None if metrics_port is None else serve_pool_metrics(config, metrics_port, workers, say),
    )


def _configure_logging(log_json: bool, debug: bool) -> Callable[[str], None]:
    """Workers log their progress at INFO; `rlstream --debug` (or the parent's, for a child) keeps DEBUG."""
    from workers.telemetry.logs import configure_logging

    configure_logging(json_lines=log_json, level=logging.DEBUG if debug else logging.INFO, stream=STDERR)
    keep_log_file()
    return logging.getLogger("rlstream.reassemble").info if log_json else say


def _run_child(ctx: click.Context) -> int:
    """A worker started by `run_pool`: its whole spec is on stdin, so no other flag may be given."""
    from workers.reassembler.run import run_child

    extra = given_flags(ctx, ignore=("config_stdin",))
    if extra:
        raise click.UsageError(f"--config-stdin takes its settings from stdin only, not from {', '.join(extra)}")
    return run_child(sys.stdin.buffer, _configure_logging)


@click.command(
    epilog="Settings come from defaults < the [demo] section of --config < RLSTREAM_DEMO_<FIELD> variables < flags."
)
@kafka_options(required=False, prefix_help="topic prefix (default: a fresh demo-<id>)")
@settings_options(
    DemoConfig, into="settings", exclude=("bootstrap_servers", "prefix"), aliases={"timeout_s": ["--timeout"]}
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="also write the figures")
def demo(target: KafkaTarget, settings: dict, json_path: Path | None) -> int:
    """Run the whole pipeline locally and account for every group (exit 1 if one is not)."""
    from workers.actors.kafka_secrets import kafka_files
    from workers.demo.run import run_demo, summary_table, write_json

    kafka = target.kafka
    overrides = {**settings, "prefix": target.prefix, "bootstrap_servers": kafka.bootstrap_servers if kafka else None}
    cfg = load(DemoConfig, file=target.config_file, overrides=overrides)
    files = kafka_files(target.kafka_config, target.config_file)  # where the actors read their secrets
    report = run_demo(cfg, log=say, client_settings=kafka.client_settings if kafka else None, kafka_files=files)
    print(summary_table(report), flush=True)
    if json_path is not None:
        write_json(report, json_path)
        say(f"figures written to {json_path}")
    if not report.accounted:
        say(f"rlstream demo: not every group was accounted for exactly once: {'; '.join(report.problems)}")
        return 1
    return 0
