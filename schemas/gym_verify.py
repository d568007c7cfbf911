"""`verify_and_linearize`: NeMo Gym's receipt verification and terminal-chain rebuild, the same checks
in the same order (nemo-gym 0.7.0, `token_id_capture.staging.rebuild`), so the same input gives the
same row or the same refusal code.

A `StagedCall` is what a staged row says about its call (NeMo Gym's `StagedCallBaseSnapshot`, without
validating it on construction: a row read back from TQ is input, and a corrupt one must surface as
the code verification gives it, `corrupt_digest` or `wrong_digest`, not as a construction error).
The receipt is read by attribute only (a `schemas.gym_receipt.GymRolloutReceipt`, or anything with
its fields), and nothing reads the calls' extras: `LinearizedRow.extras_commitments` says what the
chain's extras must hash to, for whoever loads them (`schemas.gym_digest.compute_extras_digest`).
`tests/unit/schemas/test_gym_differential.py` holds every code and row to NeMo Gym's own function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.errors import RebuildError, ReceiptVerificationError
from schemas.gym_digest import (
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    compute_chain_hash,
    compute_staging_digest,
    hash_token_ids,
)
from schemas.gym_receipt import staging_key

# Every code verification can refuse with, in NeMo Gym's vocabulary (RebuildError's are the graph's).
RECEIPT_CODES = (
    "unsupported_schema",
    "unsupported_digest",
    "unsupported_extras_digest",
    "rollout_failed",
    "capture_poisoned",
    "empty_manifest",
    "duplicate_manifest_row",
    "duplicate_staging_key",
    "row_count_mismatch",
    "duplicate_snapshot",
    "snapshot_identity_mismatch",
    "snapshot_order_mismatch",
    "wrong_rollout",
    *(
        f"wrong_{name}"
        for name in (
            "model_call_id",
            "parent_call_id",
            "mode",
            "prev_len",
            "delta_len",
            "cum_len",
            "weight_version",
            "digest",
            "extras_digest",
            "chain_hash",
            "cumulative_hash",
            "schema_version",
            "digest_version",
            "extras_digest_version",
        )
    ),
    "invalid_snapshot",
    "corrupt_digest",
)
REBUILD_CODES = (
    "missing_parent",
    "parent_length_mismatch",
    "lineage_cycle",
    "missing_terminal",
    "chain_hash_mismatch",
    "invalid_mask_order",
    "empty_generation",
    "empty_training_row",
    "cumulative_hash_mismatch",
)
VERIFICATION_CODES = RECEIPT_CODES + REBUILD_CODES


@dataclass(frozen=True, eq=False)
class StagedCall:
    """One staged call's base snapshot (NeMo Gym's `StagedCallBaseSnapshot` fields), unvalidated."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: str
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    token_ids_delta: list[int]
    token_mask_delta: list[float]
    generation_log_probs_delta: list[float]
    chain_hash: str
    cumulative_hash: str
    extras_digest: str = EMPTY_EXTRAS_DIGEST
    schema_version: int = STAGING_SCHEMA_VERSION
    digest_version: int = STAGING_DIGEST_VERSION
    extras_digest_version: int = EXTRAS_DIGEST_VERSION

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)


@dataclass(frozen=True)
class WeightVersionSpan:
    """The policy version of one call's newly contributed token span [start, end) of the row."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


@dataclass(frozen=True)
class ExtrasCommitment:
    """The receipt-bound extras digest of one selected call (what its extras must hash to)."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str


@dataclass(frozen=True)
class LinearizedRow:
    """One verified terminal chain: the row's tokens, mask and logprobs, and where each call lies in it."""

    rollout_id: str
    token_ids: list[int]
    token_mask: list[float]
    logprobs: list[float]
    model_call_ids: list[str]
    prompt_len: int
    weight_versions: list[int]
    weight_version_spans: list[WeightVersionSpan]
    # (model_call_id, carried tokens, generated tokens) per call, root to terminal.
    link_spans: list[tuple[str, int, int]] = field(default_factory=list)
    extras_commitments: list[ExtrasCommitment] = field(default_factory=list)


def _fail(code: str, detail: str) -> ReceiptVerificationError:
    return ReceiptVerificationError(code, detail)


def _versions(receipt: Any) -> None:
    if receipt.schema_version != STAGING_SCHEMA_VERSION:
        raise _fail("unsupported_schema", f"receipt schema {receipt.schema_version}")
    if receipt.digest_version != STAGING_DIGEST_VERSION:
        raise _fail("unsupported_digest", f"receipt digest {receipt.digest_version}")
    if receipt.extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise _fail("unsupported_extras_digest", f"receipt extras digest {receipt.extras_digest_version}")


_COMPARED = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


def _compare(receipt: Any, record: Any, snapshot: StagedCall) -> None:
    call_id = record.model_call_id
    if snapshot.rollout_id != receipt.rollout_id:
        raise _fail("wrong_rollout", f"snapshot {call_id} belongs to {snapshot.rollout_id}")
    for name in _COMPARED:
        actual, expected = getattr(snapshot, name), getattr(record, name)
        if actual != expected:
            raise _fail(f"wrong_{name}", f"call {call_id}: snapshot {actual!r}, manifest {expected!r}")
    for name in ("schema_version", "digest_version", "extras_digest_version"):
        actual, expected, declared = getattr(snapshot, name), getattr(record, name), getattr(receipt, name)
        if actual != expected or actual != declared:
            raise _fail(f"wrong_{name}", f"call {call_id}: snapshot={actual}, manifest={expected}, receipt={declared}")


def _integrity(snapshot: StagedCall) -> None:
    # From the committed extras digest: the row's authenticity never depends on extras being present.
    call_id = snapshot.model_call_id
    try:
        digest = compute_staging_digest(
            schema_version=snapshot.schema_version,
            digest_version=snapshot.digest_version,
            extras_digest_version=snapshot.extras_digest_version,
            rollout_id=snapshot.rollout_id,
            model_call_id=call_id,
            parent_call_id=snapshot.parent_call_id,
            mode=snapshot.mode,
            prev_len=snapshot.prev_len,
            delta_len=snapshot.delta_len,
            cum_len=snapshot.cum_len,
            weight_version=snapshot.weight_version,
            token_ids_delta=snapshot.token_ids_delta,
            token_mask_delta=snapshot.token_mask_delta,
            generation_log_probs_delta=snapshot.generation_log_probs_delta,
            extras_digest=snapshot.extras_digest,
            chain_hash=snapshot.chain_hash,
            cumulative_hash=snapshot.cumulative_hash,
        )
    except (TypeError, ValueError, OverflowError) as error:
        raise _fail("invalid_snapshot", f"call {call_id}: {error}") from error
    if digest != snapshot.digest:
        raise _fail("corrupt_digest", f"call {call_id}: staged digest mismatch")


def _graph(records: dict[str, Any]) -> None:
    for call_id, record in records.items():
        if record.parent_call_id is not None:
            parent = records.get(record.parent_call_id)
            if parent is None:
                raise RebuildError("missing_parent", f"call {call_id} names absent parent {record.parent_call_id}")
            if parent.cum_len != record.prev_len:
                raise RebuildError(
                    "parent_length_mismatch",
                    f"call {call_id} starts at {record.prev_len}, parent ends at {parent.cum_len}",
                )
        visited: set[str] = set()
        cursor = record
        while cursor is not None:
            if cursor.model_call_id in visited:
                raise RebuildError("lineage_cycle", f"cycle reaches call {cursor.model_call_id}")
            visited.add(cursor.model_call_id)
            cursor = records.get(cursor.parent_call_id) if cursor.parent_call_id is not None else None


def _terminal_chain(receipt: Any, records: dict[str, Any]) -> list[Any]:
    terminal = receipt.terminal_model_call_id
    if terminal is None:
        raise RebuildError("missing_terminal", "successful receipt has no terminal call")
    cursor = records.get(terminal)
    if cursor is None:
        raise RebuildError("missing_terminal", f"terminal call {terminal} is absent")
    chain = []
    while cursor is not None:
        chain.append(cursor)
        cursor = records.get(cursor.parent_call_id) if cursor.parent_call_id is not None else None
    chain.reverse()
    return chain


def _carry_boundary(snapshot: StagedCall) -> int:
    boundary = 0
    for mask in snapshot.token_mask_delta:
        if mask != 0.0:
            break
        boundary += 1
    if any(mask != 1.0 for mask in snapshot.token_mask_delta[boundary:]):
        raise RebuildError("invalid_mask_order", f"call {snapshot.model_call_id} mask is not carry-then-generation")
    if boundary == len(snapshot.token_mask_delta):
        raise RebuildError("empty_generation", f"call {snapshot.model_call_id} contains no policy-generated token")
    return boundary


def verify_receipt(receipt: Any) -> dict[str, Any]:
    """The checks of the receipt alone, before any staged row is read (versions, a failed or poisoned
    capture, an empty manifest, duplicates); returns its rows by call id."""
    _versions(receipt)
    if receipt.failure_reason is not None:
        raise _fail("rollout_failed", receipt.failure_reason)
    if receipt.capture_poisoned:
        raise _fail("capture_poisoned", "receipt marks token capture as poisoned")
    if not receipt.manifest:
        raise _fail("empty_manifest", "successful receipt has no committed calls")
    records: dict[str, Any] = {}
    keys: set[str] = set()
    for record in receipt.manifest:
        if record.model_call_id in records:
            raise _fail("duplicate_manifest_row", "model_call_id values are not unique")
        if record.staging_key in keys:
            raise _fail("duplicate_staging_key", "staging keys are not unique")
        records[record.model_call_id] = record
        keys.add(record.staging_key)
    return records


def verify_and_linearize(receipt: Any, snapshots: Sequence[StagedCall]) -> LinearizedRow:
    """Verify the staged calls against the receipt and linearize its terminal chain; raises
    `ReceiptVerificationError` (or its `RebuildError`) with NeMo Gym's code."""
    records = verify_receipt(receipt)
    if len(snapshots) != len(receipt.manifest):
        raise _fail("row_count_mismatch", f"{len(snapshots)} snapshots for {len(receipt.manifest)} manifest rows")
    by_id: dict[str, StagedCall] = {}
    for record, snapshot in zip(receipt.manifest, snapshots):
        if snapshot.model_call_id in by_id:
            raise _fail("duplicate_snapshot", "model_call_id values are not unique")
        if snapshot.model_call_id not in records:
            raise _fail("snapshot_identity_mismatch", f"snapshot {snapshot.model_call_id} is not in the manifest")
        if snapshot.model_call_id != record.model_call_id:
            raise _fail(
                "snapshot_order_mismatch",
                f"key {record.staging_key} expected {record.model_call_id}, received {snapshot.model_call_id}",
            )
        by_id[snapshot.model_call_id] = snapshot
        _compare(receipt, record, snapshot)
        _integrity(snapshot)
    _graph(records)
    return _linearize(receipt, _terminal_chain(receipt, records), by_id)


def _linearize(receipt: Any, chain: list[Any], by_id: dict[str, StagedCall]) -> LinearizedRow:
    token_ids: list[int] = []
    token_mask: list[float] = []
    logprobs: list[float] = []
    spans: list[WeightVersionSpan] = []
    links: list[tuple[str, int, int]] = []
    prompt_len = 0
    running: str | None = None
    for index, record in enumerate(chain):
        snapshot = by_id[record.model_call_id]
        # Each staged delta must extend its parent's chain hash.
        running = compute_chain_hash(running, snapshot.token_ids_delta)
        if record.chain_hash != running:
            raise RebuildError(
                "chain_hash_mismatch", f"call {record.model_call_id} does not extend its parent's staged chain"
            )
        boundary = _carry_boundary(snapshot)
        start = len(token_ids)
        token_ids.extend(snapshot.token_ids_delta)
        token_mask.extend(snapshot.token_mask_delta)
        logprobs.extend(snapshot.generation_log_probs_delta)
        if index == 0:
            prompt_len = boundary
        spans.append(WeightVersionSpan(record.model_call_id, start, len(token_ids), record.weight_version))
        links.append((record.model_call_id, boundary, record.delta_len - boundary))
    if not any(token_mask):
        raise RebuildError("empty_training_row", "terminal chain has no generated tokens")
    # The terminal's cumulative hash anchors the whole sequence (per-call checks would rehash O(n^2)).
    if chain[-1].cumulative_hash != hash_token_ids(token_ids):
        raise RebuildError(
            "cumulative_hash_mismatch",
            f"terminal call {chain[-1].model_call_id} cumulative hash does not cover the linearized tokens",
        )
    return LinearizedRow(
        rollout_id=receipt.rollout_id,
        token_ids=token_ids,
        token_mask=token_mask,
        logprobs=logprobs,
        model_call_ids=[r.model_call_id for r in chain],
        prompt_len=prompt_len,
        weight_versions=[r.weight_version for r in chain],
        weight_version_spans=spans,
        link_spans=links,
        extras_commitments=[ExtrasCommitment(r.model_call_id, r.extras_digest_version, r.extras_digest) for r in chain],
    )
