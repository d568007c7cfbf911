"""What the trainer's standing commits name consumed, read as a restarted trainer would, and the one limit
the explorer scales down so that its few groups reach the path many groups take.

`named_consumed` is the audit's evidence that a record must never be trained again by a trainer
without checkpoints: before the committed offset, or in the resolved ranges the commit names
(inline in its metadata, or in the progress-topic entry the metadata names, `workers/trainer/progress.py`).

`scaled_limits` cuts the commit metadata a commit may carry inline from 3,500 characters (about 870
ranges; a run of ten prompts never gets near) to a few ranges, for the length of a run: the ranges
past it go to the progress topic as they do at scale (issue 30 item 3b), so every run with a few
resolved records out of order takes that path. It is the harness's, as the models' configs are:
nothing in production reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from schemas.trainer_progress import TrainerProgress, join_chunks
from tests.tools.explore.components import NAMES, TRAINER_GROUP
from workers.trainer import progress
from workers.trainer.position import carried, decode_ranges, encode_ranges

if TYPE_CHECKING:
    from tests.tools.explore.world import World
    from tests.tools.sim.kafka import KafkaCluster

INLINE_METADATA_CHARS = 19  # the prefix alone: any range past the offset goes to the progress topic


@contextlib.contextmanager
def scaled_limits() -> Iterator[None]:
    real = progress.encode_ranges

    def encode(base, ranges, limit=INLINE_METADATA_CHARS):
        return encode_ranges(base, ranges, min(limit, INLINE_METADATA_CHARS))

    progress.encode_ranges = encode
    try:
        yield
    finally:
        progress.encode_ranges = real


def named_consumed(world: World) -> set[tuple[int, int]]:
    """(partition, offset) of every finalized record the trainer's standing commits name consumed:
    before the committed offset, or in the resolved ranges it names (inline, or in its progress entry)."""
    group = world.cluster.groups.groups.get(TRAINER_GROUP)
    named: set[tuple[int, int]] = set()
    if group is None:
        return named
    chunks = None
    for (topic, part), (offset, metadata) in group.offsets.items():
        if topic != NAMES.finalized or offset < 0:
            continue
        named |= {(part, o) for o in range(offset)}
        entry = carried(metadata)
        if entry is None:
            ranges = decode_ranges(offset, metadata)
        else:  # the ranges are on the progress topic, in the entry the metadata names
            if chunks is None:
                values = _values(world.cluster, NAMES.trainer_progress)
                chunks = [TrainerProgress.from_bytes(e.value) for e in values]
            ranges = join_chunks([c for c in chunks if c.partition == part], offset, *entry)
        for first, last in ranges:
            named |= {(part, o) for o in range(first, last + 1)}
    return named


def _values(cluster: KafkaCluster, topic: str) -> list:
    """The committed records of `topic` that have a value (tombstones left out)."""
    if topic not in cluster.topics:
        return []
    return [e for p in range(len(cluster.topics[topic].logs)) for e in cluster.records(topic, p) if e.value]
