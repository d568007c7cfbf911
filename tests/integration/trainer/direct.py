"""Finalized records written straight to the real broker, with their train rows in the real TQ.

For trainer tests that need records in a given order and partition (the reassembler finalizes in an
order of its own): the trainer reads exactly what a reassembler would have committed.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from schemas.finalized import FinalizedGroup
from streams.producer import AckedProducer, Outgoing
from streams.tq import TRAIN
from workers.topics import TopicNames


def finalized(group_id: str, weight_version: int = 0, rows: int = 1) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=group_id,
        prompt_idx=0,
        partition_id=TRAIN,
        sample_ids=tuple(f"{group_id}_g{i}" for i in range(rows)),
        tags=tuple({"weight_version": weight_version} for _ in range(rows)),
        group_min_wv=weight_version,
        group_max_wv=weight_version,
        canonical_output_tokens=1,
        valid_row_count=rows,
        total_row_count=rows,
        rejection_reasons=(None,) * rows,
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
    )


def publish(kafka, tq_store, names: TopicNames, groups: list[FinalizedGroup], partition: int = 0) -> None:
    """Put the groups' rows into TQ, then their records into one partition of the finalized topic, in order."""
    ids = [s for g in groups for s in g.sample_ids]
    fields = TensorDict({"input_ids": torch.zeros(len(ids), 4, dtype=torch.long)}, batch_size=[len(ids)])
    for i in range(0, len(ids), 1000):
        tq_store.put(TRAIN, ids[i : i + 1000], fields[i : i + 1000], [{} for _ in ids[i : i + 1000]])
    producer = AckedProducer(kafka)
    try:
        records = [Outgoing(names.finalized, g.group_id.encode(), g.to_bytes(), partition=partition) for g in groups]
        for i in range(0, len(records), 1000):
            producer.send(records[i : i + 1000])
    finally:
        producer.close()
