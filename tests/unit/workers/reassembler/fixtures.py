"""Receipts, records and state entries for the reassembler's pure unit tests (no broker, no Ray)."""

from __future__ import annotations

from schemas.errors import SchemaError
from schemas.receipt import CallRecord, Receipt
from schemas.state import CLOSED, FINALIZED, OPEN, GroupState
from streams.consumer import Record
from workers.reassembler.decode import REDRIVE_HEADER

TOPIC = "t.rollout.receipts"


def receipt(group_id: str, index: int, *, size: int = 2, prompt_idx: int = 0, rollout_id: str | None = None) -> Receipt:
    rid = rollout_id or f"{group_id}-r{index}"
    return Receipt(
        rollout_id=rid,
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=index,
        group_size=size,
        reward=0.5,
        mask_sample=True,
        loss_multiplier=1.0,
        environment="test",
        failure_reason=None,
        manifest=(CallRecord(f"{rid}/c0", "c0", None, 0, 4, 4, 1, "d"),),
    )


def record(
    offset: int,
    value: bytes | None,
    *,
    ts: int = 1_000,
    redriven: int = 0,
    partition: int = 0,
    key: bytes | None = None,
) -> Record:
    """A receipts record, keyed by its receipt's group_id as a publisher keys it (unless `key` says otherwise)."""
    headers = ((REDRIVE_HEADER, str(redriven).encode()),) if redriven else ()
    if key is None:
        try:
            key = Receipt.from_bytes(value).group_id.encode()
        except (SchemaError, TypeError):
            key = f"k{offset}".encode()
    return Record(TOPIC, partition, offset, key, value, headers, ts)


def opened(group_id: str, first_offset: int, first_seen_ms: int = 1_000, partition: int = 0) -> GroupState:
    return GroupState(group_id, OPEN, partition, first_offset, first_offset, first_seen_ms)


def closed(
    group_id: str,
    first_offset: int,
    last_offset: int,
    *,
    outcome: str = FINALIZED,
    keys: tuple[str, ...] = (),
    cleared: bool = False,
    partition: int = 0,
) -> GroupState:
    return GroupState(
        group_id,
        CLOSED,
        partition,
        first_offset,
        last_offset,
        1_000,
        outcome=outcome,
        finalized_at_ms=2_000,
        staging_keys=keys,
        staging_cleared=cleared,
    )
