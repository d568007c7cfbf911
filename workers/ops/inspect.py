"""`rlstream inspect group`: everything about one prompt group, across the pipeline's topics and TQ.

Reads with manual assignment: looking never moves a production consumer group's offsets.
"""

from __future__ import annotations

from typing import Any

from schemas.finalized import FinalizedGroup
from schemas.gym_receipt import GymReceipt
from schemas.receipt import Receipt
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.tq import STAGING, TRAIN, KVStore
from workers.ops.records import describe_record, matches_group
from workers.topics import TopicNames, topic_role


def inspect_group(
    kafka: KafkaConfig,
    names: TopicNames,
    group_id: str,
    *,
    store: KVStore | None = None,
    staging_partition: str = STAGING,
) -> dict[str, Any]:
    """Everything about one prompt group: receipts, state entries, finalized records, dead letters and,
    with a store, which of its staging keys and train sample ids are still in TQ."""
    found: dict[str, list[dict[str, Any]]] = {}
    for section, topic in (
        ("receipts", names.receipts),
        ("state", names.state),
        ("finalized", names.finalized),
        ("dead_letters", names.deadletter),
    ):
        role = topic_role(topic)
        found[section] = [
            d for d in (describe_record(r, role) for r in read_topic(kafka, topic)) if matches_group(d, group_id)
        ]
    report: dict[str, Any] = {"group_id": group_id, **found}
    receipts = [d["value"] for d in found["receipts"] if d.get("kind") in (Receipt.kind(), GymReceipt.kind())]
    receipts += [
        d["value"]["original_receipt"] for d in found["dead_letters"] if "original_receipt" in d.get("value", {})
    ]
    # A NeMo Gym receipt's manifest is its inner receipt's.
    staging_keys = sorted(
        {c["staging_key"] for r in receipts for c in r.get("manifest", r.get("receipt", {}).get("manifest", []))}
    )
    finalized = [d["value"] for d in found["finalized"] if d.get("kind") == FinalizedGroup.kind()]
    sample_ids = sorted({s for f in finalized for s in f["sample_ids"]})
    train = finalized[-1]["partition_id"] if finalized else TRAIN
    outcome = (
        "finalized" if finalized else "dead_lettered" if found["dead_letters"] else "open" if receipts else "unknown"
    )
    report["summary"] = {
        "receipts": len(found["receipts"]),
        "state_entries": len(found["state"]),
        "finalized_records": len(finalized),
        "dead_letters": len(found["dead_letters"]),
        "outcome": outcome,
    }
    if store is not None:
        staged = store.present(staging_partition, staging_keys)
        trained = store.present(train, sample_ids)
        report["tq"] = {
            "staging_partition": staging_partition,
            "train_partition": train,
            "staging_keys": {k: k in staged for k in staging_keys},
            "sample_ids": {s: s in trained for s in sample_ids},
        }
    return report
