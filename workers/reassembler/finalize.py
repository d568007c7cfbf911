"""Finalization of ready groups: one batched fetch from TQ staging (`staging_read.py`), the pure build, an
idempotent put to TQ train."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from schemas.deadletter import ALL_ROLLOUTS_FAILED, GROUP_TIMEOUT, INCONSISTENT_GROUP
from schemas.finalized import FinalizedGroup, SourceRange
from schemas.group_build import GroupBuild, build_group
from schemas.jagged import concat_batches
from schemas.regenerate import MAX_REGENERATIONS, regeneration_of
from schemas.request import RolloutReassemblerActorConfig
from streams.tq import KVStore
from workers.reassembler.abandoned import ATTEMPT_TAG, attempt_of, clear_abandoned_rows
from workers.reassembler.errors import LeaseRefused
from workers.reassembler.groups import OpenGroup
from workers.reassembler.staged_fetch import Segments
from workers.reassembler.staging_lost import MISSING_RECEIPT, ROLLOUT_FAILED, staging_lost
from workers.reassembler.staging_read import Fetched, Owned, Staged, read_staged
from workers.runtime import REAL_RUNTIME, Runtime


@dataclass(frozen=True)
class GroupOutcome:
    """What finalizing one group produced: a finalized record, or the reason it goes to the dead-letter topic."""

    group: OpenGroup
    finalized: FinalizedGroup | None
    dead_letter_kind: str | None
    dead_letter_message: str | None
    staging_keys: tuple[str, ...]
    # Set when none of the group's staged rows exist any more (TQ lost with the job): the group is
    # handed back for regeneration instead of dead-lettered; the caller makes the `Regenerate`.
    handed_back: bool = False


def _source(group: OpenGroup, topic: str) -> SourceRange | None:
    if group.partition < 0:  # finalized over RPC, not from a receipts partition
        return None
    return SourceRange(
        topic=topic, partition=group.partition, first_offset=group.first_offset, last_offset=group.last_offset
    )


def _finalized_record(
    group: OpenGroup,
    build: GroupBuild,
    config: RolloutReassemblerActorConfig,
    topic: str,
    metrics: Mapping[str, float],
    finalized_at_ms: int,
) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=group.group_id,
        prompt_idx=group.prompt_idx,
        partition_id=config.partition_id,
        sample_ids=tuple(build.sample_ids),
        tags=tuple(build.tags),
        group_min_wv=build.group_min_wv,
        group_max_wv=build.group_max_wv,
        canonical_output_tokens=build.canonical_output_tokens,
        valid_row_count=build.valid_row_count,
        total_row_count=build.total_row_count,
        rejection_reasons=tuple(build.rejection_reasons),
        dropped=False,
        drop_reason=None,
        metrics=dict(metrics),
        source=_source(group, topic),
        finalized_at_ms=finalized_at_ms,
    )


def build_one(
    group: OpenGroup, segments: Segments, config: RolloutReassemblerActorConfig, gym_rows: Segments | None = None
) -> GroupBuild:
    """The group's rows from rlstream `segments` and NeMo Gym `gym_rows` (default: `segments` too)."""
    receipts = group.by_index()
    present = [r for r in receipts if r is not None]
    loss_multiplier = present[0].loss_multiplier if present else 1.0
    versions = [c.weight_version for r in present for c in r.manifest]
    return build_group(
        group_id=group.group_id,
        prompt_idx=group.prompt_idx,
        group_size=group.group_size,
        receipts=receipts,
        segments=segments,
        gym_rows=gym_rows,
        config=config,
        fallback_weight_version=min(versions) if versions else 0,
        loss_multiplier=loss_multiplier,
    )


def finalize_groups(
    store: KVStore,
    groups: Sequence[OpenGroup],
    config: RolloutReassemblerActorConfig,
    *,
    receipts_topic: str,
    now_ms: int,
    lease_refusal: Callable[[int, list[str]], str | None] = lambda put, sample_ids: None,
    runtime: Runtime = REAL_RUNTIME,
    staged: Staged | None = None,
    placeholder_groups: bool = False,
    may_hold_earlier_attempt: Callable[[OpenGroup], bool] | None = None,
) -> list[GroupOutcome]:
    """Finalize ready groups; rows go to TQ train now, staging is cleared by the caller after commit.

    `staged` is what `read_staged` read for (at least) these groups, if the caller read it already
    (a pipelined step reads the next step's staging while it finalizes its own); else it is read here.

    Train rows are tagged with the attempt that put them (`abandoned.ATTEMPT_TAG`). Those an earlier,
    uncommitted attempt put for a group decided now without rows, of the groups
    `may_hold_earlier_attempt` names (None: none, as over Ray RPC, where nothing commits), are
    cleared here, before the commit (`abandoned.py`).

    The rows of every group built go to TQ in one put per field layout, not one per group: TQ's cost
    is mostly per call (bench/dataplane). `lease_refusal(i, sample_ids)` is asked before put i and names why
    the caller may no longer own its partitions (None while it does): a zombie's put could overwrite
    rows a successor committed, or recreate rows a trainer already released. Then that put and the
    rest are not made and `LeaseRefused` is raised. A record's `finalized_at_ms` is `runtime`'s wall
    clock; the `metrics` figures are `perf_counter` spans (metrics only, see `workers.runtime`). With
    `placeholder_groups`, a group with no valid row is published as masked placeholder rows (NeMo
    RL's way) instead of dead-lettered.
    """
    staged = staged if staged is not None else read_staged(store, groups, config)
    owned, tags, fetched, fetch_ms = staged.owned, staged.tags, staged.fetched, staged.fetch_ms
    results = [_build_or_letter(group, owned[group.group_id], fetched, config, present=tags.keys()) for group in groups]
    if placeholder_groups:
        results = [placeholder_group(r, owned, fetched, config) for r in results]
    built = [(r[0], r[1]) for r in results if not isinstance(r, GroupOutcome)]
    put_ms = _put_rows(store, config.partition_id, built, lease_refusal) / max(1, len(built))
    outcomes = []
    for r in results:
        if isinstance(r, GroupOutcome):
            outcomes.append(r)
            continue
        group, build, staging, build_ms = r
        metrics = {
            "fetch_ms": fetch_ms,
            "build_put_ms": build_ms + put_ms,
            "receipts": float(len(group.receipts)),
            "timed_out": float(not group.complete),
            "open_ms": float(max(0, now_ms - group.first_seen_ms)),
        }
        outcomes.append(
            GroupOutcome(
                group,
                _finalized_record(group, build, config, receipts_topic, metrics, runtime.wall_ms()),
                None,
                None,
                staging,
            )
        )
    if may_hold_earlier_attempt is not None:
        # Rows an uncommitted earlier attempt put for a group decided now without rows: no record will name them.
        rowless = [o.group for o in outcomes if o.finalized is None and may_hold_earlier_attempt(o.group)]
        clear_abandoned_rows(store, config.partition_id, rowless)
    return outcomes


_Built = tuple[OpenGroup, GroupBuild, tuple[str, ...], float]  # group, its rows, staging keys, build ms


def _build_or_letter(
    group: OpenGroup,
    mine: Owned,
    fetched: Fetched,
    config: RolloutReassemblerActorConfig,
    *,
    present: Collection[str],
) -> GroupOutcome | _Built:
    """The group's rows, or its dead-letter outcome when it has no valid row or its build fails.

    `present`: the staging keys that exist in TQ (under any owner). A group none of whose valid rows is
    left because its staging was lost (a whole-job restart emptied TQ, or another worker's stale clear
    destroyed its rows under their keys; `staging_lost.py`) is handed back, failed siblings or not. A
    group whose keys exist but belong to another group is hostile input and is dead-lettered like any
    other group without a valid row.
    """
    t1 = time.perf_counter()
    # Only the group's own rows are cleared after the commit: a foreign key stays with its owner.
    staging = tuple(k for k in dict.fromkeys(group.staging_keys()) if k in mine.keys)
    segments, gym_rows = fetched.of(mine)
    try:
        build = build_one(group, segments, config, gym_rows)
    except Exception as exc:  # noqa: BLE001 - input the checks missed must not crash-loop the worker
        # The build is pure: whatever it raises comes from this group's receipts and tensors (a
        # routed-experts width that differs between calls, say). The group is dead-lettered
        # whole, with the error, and the partition keeps flowing.
        message = f"group {group.group_id}: building its rows failed ({type(exc).__name__}: {exc})"
        return GroupOutcome(group, None, INCONSISTENT_GROUP, message, staging)
    if build.valid_row_count == 0:
        reasons = sorted({r for r in build.rejection_reasons if r})
        lost = staging_lost(group, build, present, mine.keys, fetched.unread)
        if lost and regeneration_of(group.group_id)[1] < MAX_REGENERATIONS:
            # Generating the prompt again is the only way to train it.
            message = (
                f"group {group.group_id}: none of its staged rows can be read from TQ ({', '.join(reasons)});"
                " handed back for regeneration"
            )
            return GroupOutcome(group, None, None, message, staging, handed_back=True)
        kind = ALL_ROLLOUTS_FAILED if reasons == [ROLLOUT_FAILED] else INCONSISTENT_GROUP
        if not group.complete and set(reasons) <= {ROLLOUT_FAILED, MISSING_RECEIPT}:
            # Slow, not hostile: its other rollouts did not arrive within group_timeout_s (they are
            # dead-lettered late_receipt if they come), and those that did had failed.
            kind = GROUP_TIMEOUT
            message = (
                f"group {group.group_id}: closed at its timeout with {len(group.receipts)} of {group.group_size}"
                f" rollouts, none valid ({', '.join(reasons)})"
            )
            return GroupOutcome(group, None, kind, message, staging)
        return GroupOutcome(group, None, kind, f"group {group.group_id}: no valid row ({', '.join(reasons)})", staging)
    return group, build, staging, (time.perf_counter() - t1) * 1000.0


def placeholder_group(
    result: GroupOutcome | _Built,
    owned: Mapping[str, Owned],
    fetched: Fetched,
    config: RolloutReassemblerActorConfig,
) -> GroupOutcome | _Built:
    """A group dead-lettered for having no valid row, built instead as its placeholder rows (every row
    masked, sample_mask 0: NeMo RL publishes a group so); any other result as it was.

    A handed-back group stays handed back (it can still be trained, once generated again), and so
    does a group whose build raised (its rows cannot be built at all).
    """
    if not isinstance(result, GroupOutcome) or result.handed_back or result.dead_letter_kind is None:
        return result
    group = result.group
    segments, gym_rows = fetched.of(owned.get(group.group_id, Owned()))
    t1 = time.perf_counter()
    try:
        build = build_one(group, segments, config, gym_rows)
    except Exception:  # noqa: BLE001 - the build failed above too: the group stays dead-lettered
        return result
    if build.valid_row_count:
        return result
    return group, build, result.staging_keys, (time.perf_counter() - t1) * 1000.0


def _put_rows(
    store: KVStore,
    partition: str,
    built: list[tuple[OpenGroup, GroupBuild]],
    lease_refusal: Callable[[int, list[str]], str | None],
) -> float:
    """Put the rows of `built`, one put per set of fields, each once the lease allows it, each row tagged
    with the attempt putting it (`abandoned.ATTEMPT_TAG`); returns the ms it took."""
    t0 = time.perf_counter()
    attempts = {id(b): attempt_of(g) for g, b in built}
    for i, (same, fields) in enumerate(_puts([b for _, b in built])):
        sample_ids = [s for b in same for s in b.sample_ids]
        refusal = lease_refusal(i, sample_ids)
        if refusal is not None:
            names = ", ".join(b.sample_ids[0].rsplit("_g", 1)[0] for b in same[:3])
            raise LeaseRefused(f"not putting the rows of group(s) {names}{' ...' if len(same) > 3 else ''}: {refusal}")
        tags = [_tagged(t, attempts[id(b)]) for b in same for t in b.tags]
        store.put(partition, sample_ids, fields, tags)
    return (time.perf_counter() - t0) * 1000.0


def _joined(parts: list[TensorDict]) -> TensorDict:
    """The groups' rows as one batch: by their values where they line up (a TensorDict cat of jagged
    fields costs twice the copy of the rows it joins), else by `torch.cat`."""
    joined = concat_batches(parts)
    if joined is None:
        return torch.cat(parts)
    return TensorDict(joined, batch_size=[sum(p.batch_size[0] for p in parts)])


def _tagged(tag: Mapping[str, Any], attempt: list[int] | None) -> Mapping[str, Any]:
    return tag if attempt is None else {**tag, ATTEMPT_TAG: attempt}


def _puts(builds: list[GroupBuild]) -> list[tuple[list[GroupBuild], TensorDict]]:
    """The builds in as few puts as their fields allow: one per layout, else one per group."""
    by_layout: dict[tuple[str, ...], list[GroupBuild]] = {}
    for b in builds:
        by_layout.setdefault(tuple(sorted(b.fields.keys())), []).append(b)
    puts = []
    for same in by_layout.values():
        try:
            puts.append((same, same[0].fields if len(same) == 1 else _joined([b.fields for b in same])))
        except (RuntimeError, TypeError, ValueError):
            # Fields that do not concatenate (dtypes or per-token shapes differing between groups):
            # one put per group, as the rows are alike within a group.
            puts.extend(([b], b.fields) for b in same)
    return puts
