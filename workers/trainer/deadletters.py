"""The trainer's dead letters: finalized records it cannot use, kept on `trainer.deadletter` with the reason.

Three kinds, apart from the reassembler's (`schemas.deadletter.ERROR_KINDS`, which redrive re-publishes
to the receipts): `undecodable_finalized` (garbage bytes, another major schema version, a tombstone),
`missing_rows` (a group never consumed whose rows are gone from TQ, when it is not handed back
for regeneration instead: `lost_rows.py`) and `unusable_group` (a group handed out that the trainer
cannot turn into its framework's rows, `ExperienceConsumer.dead_letter`). Letters are `DeadLetter`s
bounded the same way: the original whole up to `MAX_ORIGINAL_BYTES`, else a prefix with its size and
SHA-256; keys and messages cut to their limits.

A record is resolved, and so its offset committed past, only once its letter is acknowledged
(`outbox.py`, which sends them); letters are at least once (a reader dedupes by source position).
"""

from __future__ import annotations

import time

from schemas.deadletter import DeadLetter, bounded_key, bounded_message, bounded_original

UNDECODABLE_FINALIZED = "undecodable_finalized"
MISSING_ROWS = "missing_rows"
UNUSABLE_GROUP = "unusable_group"
TRAINER_ERROR_KINDS = frozenset({UNDECODABLE_FINALIZED, MISSING_ROWS, UNUSABLE_GROUP})


def make_letter(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    kind: str,
    message: str,
    *,
    worker_id: str,
    time_ms: int | None = None,
) -> DeadLetter:
    """The dead letter of the record at topic[partition]@offset, bounded to fit one Kafka message;
    `time_ms` is when (the caller's wall clock, its runtime's; None: this process's clock now)."""
    return DeadLetter(
        source_topic=topic,
        source_partition=partition,
        source_offset=offset,
        source_key=bounded_key(key),
        error_kind=kind,
        message=bounded_message(message),
        worker_id=worker_id,
        time_ms=int(time.time() * 1000) if time_ms is None else time_ms,
        **bounded_original(value or b""),  # type: ignore[arg-type]
    )
