"""The `rlstream` command line: each verb parses its options and calls one library function.

Verbs that need torch or Ray live in `workers.cli.pipeline` and `workers.cli.ops` and are loaded
only when run (or asked for their help), so `rlstream --help` and the broker verbs start fast.
Failures go through `workers.cli.failures`: one line for an expected one, a logged traceback for a bug.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import click

from workers.cli.failures import STDERR, Funnel, keep_log_file
from workers.cli.options import KafkaTarget, kafka_options

DEFAULT_DATA_DIR = Path(".rlstream/broker")

# name -> (module:attribute, one-line help shown by `rlstream --help` without importing the module)
LAZY_VERBS = {
    "smoke": ("workers.cli.pipeline:smoke", "Start broker and TQ, round-trip one message and one tensor batch, stop"),
    "reassemble": ("workers.cli.pipeline:reassemble", "Run reassembler workers (one consumer group) until interrupted"),
    "demo": ("workers.cli.pipeline:demo", "Run the whole pipeline locally and account for every group"),
    "replay": ("workers.cli.ops:replay", "Copy a slice of a topic into [prefix.]replay.NAME"),
    "tail": ("workers.cli.ops:tail", "Print a topic's records decoded, one JSON object per line"),
    "inspect": ("workers.cli.ops:inspect", "Everything about one object of a run"),
    "deadletter": ("workers.cli.ops:deadletter", "Operate on the dead-letter topic"),
    "lag": ("workers.cli.ops:lag", "Committed and end offsets of the reassembler and trainer consumer groups"),
    "refinalize": ("workers.cli.ops:refinalize", "Rebuild replayed groups from a TQ checkpoint and diff them"),
}


class LazyGroup(click.Group):
    """A group whose heavier verbs are imported on first use; their short help is known without importing."""

    def list_commands(self, ctx) -> list[str]:
        return sorted({*self.commands, *LAZY_VERBS})

    def get_command(self, ctx, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in LAZY_VERBS:
            return self.commands.get(cmd_name)
        module, _, attr = LAZY_VERBS[cmd_name][0].partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        self.add_command(cmd, cmd_name)
        return cmd

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.commands:
                rows.append((name, self.commands[name].get_short_help_str(80)))
            else:
                rows.append((name, LAZY_VERBS[name][1]))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--debug",
    is_flag=True,
    help="print the traceback of any failure and log at debug level (also RLSTREAM_DEBUG=1)",
)
def cli(debug: bool) -> None:
    """Stream asynchronous-RL experience exactly once: rollout workers -> Kafka + TQ -> trainer."""
    from workers.telemetry.logs import configure_logging

    configure_logging(json_lines=False, level=logging.DEBUG if debug else logging.WARNING, stream=STDERR)
    keep_log_file()


@cli.group()
def broker() -> None:
    """Run a local single-node Kafka broker (KRaft)."""


_data_dir = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA_DIR,
    show_default=True,
    help="the broker's data and log directory",
)


@broker.command("start")
@_data_dir
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="listener port (default: a free one)")
def broker_start(data_dir: Path, port: int | None) -> int:
    """Start in the background and print its bootstrap.servers."""
    from streams.broker import BrokerConfig, start_broker

    cfg = BrokerConfig(data_dir=data_dir, port=port, detached=True)
    _err(f"starting Kafka broker (KRaft, single node) in {cfg.data_dir.resolve()}")
    handle = start_broker(cfg, log=_err)
    print(f"bootstrap.servers={handle.bootstrap_servers}")
    _err(f"pid {handle.pid}, log {handle.log_path}")
    return 0


@broker.command("stop")
@_data_dir
def broker_stop(data_dir: Path) -> int:
    """Stop gracefully, kill after a bound."""
    from streams.broker import stop_broker

    stopped = stop_broker(data_dir)
    print(f"broker in {data_dir} {'stopped' if stopped else 'was not running'}")
    return 0


@broker.command("status")
@_data_dir
def broker_status(data_dir: Path) -> int:
    """Say whether it runs and answers (exit 1 if not)."""
    from streams.broker import broker_status as status

    st = status(data_dir)
    if not st.running:
        print(f"stopped (no broker running from {data_dir})")
        return 1
    print(f"{'ready' if st.ready else 'not answering'} bootstrap.servers={st.bootstrap_servers} pid={st.pid}")
    return 0 if st.ready else 1


@broker.command("fetch")
def broker_fetch() -> int:
    """Fetch the Kafka jars into the cache (once)."""
    from streams.broker import BrokerConfig, ensure_kafka_jars

    path = ensure_kafka_jars(BrokerConfig(data_dir=DEFAULT_DATA_DIR).cache_dir, log=_err)
    print(f"Kafka jars in {path}")
    return 0


@cli.group()
def topics() -> None:
    """Create or list the pipeline topics."""


@topics.command("create")
@kafka_options()
@click.option("--partitions", type=click.IntRange(1, 10_000), default=4, show_default=True)
def topics_create(target: KafkaTarget, partitions: int) -> int:
    """Create the receipts, finalized, dead-letter and state topics."""
    from streams.admin import create_topics
    from workers.topics import TopicNames, pipeline_topics

    prefix = target.prefix or ""
    _err(f"creating pipeline topics on {target.servers} (prefix {prefix!r})")
    for name, outcome in create_topics(target.kafka, pipeline_topics(TopicNames(prefix), partitions)).items():
        print(f"{name}: {outcome}")
    return 0


@topics.command("list")
@kafka_options(prefix=False)
def topics_list(target: KafkaTarget) -> int:
    """List topics and their partition counts."""
    from streams.admin import list_topics

    for name, parts in list_topics(target.kafka).items():
        print(f"{name}\t{parts} partition(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `rlstream` with `argv` (default: this process's arguments); returns the exit code."""
    return Funnel(cli, list(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
