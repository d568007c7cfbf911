"""The staged-row contract: what a row of TQ's staging partition holds, under which key and tags.

Every staged row is one model call's delta, keyed `{rollout_id}/{call_id}` (`staging_key`, NeMo
Gym's default key too), with tags naming its prompt group and rollout (the reassembler uses or
clears a row only for the receipt of that group and rollout; the sweeper places a row by its group),
its call, its weight version and when it was staged. Two kinds of row share the partition:

- rlstream's own (`workers.rollout.publisher`): fields `token_ids` (int64), `token_mask` (bool),
  `generation_logprobs` (float32) and, optionally, `routed_experts` flattened with its width in
  the tag `routed_experts_k`.
- NeMo Gym's (`workers.adapters.nemo_gym_staging`, tag `row_kind` = `nemo_gym`): one
  `StagedCallRecord`, whose token columns are the fields `token_ids_delta` (int64),
  `token_mask_delta` and `generation_log_probs_delta` (float32: NeMo Gym's digest hashes float32
  bit patterns, so what is read back re-digests exactly) and whose other fields are tags; its
  extras, when it has any, as MessagePack bytes in `gym_extras`; each framework attachment (media a
  VLM call ran on) as its raw bytes in `attach__<name>`, with its dtype and shape in the tag
  `attachments`, so it comes back bit for bit.

Pure: it builds and reads rows; `streams.tq` moves them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from tensordict import TensorDict

from schemas.gym_receipt import staging_key
from schemas.gym_verify import StagedCall
from schemas.row_fields import taken_by_row

__all__ = ["staging_key"]

# rlstream's own staged fields.
SEGMENT_FIELDS = ("token_ids", "token_mask", "generation_logprobs")
ROUTED_EXPERTS = "routed_experts"

# Tags of every staged row.
ROLLOUT_ID_TAG = "rollout_id"
CALL_ID_TAG = "call_id"
GROUP_ID_TAG = "group_id"
WEIGHT_VERSION_TAG = "weight_version"
# Wall-clock milliseconds when the row was staged (the sweeper's age).
STAGED_AT_TAG = "staged_at_ms"
# rlstream rows: the width of each token's routed experts when the row carries them.
ROUTED_EXPERTS_K_TAG = "routed_experts_k"

# NeMo Gym rows.
ROW_KIND_TAG = "row_kind"
NEMO_GYM_ROW = "nemo_gym"
GYM_TOKEN_FIELDS = ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta")
GYM_EXTRAS_FIELD = "gym_extras"
ATTACHMENT_PREFIX = "attach__"
ATTACHMENTS_TAG = "attachments"
HAS_EXTRAS_TAG = "has_extras"
# The StagedCallBaseSnapshot fields a NeMo Gym row keeps in its tags (beside rollout_id, call_id and
# weight_version above), under their NeMo Gym names.
GYM_SNAPSHOT_TAGS = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
# The types a NeMo Gym row's snapshot tags must have (NeMo Gym's `StagedCallBaseSnapshot`'s): a tag of
# another type is a row that cannot be read as a NeMo Gym call, refused before anything uses it.
_GYM_TAG_TYPES: dict[str, tuple[type, ...]] = {
    ROLLOUT_ID_TAG: (str,),
    CALL_ID_TAG: (str,),
    WEIGHT_VERSION_TAG: (int,),
    "schema_version": (int,),
    "digest_version": (int,),
    "extras_digest_version": (int,),
    "parent_call_id": (str, type(None)),
    "mode": (str,),
    "prev_len": (int,),
    "delta_len": (int,),
    "cum_len": (int,),
    "digest": (str,),
    "extras_digest": (str,),
    "chain_hash": (str,),
    "cumulative_hash": (str,),
}
# Attachment names: short identifiers, so a field name can never be another's.
ATTACHMENT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Bounds on what a row's `attachments` tag may describe (a VLM call has a few media tensors of a few dims).
MAX_ATTACHMENTS = 64
MAX_ATTACHMENT_DIMS = 16
ATTACHMENT_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}
_DTYPE_NAMES = {d: n for n, d in ATTACHMENT_DTYPES.items()}
_EXTRAS = msgspec.msgpack.Encoder()
_READ_EXTRAS = msgspec.msgpack.Decoder()


def row_tags(*, rollout_id: str, call_id: str, group_id: str, weight_version: int, staged_at_ms: int) -> dict[str, Any]:
    """The tags every staged row carries."""
    return {
        ROLLOUT_ID_TAG: rollout_id,
        CALL_ID_TAG: call_id,
        GROUP_ID_TAG: group_id,
        WEIGHT_VERSION_TAG: weight_version,
        STAGED_AT_TAG: staged_at_ms,
    }


_SAMPLE_ID = re.compile(r"^(?P<group>.+)_g(?P<index>0|[1-9][0-9]*)$")


def sample_id(group_id: str, rollout_index: int) -> str:
    """NeMo RL's canonical id of a group's row i, `{group_id}_g{i}`; NeMo RL's rollout ids are these too."""
    return f"{group_id}_g{rollout_index}"


def group_of_rollout(rollout_id: str) -> str:
    """The prompt group of a rollout named by NeMo RL's convention `{group_id}_g{i}`; ValueError otherwise."""
    match = _SAMPLE_ID.match(rollout_id)
    if match is None:
        raise ValueError(f"rollout id {rollout_id!r} is not '{{group_id}}_g{{i}}': say which group it is in")
    return match.group("group")


def owned_by(tags: Mapping[str, Any] | None, group_id: str, rollout_id: str) -> bool:
    """Whether a row's tags say it was staged for this group's rollout (a receipt may use only those)."""
    return tags is not None and tags.get(GROUP_ID_TAG) == group_id and tags.get(ROLLOUT_ID_TAG) == rollout_id


def is_gym_row(tags: Mapping[str, Any] | None) -> bool:
    return tags is not None and tags.get(ROW_KIND_TAG) == NEMO_GYM_ROW


def attachment_problem(name: Any, value: Any) -> str | None:
    """Why an attachment cannot be staged (None when it can): a bad name, not a CPU-able tensor, a dtype
    the packed layout does not carry."""
    if not isinstance(name, str) or not ATTACHMENT_NAME.match(name):
        return f"attachment name {name!r} must match {ATTACHMENT_NAME.pattern}"
    if taken_by_row(name):
        return (
            f"attachment name {name!r} is a training row field's (name media as the model's inputs: pixel_values, ...)"
        )
    if not isinstance(value, torch.Tensor) or value.is_nested or value.is_sparse:
        return f"attachment {name!r} must be a dense torch.Tensor, got {type(value).__name__}"
    if value.dtype not in _DTYPE_NAMES:
        return f"attachment {name!r} has dtype {value.dtype}, which TQ rows here do not carry"
    return None


def gym_row(
    record: Any,
    *,
    group_id: str,
    staged_at_ms: int,
    attachments: Mapping[str, torch.Tensor] | None = None,
) -> tuple[TensorDict, dict[str, Any]]:
    """The fields (one row) and tags of a NeMo Gym `StagedCallRecord` (read by attribute) and its
    attachments; ValueError naming what cannot be staged."""
    for name, value in (attachments or {}).items():
        problem = attachment_problem(name, value)
        if problem is not None:
            raise ValueError(problem)
    fields: dict[str, torch.Tensor] = {
        "token_ids_delta": torch.tensor([record.token_ids_delta], dtype=torch.int64),
        "token_mask_delta": torch.tensor([record.token_mask_delta], dtype=torch.float32),
        "generation_log_probs_delta": torch.tensor([record.generation_log_probs_delta], dtype=torch.float32),
    }
    extras = getattr(record, "extras", None)
    if extras is not None:
        fields[GYM_EXTRAS_FIELD] = torch.frombuffer(bytearray(_EXTRAS.encode(extras)), dtype=torch.uint8)[None]
    meta: dict[str, dict[str, Any]] = {}
    for name, value in (attachments or {}).items():
        raw = value.detach().to("cpu").contiguous()
        flat = raw.reshape(-1)
        fields[ATTACHMENT_PREFIX + name] = (flat if flat.dtype is torch.uint8 else flat.view(torch.uint8))[None]
        meta[name] = {"dtype": _DTYPE_NAMES[raw.dtype], "shape": list(raw.shape)}
    tags = row_tags(
        rollout_id=record.rollout_id,
        call_id=record.model_call_id,
        group_id=group_id,
        weight_version=record.weight_version,
        staged_at_ms=staged_at_ms,
    )
    tags.update({name: getattr(record, name) for name in GYM_SNAPSHOT_TAGS})
    tags.update({ROW_KIND_TAG: NEMO_GYM_ROW, HAS_EXTRAS_TAG: extras is not None, ATTACHMENTS_TAG: meta})
    return TensorDict(fields, batch_size=[1]), tags


def gym_tags_problem(tags: Mapping[str, Any] | None) -> str | None:
    """Why a staged row's tags are not a NeMo Gym call's (None when they are): every snapshot tag of its
    type, `has_extras` a bool, `attachments` a bounded mapping of names to a dtype and a shape.

    Tags are read back from TQ: input. Checked before any of them picks the fields to read or shapes
    a tensor, so a corrupt row is `invalid_staging_row`, never an exception out of finalize.
    """
    if not is_gym_row(tags):
        return "the row was not staged as a NeMo Gym call"
    missing = [n for n in _GYM_TAG_TYPES if n not in tags]
    if missing:
        return f"its tags lack {', '.join(missing)}"
    for name, types in _GYM_TAG_TYPES.items():
        value = tags[name]
        if not isinstance(value, types) or isinstance(value, bool):
            return f"its tag {name!r} is {type(value).__name__}, not {' or '.join(t.__name__ for t in types)}"
    if not isinstance(tags.get(HAS_EXTRAS_TAG, False), bool):
        return f"its tag {HAS_EXTRAS_TAG!r} is not a bool"
    meta = tags.get(ATTACHMENTS_TAG, {})
    if not isinstance(meta, Mapping):
        return f"its tag {ATTACHMENTS_TAG!r} is {type(meta).__name__}, not a mapping"
    if len(meta) > MAX_ATTACHMENTS:
        return f"it names {len(meta)} attachments, more than {MAX_ATTACHMENTS}"
    for name, spec in meta.items():
        if not isinstance(name, str) or not ATTACHMENT_NAME.match(name) or taken_by_row(name):
            return f"its attachment name {name!r} is not an attachment's (or is a training row field's)"
        if (
            not isinstance(spec, Mapping)
            or not isinstance(spec.get("dtype"), str)
            or spec["dtype"] not in ATTACHMENT_DTYPES
        ):
            return f"its attachment {name!r} has no dtype rlstream carries"
        shape = spec.get("shape")
        if (
            not isinstance(shape, list | tuple)
            or len(shape) > MAX_ATTACHMENT_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            return f"its attachment {name!r} has no shape of at most {MAX_ATTACHMENT_DIMS} non-negative sizes"
    return None


def gym_fields(tags: Mapping[str, Any], *, extras: bool = True, attachments: bool = True) -> tuple[str, ...]:
    """The fields of a NeMo Gym row a get selects, from its tags (which must have passed
    `gym_tags_problem`): its token columns, and its extras and attachments when asked for (a reader
    selects only what it uses: NeMo Gym leaves extras and media behind the key until their use)."""
    extra = (GYM_EXTRAS_FIELD,) if extras and tags.get(HAS_EXTRAS_TAG) else ()
    names = (tags.get(ATTACHMENTS_TAG) or {}) if attachments else {}
    return (*GYM_TOKEN_FIELDS, *extra, *(ATTACHMENT_PREFIX + n for n in sorted(names)))


@dataclass(frozen=True, eq=False)
class GymStagedRow:
    """A NeMo Gym row read back: its base snapshot, its extras (None when it has none or they were not
    read) and its attachments (empty when it has none or they were not read)."""

    call: StagedCall
    extras: dict[str, Any] | None
    attachments: dict[str, torch.Tensor]


def _row_values(value: torch.Tensor) -> torch.Tensor:
    if value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    return value


def gym_staged_row(
    tags: Mapping[str, Any], fields: Mapping[str, torch.Tensor], *, extras: bool = True, attachments: bool = True
) -> GymStagedRow | str:
    """The staged call a NeMo Gym row holds, or why the row is not one (`invalid_staging_row`);
    `fields` as selected by `gym_fields` with the same `extras` and `attachments`.

    The snapshot is not validated here: whatever disagrees with its receipt or its own digest is
    `verify_and_linearize`'s to refuse, with NeMo Gym's code. Only a row that cannot even be read
    as one is refused here.
    """
    problem = gym_tags_problem(tags)
    if problem is not None:
        return problem
    columns = {}
    for name in GYM_TOKEN_FIELDS:
        value = fields.get(name)
        if not isinstance(value, torch.Tensor) or value.is_nested or _row_values(value).dim() != 1:
            return f"{name} is missing or not one row"
        columns[name] = _row_values(value)
    if columns["token_ids_delta"].dtype != torch.int64 or any(
        columns[n].dtype != torch.float32 for n in GYM_TOKEN_FIELDS[1:]
    ):
        return "its token columns are not int64 ids and float32 masks and logprobs"
    call = StagedCall(
        rollout_id=tags[ROLLOUT_ID_TAG],
        model_call_id=tags[CALL_ID_TAG],
        weight_version=tags[WEIGHT_VERSION_TAG],
        token_ids_delta=columns["token_ids_delta"].tolist(),
        token_mask_delta=columns["token_mask_delta"].tolist(),
        generation_log_probs_delta=columns["generation_log_probs_delta"].tolist(),
        **{name: tags[name] for name in GYM_SNAPSHOT_TAGS},
    )
    decoded = None
    if extras and tags.get(HAS_EXTRAS_TAG):
        raw = fields.get(GYM_EXTRAS_FIELD)
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
            return "its extras are missing"
        try:
            decoded = _READ_EXTRAS.decode(_row_values(raw).numpy().tobytes())
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested past the stack
            return f"its extras do not decode ({type(exc).__name__}: {exc})"
    media = {}
    for name, spec in ((tags.get(ATTACHMENTS_TAG) or {}) if attachments else {}).items():
        raw = fields.get(ATTACHMENT_PREFIX + name)
        dtype = ATTACHMENT_DTYPES[spec["dtype"]]
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.is_nested:
            return f"its attachment {name!r} is missing"
        # A copy, so the typed view starts aligned (and outlives the fetched buffer).
        flat = _row_values(raw).contiguous().clone()
        shape = list(spec["shape"])
        if flat.numel() != torch.empty(0, dtype=dtype).element_size() * math.prod(shape):
            return f"its attachment {name!r} holds {flat.numel()} bytes, not {shape} of {dtype}"
        media[name] = (flat if dtype is torch.uint8 else flat.view(dtype)).reshape(shape)
    return GymStagedRow(call, decoded, media)
