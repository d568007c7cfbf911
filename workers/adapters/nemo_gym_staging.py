"""NeMo Gym's `StagingSink` and `StagingSource` over rlstream's TQ staging partition.

NeMo Gym's capture (`RolloutTokenCapture`, installed in the inference worker) hands each model
call's normalized delta to a framework sink before it acknowledges the call, and the framework
verifies receipts against a source. `TQStagingSink.stage` puts the record and its attachments (the
processed media a VLM call ran on) into TQ in ONE put under `staging_key(rollout_id, model_call_id)`,
and returns success only once TQ acknowledged it; anything it cannot store whole (an attachment of a
kind a row cannot carry, a rollout whose group it cannot name, a failed put) is a failed
`StageResult` with the reason, never a call with something dropped. It keeps no state of its own, so
capture threads may call it at once (a `KVStore` is safe to share). `TQStagingSource.fetch` returns
one validated base snapshot per key, in order: KeyError for a key not staged, ValueError for a row
that is not a valid NeMo Gym call. What a row holds is `schemas.staged_rows`'s contract.

NeMo Gym is imported when a sink or source is used, not with this module: rlstream's own
pipeline never needs it (the reassembler verifies with `schemas.gym_verify`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from schemas.staged_rows import GymStagedRow, group_of_rollout, gym_row, staging_key
from streams.tq import STAGING, KVStore
from workers.reassembler.gym_fetch import fetch_gym_rows

log = logging.getLogger("rlstream.nemo_gym")

_INT64_MAX = 2**63 - 1


def _staging():
    from nemo_gym.token_id_capture.staging import records

    return records


class TQStagingSink:
    """NeMo Gym's `StagingSink` (runtime-checkable: `isinstance(sink, StagingSink)` holds) over TQ.

    `group_of(rollout_id)` names the prompt group a rollout belongs to, which every staged row is
    tagged with (the reassembler uses a row only for its own group's receipt; the sweeper places it
    by its group). The default reads NeMo RL's rollout ids, `{group_id}_g{i}`.
    """

    def __init__(
        self,
        store: KVStore,
        *,
        staging_partition: str = STAGING,
        group_of: Callable[[str], str] = group_of_rollout,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._partition = staging_partition
        self._group_of = group_of
        self._clock = clock

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Make `record` and `attachments` durable in one TQ put, or say why not (a failed StageResult)."""
        records = _staging()
        key = None
        try:
            if not isinstance(record, records.StagedCallRecord):
                raise TypeError(f"expected a NeMo Gym StagedCallRecord, got {type(record).__name__}")
            key = staging_key(record.rollout_id, record.model_call_id)
            if attachments is not None and not isinstance(attachments, Mapping):
                raise TypeError(f"attachments must be a mapping, got {type(attachments).__name__}")
            if any(type(t) is not int or t > _INT64_MAX for t in record.token_ids_delta):
                # An int64 row would turn 5.0 into 5, so a record NeMo Gym refuses would then verify.
                raise ValueError("a token id is not an int that fits the int64 rows TQ staging holds")
            fields, tags = gym_row(
                record,
                group_id=self._group_of(record.rollout_id),
                staged_at_ms=int(self._clock() * 1000),
                attachments=attachments,
            )
        except Exception as exc:  # noqa: BLE001 - any refusal is the call's failed capture, never a crash
            return self._failed(records, key or "?", exc)
        try:
            self._store.put(self._partition, [key], fields, [tags])
        except Exception as exc:  # noqa: BLE001
            # TQ has no rollback: whatever part of the row landed is removed, or the sweeper finds it.
            try:
                self._store.clear(self._partition, [key])
            except Exception:  # noqa: BLE001 - the stage failure is what must be reported
                log.exception("could not clear the failed staging of %s from %r", key, self._partition)
            return self._failed(records, key, exc)
        return records.StageResult(ok=True, staging_key=key)

    @staticmethod
    def _failed(records: Any, key: str, exc: BaseException) -> Any:
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("staging %s failed: %s", key, reason)
        return records.StageResult(ok=False, staging_key=None if key == "?" else key, error=reason)


class TQStagingSource:
    """NeMo Gym's `StagingSource` over TQ: base snapshots in key order (KeyError if absent)."""

    def __init__(self, store: KVStore, *, staging_partition: str = STAGING) -> None:
        self._store = store
        self._partition = staging_partition

    def rows(self, staging_keys: Sequence[str], *, extras: bool = True, attachments: bool = True) -> list[GymStagedRow]:
        """The staged rows of `staging_keys`, in order: each one's snapshot, and its extras and
        attachments unless told not to read them (NeMo Gym's protocol leaves them behind the key)."""
        keys = list(staging_keys)
        tags = self._store.tags(self._partition, keys)
        missing = [k for k in keys if k not in tags]
        if missing:
            raise KeyError(f"not staged in {self._partition!r}: {', '.join(missing[:5])}")
        found = fetch_gym_rows(self._store, self._partition, keys, tags, extras=extras, attachments=attachments)
        out = []
        for key in keys:
            row = found.get(key)
            if row is None:
                raise KeyError(f"not staged in {self._partition!r}: {key}")
            if isinstance(row, str):
                raise ValueError(f"staged row {key!r} of {self._partition!r}: {row}")
            out.append(row)
        return out

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One validated `StagedCallBaseSnapshot` per key, in order."""
        records = _staging()
        rows = self.rows(staging_keys, extras=False, attachments=False)
        return [records.StagedCallBaseSnapshot.model_validate(_snapshot(r)) for r in rows]

    def fetch_records(self, staging_keys: list[str]) -> list[Any]:
        """One validated `StagedCallSnapshot` per key (its extras too, checked against their digest)."""
        records = _staging()
        return [
            records.StagedCallSnapshot.model_validate({**_snapshot(r), "extras": r.extras})
            for r in self.rows(staging_keys, attachments=False)
        ]

    def fetch_attachments(self, staging_keys: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each key's attachments, as staged (bit for bit)."""
        return [r.attachments for r in self.rows(staging_keys, extras=False)]


def _snapshot(row: GymStagedRow) -> dict[str, Any]:
    return dataclasses.asdict(row.call)
