"""`rlstream trainer ...`: operating on a trainer's consumer group.

`accept-unresolved` is the way out for a partition the trainer does not read because the progress entry
its commit names is gone (`workers/ops/unresolved.py`): it says what that costs, and writes only with
`--yes`.
"""

from __future__ import annotations

import click

from workers.cli.options import KafkaTarget, kafka_options, say
from workers.topics import TopicNames


@click.group()
def trainer() -> None:
    """Operate on a trainer's consumer group."""


@trainer.command("accept-unresolved")
@kafka_options()
@click.option("--partition", type=click.IntRange(min=0), required=True, help="the finalized topic's partition")
@click.option("--consumer-group", default="trainer", show_default=True, help="the trainer's consumer group")
@click.option("--input-topic", help="the trainer's input, if not the prefix's finalized topic")
@click.option("--yes", is_flag=True, help="write it; without --yes the command says what it would do and exits 1")
def accept_unresolved(target: KafkaTarget, partition: int, consumer_group: str, input_topic, yes: bool) -> int:
    """Let the trainer read a partition again when the progress entry its commit names is gone, accepting that
    nothing is resolved past the commit: groups trained past it are handed back or trained a second time."""
    from workers.ops.unresolved import accept_unresolved as accept
    from workers.ops.unresolved import find_blocked

    names = TopicNames(target.prefix or "")
    topic = input_topic or names.finalized
    say(
        f"trainer accept-unresolved: commit of consumer group {consumer_group!r} on {topic}[{partition}],"
        f" progress entries on {names.trainer_progress}, broker {target.servers}"
    )
    blocked = find_blocked(target.kafka, consumer_group, topic, names.trainer_progress, partition)
    say(f"WARNING: {blocked.warning()}")
    if not yes:
        say("trainer accept-unresolved: nothing written; run again with --yes to accept it")
        return 1
    accept(target.kafka, consumer_group, names.trainer_progress, blocked)
    print(
        f"{topic}[{partition}]: entry {blocked.token!r} written to {names.trainer_progress}, naming nothing resolved"
        f" past offset {blocked.offset}; the trainer reads the partition from there at its next try (30 s at most)"
    )
    return 0
