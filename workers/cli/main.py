"""The `rlstream` command line: each verb parses its options and calls one library function.

Verbs that need torch or Ray live in `workers.cli.pipeline` and `workers.cli.ops` and are loaded
only when run (or asked for their help), so `rlstream --help` and the broker verbs start fast.
Failures go through `workers.cli.failures`: one line for an expected one, a logged traceback for a bug.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from workers.cli.broker import broker
from workers.cli.failures import STDERR, Funnel, PipeSafeGroup, debug_from_env, keep_log_file
from workers.cli.options import KafkaTarget, KeyValue, kafka_options, say

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
    "top": ("workers.cli.ops:top", "A live view of a run: throughput, lag, staleness, losses, version, TQ rows"),
    "refinalize": ("workers.cli.ops:refinalize", "Rebuild replayed groups from a TQ checkpoint and diff them"),
    "resume": ("workers.cli.ops:resume", "After a whole-job restart: restore what a checkpoint kept, account for all"),
    "trainer": ("workers.cli.trainer:trainer", "Operate on a trainer's consumer group (accept-unresolved)"),
    "example": ("workers.cli.example:example", "Runnable examples: a tiny GRPO run that learns through the pipeline"),
}


class LazyGroup(PipeSafeGroup):
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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--debug",
    is_flag=True,
    help="print the traceback of any failure and log at debug level (also RLSTREAM_DEBUG=1)",
)
def cli(debug: bool) -> None:
    """Stream asynchronous-RL experience exactly once: rollout workers -> Kafka + TQ -> trainer."""
    from workers.telemetry.logs import configure_logging

    ctx = click.get_current_context()
    ctx.params["debug"] = debug = debug or debug_from_env()  # verbs that log more keep DEBUG (reassemble)
    configure_logging(json_lines=False, level=logging.DEBUG if debug else logging.WARNING, stream=STDERR)
    keep_log_file()


@cli.group()
def topics() -> None:
    """Create or list the pipeline topics."""


@topics.command("create")
@kafka_options()
@click.option("--partitions", type=click.IntRange(1, 10_000), default=4, show_default=True)
@click.option(
    "--replication-factor",
    type=click.IntRange(1, 32),
    default=None,
    help="replicas of each topic (default: min(3, brokers in the cluster)); 3 or more sets min.insync.replicas=2",
)
@click.option("--topic-config", multiple=True, type=KeyValue(), metavar="KEY=VALUE",
              help="a topic config for every pipeline topic (e.g. retention.ms=86400000); repeatable")  # fmt: skip
def topics_create(target: KafkaTarget, partitions: int, replication_factor: int | None, topic_config) -> int:
    """Create the receipts, finalized, dead-letter and state topics."""
    from streams.admin import broker_count, create_topics
    from workers.topics import TopicNames, default_replication, pipeline_topics

    prefix = target.prefix or ""
    rf = replication_factor or default_replication(broker_count(target.kafka))
    specs = pipeline_topics(TopicNames(prefix), partitions, rf, dict(topic_config))
    say(f"creating pipeline topics on {target.servers} (prefix {prefix!r}, {partitions} partitions, RF {rf})")
    for name, outcome in create_topics(target.kafka, specs).items():
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


cli.add_command(broker)


def main(argv: list[str] | None = None) -> int:
    """Run `rlstream` with `argv` (default: this process's arguments); returns the exit code."""
    return Funnel(cli, list(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
