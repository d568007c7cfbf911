"""Offline re-finalization: rebuild replayed groups from staged tensors and diff them against the record.

Given a replay topic of receipts and a TQ holding the staged tensors (typically a TQ checkpoint
loaded into a fresh local instance), `refinalize` groups the receipts by group id exactly as a
reassembler would, runs `build_group` with the production actor config, and compares each rebuilt
group with the finalized record published under the prefix: metadata field by field, and the
packed tensors row by row against the rows in TQ train. It writes nothing anywhere.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.errors import InvalidArgument, SchemaError
from schemas.finalized import FinalizedGroup
from schemas.gym_receipt import GymReceipt
from schemas.receipt import Receipt
from schemas.request import RolloutReassemblerActorConfig
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.errors import MissingKeysError
from streams.tq import KVStore
from workers.reassembler.config import default_actor_config
from workers.reassembler.finalize import build_one
from workers.reassembler.groups import OpenGroup, PromptGroups
from workers.reassembler.gym_fetch import fetch_gym_rows, is_gym
from workers.reassembler.staged_fetch import fetch_segments, tensor_rows
from workers.topics import TopicNames, decode_value

# Compared field by field; partition_id, source, metrics and finalized_at_ms describe the run, not the result.
COMPARED_FIELDS = (
    "prompt_idx",
    "sample_ids",
    "tags",
    "group_min_wv",
    "group_max_wv",
    "canonical_output_tokens",
    "valid_row_count",
    "total_row_count",
    "rejection_reasons",
)


@dataclass(frozen=True)
class Diff:
    """One difference between a rebuilt group and its record; row is None for group-level fields."""

    group_id: str
    field: str
    recorded: Any
    rebuilt: Any
    row: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        where = f"group {self.group_id}" + (f" row {self.row}" if self.row is not None else "")
        if self.detail:
            return f"{where} {self.field} differs ({self.detail})"
        return f"{where} {self.field} {self.recorded!r} != {self.rebuilt!r}"


def replayed_groups(kafka: KafkaConfig, topic: str) -> dict[str, OpenGroup]:
    """Receipts of a replay topic gathered into groups exactly as a reassembler gathers them.

    Bad records, duplicates and inconsistent receipts are left out as the reassembler would leave them.
    """
    parts: dict[int, PromptGroups] = {}
    for rec in read_topic(kafka, topic):
        try:
            msg = decode_value(rec.value)
        except SchemaError:
            continue
        if isinstance(msg, (Receipt, GymReceipt)):
            parts.setdefault(rec.partition, PromptGroups(rec.partition)).add(msg, rec.offset, rec.timestamp_ms)
    return {gid: g for groups in parts.values() for gid, g in groups.open.items()}


def refinalize(
    kafka: KafkaConfig,
    replay_topic: str,
    *,
    prefix: str,
    store: KVStore,
    recorded_store: KVStore | None = None,
    config: RolloutReassemblerActorConfig | None = None,
) -> list[Diff]:
    """Rebuild every group of `replay_topic` from the staged tensors in `store` and diff against the record.

    Recorded metadata comes from `TopicNames(prefix).finalized` (last record per group); recorded
    rows from `recorded_store` (default `store`) in the record's partition_id. Returns the
    differences, empty when the rebuild reproduces the record exactly.
    """
    config = config or default_actor_config()
    recorded_store = recorded_store or store
    recorded: dict[str, FinalizedGroup] = {}
    for rec in read_topic(kafka, TopicNames(prefix).finalized):
        try:
            f = FinalizedGroup.from_bytes(rec.value)
        except SchemaError:
            continue
        recorded[f.group_id] = f
    diffs: list[Diff] = []
    for gid, group in sorted(replayed_groups(kafka, replay_topic).items()):
        diffs.extend(_diff_group(group, recorded.get(gid), store, recorded_store, config))
    return diffs


def _diff_group(
    group: OpenGroup,
    record: FinalizedGroup | None,
    store: KVStore,
    recorded_store: KVStore,
    config: RolloutReassemblerActorConfig,
) -> list[Diff]:
    gid = group.group_id
    keys = group.staging_keys()
    # Each receipt's staged calls read as its kind: a NeMo Gym receipt's are NeMo Gym rows.
    rl_keys = list(dict.fromkeys(c.staging_key for r in group.receipts.values() if not is_gym(r) for c in r.manifest))
    gym_keys = list(dict.fromkeys(c.staging_key for r in group.receipts.values() if is_gym(r) for c in r.manifest))
    segments = fetch_segments(store, config.staging_partition, rl_keys, routed_experts=config.router_replay_enabled)
    gym_rows = (
        fetch_gym_rows(store, config.staging_partition, gym_keys, store.tags(config.staging_partition, gym_keys))
        if gym_keys
        else {}
    )
    if keys and not segments and not gym_rows and record is not None and record.valid_row_count:
        return [
            Diff(
                gid,
                "staging",
                len(keys),
                0,
                detail=f"none of its {len(keys)} staged tensors are in TQ {config.staging_partition!r}; cannot rebuild",
            )
        ]
    build = build_one(group, segments, config, gym_rows)
    if record is None:
        if build.valid_row_count == 0:
            return []  # dead-lettered both times
        return [
            Diff(
                gid,
                "finalized_record",
                None,
                f"{build.valid_row_count} valid rows",
                detail="no finalized record, but the rebuild finalizes it",
            )
        ]
    if build.valid_row_count == 0:
        return [
            Diff(
                gid,
                "finalized_record",
                f"{record.valid_row_count} valid rows",
                None,
                detail="recorded as finalized, but the rebuild has no valid row (would be dead-lettered)",
            )
        ]
    diffs = _diff_fields(gid, group, build, record)
    if tuple(build.sample_ids) == tuple(record.sample_ids):
        diffs.extend(_diff_rows(gid, record, build.fields, recorded_store))
    return diffs


def _diff_fields(gid: str, group: OpenGroup, build, record: FinalizedGroup) -> list[Diff]:
    rebuilt = {
        "prompt_idx": group.prompt_idx,
        "sample_ids": tuple(build.sample_ids),
        "tags": tuple(build.tags),
        "group_min_wv": build.group_min_wv,
        "group_max_wv": build.group_max_wv,
        "canonical_output_tokens": build.canonical_output_tokens,
        "valid_row_count": build.valid_row_count,
        "total_row_count": build.total_row_count,
        "rejection_reasons": tuple(build.rejection_reasons),
    }
    diffs = []
    for name in COMPARED_FIELDS:
        mine, theirs = _plain(rebuilt[name]), _plain(getattr(record, name))
        if mine == theirs:
            continue
        if name in ("tags", "rejection_reasons") and len(mine) == len(theirs):
            diffs.extend(Diff(gid, name, b, a, row=i) for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        else:
            diffs.append(Diff(gid, name, theirs, mine))
    return diffs


def _diff_rows(gid: str, record: FinalizedGroup, fields, recorded_store: KVStore) -> list[Diff]:
    names = sorted(fields.keys())
    try:
        got = recorded_store.get(record.partition_id, list(record.sample_ids), select=names)
    except MissingKeysError as exc:
        return [
            Diff(
                gid,
                "train_rows",
                len(record.sample_ids),
                len(record.sample_ids) - len(exc.missing),
                detail=f"{len(exc.missing)} row(s) missing from TQ {record.partition_id!r}: "
                f"{', '.join(exc.missing[:3])}",
            )
        ]
    diffs = []
    for name in names:
        mine, theirs = tensor_rows(fields.get(name)), tensor_rows(got.get(name))
        for i, (a, b) in enumerate(zip(mine, theirs)):
            detail = _tensor_diff(a, b)
            if detail:
                diffs.append(Diff(gid, name, None, None, row=i, detail=detail))
    return diffs


def _tensor_diff(rebuilt: torch.Tensor, recorded: torch.Tensor) -> str:
    if rebuilt.shape != recorded.shape:
        return f"shape {tuple(recorded.shape)} != {tuple(rebuilt.shape)}"
    if torch.equal(rebuilt, recorded.to(rebuilt.dtype)):
        return ""
    if rebuilt.is_floating_point():
        return f"max abs diff {float((rebuilt - recorded.to(rebuilt.dtype)).abs().max()):.6g}"
    return f"{int((rebuilt != recorded.to(rebuilt.dtype)).sum())} element(s) differ"


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def load_tq_checkpoint(checkpoint_dir: str | Path) -> None:
    """Load a TQ checkpoint into the TQ this process initialised (replacing its state).

    Loads from a copy: TQ's loader may roll a checkpoint directory aside, and the operator's copy
    is evidence that must stay as it was.
    """
    import transfer_queue as tq

    src = Path(checkpoint_dir)
    if not (src / "metadata.json").exists():
        raise InvalidArgument(f"{src} is not a TQ checkpoint (no metadata.json)")
    work = Path(tempfile.mkdtemp(prefix="rlstream-ckpt-")) / src.name
    shutil.copytree(src, work)
    tq.load_checkpoint(work)
