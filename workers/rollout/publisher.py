"""The rollout worker's side of the pipeline: stage a rollout's tensors in TQ, then publish its receipt.

`RolloutPublisher.publish` does both, in that order, for a batch of `StagedRollout`s (a receipt
plus its calls' token deltas); `publish_receipts` publishes receipts whose rows are staged already,
such as NeMo Gym's (`GymReceipt`: its capture stages every call as it is acknowledged).
`stage_rollouts` and `segments_to_fields` are its staging half, also used on their own by tools and
tests. What a staged row holds is `schemas.staged_rows`'s contract. The publisher's Kafka producer
comes from the `KafkaApi` it is given and its clock (a row's `staged_at_ms`) from its `Runtime`:
confluent-kafka and the process's own by default, the explorer's models under a simulator.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from schemas.gym_receipt import GymReceipt
from schemas.jagged import jagged_views, offsets_from_lengths
from schemas.metadata_guard import assert_metadata_only
from schemas.receipt import Receipt
from schemas.staged_rows import ROUTED_EXPERTS, ROUTED_EXPERTS_K_TAG, SEGMENT_FIELDS, row_tags
from streams.config import KafkaConfig
from streams.kafka_api import REAL_KAFKA, KafkaApi
from streams.producer import AckedProducer, Outgoing
from streams.runtime import REAL_RUNTIME, Runtime
from streams.tq import STAGING, KVStore

__all__ = [
    "ROUTED_EXPERTS",
    "SEGMENT_FIELDS",
    "RolloutPublisher",
    "StagedRollout",
    "segments_to_fields",
    "stage_rollouts",
]


@dataclass(frozen=True)
class StagedRollout:
    """A receipt plus, per manifest entry, the call's token deltas to stage under its staging key."""

    receipt: Receipt
    segments: Sequence[Mapping[str, torch.Tensor]]


def segments_to_fields(segments: Sequence[Mapping[str, torch.Tensor]]) -> tuple[TensorDict, list[dict]]:
    """Stack call deltas as jagged rows; routed experts [len, k] are flattened with k kept in the tag."""
    n = len(segments)
    fields: dict[str, torch.Tensor] = {name: _jagged([s[name] for s in segments]) for name in SEGMENT_FIELDS}
    tags: list[dict] = [{} for _ in range(n)]
    if all(ROUTED_EXPERTS in s for s in segments) and n:
        fields[ROUTED_EXPERTS] = _jagged([s[ROUTED_EXPERTS].reshape(-1) for s in segments])
        for tag, s in zip(tags, segments):
            tag[ROUTED_EXPERTS_K_TAG] = int(s[ROUTED_EXPERTS].shape[-1])
    return TensorDict(fields, batch_size=[n]), tags


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows as one jagged tensor: one concatenation, the rows views of it (nested_tensor costs twice that)."""
    if not rows or any(r.dim() != 1 or r.dtype != rows[0].dtype for r in rows):  # as nested_tensor has them
        return torch.nested.nested_tensor(rows, layout=torch.jagged)
    offsets = offsets_from_lengths(torch.tensor([int(r.shape[0]) for r in rows], dtype=torch.int64))
    return jagged_views({"rows": torch.cat(rows)}, offsets)["rows"]


def stage_rollouts(
    store: KVStore, rollouts: Sequence[StagedRollout], staging_partition: str = STAGING, *, now_ms: int | None = None
) -> None:
    """Put every call segment of the rollouts into TQ staging (one put per field layout).

    Each row's tags name its group and rollout (the reassembler checks them before using or clearing
    a row) and when it was staged (`staged_at_ms`: `now_ms`, else this process's clock now; the
    sweeper ages rows no receipt names by it).
    """
    staged_at = int(time.time() * 1000) if now_ms is None else now_ms
    by_layout: dict[bool, list[tuple[str, Mapping[str, torch.Tensor], Mapping]]] = {}
    for r in rollouts:
        if len(r.segments) != len(r.receipt.manifest):
            raise ValueError(
                f"rollout {r.receipt.rollout_id}: {len(r.segments)} segment(s) for "
                f"{len(r.receipt.manifest)} manifest entries"
            )
        for call, seg in zip(r.receipt.manifest, r.segments):
            tag = row_tags(
                rollout_id=r.receipt.rollout_id,
                call_id=call.call_id,
                group_id=r.receipt.group_id,
                weight_version=call.weight_version,
                staged_at_ms=staged_at,
            )
            by_layout.setdefault(ROUTED_EXPERTS in seg, []).append((call.staging_key, seg, tag))
    for rows in by_layout.values():
        fields, extra = segments_to_fields([seg for _, seg, _ in rows])
        tags = [{**tag, **e} for (_, _, tag), e in zip(rows, extra)]
        store.put(staging_partition, [k for k, _, _ in rows], fields, tags)


class RolloutPublisher:
    """Stages each call's deltas under `{rollout_id}/{call_id}` and then publishes the receipt, acked.

    The order is the contract: a receipt is never visible before its tensors are staged.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        store: KVStore,
        receipts_topic: str,
        *,
        staging_partition: str = STAGING,
        api: KafkaApi = REAL_KAFKA,
        runtime: Runtime = REAL_RUNTIME,
    ):
        self._producer = AckedProducer(kafka, api=api)
        self._runtime = runtime
        self._store = store
        self._topic = receipts_topic
        self._staging = staging_partition

    def publish(self, rollouts: Sequence[StagedRollout], *, timeout_s: float = 30.0) -> list[tuple[int, int]]:
        """Stage, then publish the receipts keyed by group_id; returns (partition, offset) per receipt."""
        for r in rollouts:
            assert_metadata_only(r.receipt, path="receipt")
        staged = [r for r in rollouts if r.receipt.manifest]
        stage_rollouts(self._store, staged, self._staging, now_ms=self._runtime.wall_ms())
        return self._producer.send(
            [Outgoing(self._topic, r.receipt.group_id.encode(), r.receipt.to_bytes()) for r in rollouts],
            timeout_s=timeout_s,
        )

    def publish_receipts(
        self, receipts: Sequence[Receipt | GymReceipt], *, timeout_s: float = 30.0
    ) -> list[tuple[int, int]]:
        """Publish receipts whose rows are staged already (NeMo Gym's: its capture staged each call
        through `TQStagingSink` before acknowledging it), keyed by group_id; (partition, offset) each."""
        for r in receipts:
            assert_metadata_only(r, path="receipt")
        return self._producer.send(
            [Outgoing(self._topic, r.group_id.encode(), r.to_bytes()) for r in receipts], timeout_s=timeout_s
        )

    def close(self) -> None:
        self._producer.close()
