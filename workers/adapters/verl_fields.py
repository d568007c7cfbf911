"""rlstream's packed rows as verl v1 trajectories: field names, keys and tags (mirrors verl 0.9.1).

verl's v1 trainer reads one TQ row per trajectory, key ``{uid}_{session_id}_{index}``, jagged
fields as written by ``AgentLoopWorkerTQ._agent_loop_postprocess`` and ``AgentLoopOutput.as_dict``
(verl/trainer/ppo/v1/agent_loop_tq.py, verl/experimental/agent_loop/agent_loop.py). One rlstream
row is one whole rollout (all turns concatenated), so it becomes one verl trajectory with index 0.
With P = the row's prompt length (its ``prompt_ids_for_adv`` row) and L = ``input_lengths``:

| verl field          | from rlstream                      | dtype   | notes                                   |
| ------------------- | ---------------------------------- | ------- | --------------------------------------- |
| prompts             | input_ids[:P]                      | int64   | checked equal to prompt_ids_for_adv     |
| responses           | input_ids[P:L]                     | int64   | generated and tool/environment tokens   |
| input_ids           | input_ids[:L]                      | int64   | prompts + responses                     |
| attention_mask      | ones(L)                            | int64   | rows are unpadded                       |
| position_ids        | arange(L)                          | int64   | text only                               |
| response_mask       | token_mask[P:L]                    | int64   | 1 generated, 0 tool; 0s if sample_mask 0 |
| loss_mask           | = response_mask                    | int64   | verl stores both                        |
| rollout_log_probs   | generation_logprobs[P:L]           | float32 |                                         |
| rm_scores           | total_reward at the last token     | float32 | 0 elsewhere (verl's as_dict convention) |
| routed_experts      | routed_experts, row shape from its tag | int16 | only when the rows carry it       |
| sample_mask         | sample_mask                        | float32 | per row, for losses that scale by it    |
| uid                 | group_id (percent-encoded "_")     | str     | verl groups GRPO rows by it             |
| num_turns           | tag num_turns, else 2              | int     | _compute_metrics pops it (padding: 0)   |
| extra_fields        | min/max_global_steps, reward_extra_info {} | dict | as AgentLoopOutput.as_dict     |
| raw_prompt          | tag raw_prompt, else []            | list    | verl's dataset column                   |
| data_source         | tag data_source, else "rlstream"   | str     | _validate / reward managers key on it   |
| reward_model        | tag reward_model, else {}          | dict    | ground_truth for verl's dumps           |
| multi_modal_inputs  | {}                                 | dict    | text only; verl's padding sets it {}    |

The non-tensor columns are NonTensorStacks of plain values, as verl's ``list_of_dict_to_tensordict``
stores them, so verl's padding rows (copied from a real row, ``num_turns=0``) read back alike.

Tags: ``status`` "success", ``prompt_len``, ``response_len``, ``seq_len``, ``global_steps`` (the
step of the group's oldest weights), ``min_global_steps``/``max_global_steps`` (the row's weight
version as a step), and ``rlstream_group_id``/``rlstream_sample_id`` to trace a row back.

Group size: verl sizes its actor mini-batches as ``ppo_mini_batch_size * rollout.n`` rows, so every
group hands verl exactly its n rows. A rollout with a rejection reason (rlstream's one-pad-token
placeholder) becomes a row that carries nothing: the group's prompt, one response token, every
mask, score and logprob 0, a uid of its own (so GRPO's group mean and std leave it out, as verl's
padding rows do) and ``is_padding`` in its tag (so verl's metrics leave it out).

Groups verl cannot take are left out and named with the reason in ``VerlRows.unusable``: one of
another size than ``group_size`` (verl's ``rollout.n``: rlstream's producers and verl disagree on n,
which no row mapping can mend) and one with a row whose tokens do not start with its prompt. The
caller resolves them (the sampler dead-letters them); raising instead would crash verl on the same
group after every restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from schemas.payload import ROW_SHAPES_SUFFIX
from workers.trainer.batch import BatchMeta

# What the mapping reads from rlstream's rows (routed_experts too when the rows carry it).
RLSTREAM_FIELDS = (
    "input_ids",
    "input_lengths",
    "prompt_ids_for_adv",
    "token_mask",
    "generation_logprobs",
    "total_reward",
    "sample_mask",
)
VERL_TOKEN_FIELDS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "loss_mask",
    "rollout_log_probs",
    "rm_scores",
)
VERL_NON_TENSOR_FIELDS = (
    "num_turns",
    "extra_fields",
    "raw_prompt",
    "data_source",
    "reward_model",
    "multi_modal_inputs",
)
VERL_FIELDS = (*VERL_TOKEN_FIELDS, "sample_mask", "uid", *VERL_NON_TENSOR_FIELDS)
# One rlstream row is a prompt and its whole rollout: two turns unless the row says otherwise.
DEFAULT_NUM_TURNS = 2


def _non_tensor(tag: dict[str, Any], step: int, *, rejected: bool = False) -> dict[str, Any]:
    """The non-tensor columns verl reads of one row, from its tag where the rollout recorded them."""
    return {
        # A rejected rollout has no turn, as verl's padding rows (num_turns=0).
        "num_turns": 0 if rejected else int(tag.get("num_turns", DEFAULT_NUM_TURNS)),
        "extra_fields": {"min_global_steps": step, "max_global_steps": step, "reward_extra_info": {}},
        "raw_prompt": list(tag.get("raw_prompt", [])),
        "data_source": str(tag.get("data_source", "rlstream")),
        "reward_model": dict(tag.get("reward_model", {})),
        "multi_modal_inputs": {},
    }


def verl_uid(group_id: str) -> str:
    """The group id as a verl uid: verl splits keys on "_", so "%" and "_" are percent-encoded (reversible)."""
    return group_id.replace("%", "%25").replace("_", "%5F")


def verl_key(group_id: str, session_id: int) -> str:
    """verl's trajectory key: one session per rollout, one agent-loop output (index 0) per session."""
    return f"{verl_uid(group_id)}_{session_id}_0"


def rejected_uid(group_id: str, session_id: int) -> str:
    """The uid field of a rejected rollout's row: a group of its own, as verl's padding rows have."""
    return f"{verl_uid(group_id)}-rejected-{session_id}"


@dataclass(frozen=True)
class VerlRows:
    """What one TQ put into verl's partition takes, the rows standing for rejected rollouts, and the
    groups left out because verl cannot take them (group id -> why)."""

    keys: list[str]
    fields: TensorDict | None  # None only for a batch without rows
    tags: list[dict[str, Any]]
    rejected: int  # rows standing for rejected rollouts (fully masked)
    unusable: dict[str, str] = field(default_factory=dict)


def _starts_with_prompt(values: dict[str, list[torch.Tensor]], row: int) -> bool:
    length = int(values["input_lengths"][row])
    prompt = values["prompt_ids_for_adv"][row]
    p = int(prompt.shape[0])
    return p < length and torch.equal(values["input_ids"][row][:p].to(torch.int64), prompt.to(torch.int64))


def _rows_of(
    meta: BatchMeta, values: dict[str, list[torch.Tensor]], group_size: int | None
) -> tuple[list[tuple[int, int, int, str | None]], dict[str, str]]:
    """(batch row, group index, session id, rejection reason) of every row verl can take, and why the
    groups it cannot take are left out."""
    out, unusable, row = [], {}, 0
    for g_index, group in enumerate(meta.groups):
        size = len(group.sample_ids)
        rows = range(row, row + size)
        row += size
        reasons = group.rejection_reasons if len(group.rejection_reasons) == size else (None,) * size
        if group_size is not None and size != group_size:
            unusable[group.group_id] = (
                f"{size} rows, verl's rollout.n is {group_size}: rlstream's producers and verl must agree on"
                " the group size (verl sizes mini-batches by it)"
            )
            continue
        bad = [i for i, r in zip(range(size), rows) if reasons[i] is None and not _starts_with_prompt(values, r)]
        if bad:
            unusable[group.group_id] = f"row {group.sample_ids[bad[0]]!r}: input_ids do not start with its prompt"
            continue
        out.extend((r, g_index, session, reasons[session]) for session, r in zip(range(size), rows))
    return out, unusable


def _rejected_row(rows: dict[str, list[torch.Tensor]], values: dict[str, torch.Tensor], tag: dict[str, Any]) -> dict:
    """A rejected rollout as a row that weighs nothing: its group's prompt and one placeholder token."""
    prompt = values["prompt_ids_for_adv"].to(torch.int64)
    p = int(prompt.shape[0])
    # The placeholder row's own token (rlstream's pad value) stands for the response verl needs (>= 1 token).
    response = values["input_ids"][:1].to(torch.int64)
    ids = torch.cat([prompt, response])
    zeros = torch.zeros(1, dtype=torch.int64)
    out = {
        "prompts": prompt,
        "responses": response,
        "input_ids": ids,
        "attention_mask": torch.ones(p + 1, dtype=torch.int64),
        "position_ids": torch.arange(p + 1, dtype=torch.int64),
        "response_mask": zeros,
        "loss_mask": zeros.clone(),
        "rollout_log_probs": torch.zeros(1, dtype=torch.float32),
        "rm_scores": torch.zeros(1, dtype=torch.float32),
    }
    if "routed_experts" in values:
        # Every row of a batch must carry the field once one does; the row shape's last dim is k.
        shape = tag.get("routed_experts" + ROW_SHAPES_SUFFIX) or [1, 1]
        out["routed_experts"] = torch.zeros(p + 1, *shape[1:], dtype=torch.int16)
    for name, value in out.items():
        rows.setdefault(name, []).append(value)
    return {"prompt_len": p, "response_len": 1, "seq_len": p + 1}


def _one_row(rows: dict[str, list[torch.Tensor]], values: dict[str, torch.Tensor], tag: dict[str, Any]) -> dict:
    """The verl fields of one rlstream row (`values`: its jagged rows and scalars) and its sizes."""
    length = int(values["input_lengths"])
    ids = values["input_ids"][:length].to(torch.int64)
    p = int(values["prompt_ids_for_adv"].shape[0])  # checked by _rows_of: ids start with the prompt
    mask = values["token_mask"][p:length].to(torch.int64)
    if float(values["sample_mask"]) == 0.0:
        mask = torch.zeros_like(mask)  # a masked-out sample must contribute no loss
    scores = torch.zeros(length - p, dtype=torch.float32)
    scores[-1] = float(values["total_reward"])
    out = {
        "prompts": ids[:p],
        "responses": ids[p:],
        "input_ids": ids,
        "attention_mask": torch.ones(length, dtype=torch.int64),
        "position_ids": torch.arange(length, dtype=torch.int64),
        "response_mask": mask,
        "loss_mask": mask.clone(),
        "rollout_log_probs": values["generation_logprobs"][p:length].to(torch.float32),
        "rm_scores": scores,
    }
    if "routed_experts" in values:
        # Packed rows are flattened to 1-D; the tag holds each row's full shape (pack_payload).
        shape = tag.get("routed_experts" + ROW_SHAPES_SUFFIX)
        flat = values["routed_experts"]
        experts = flat.reshape(*shape) if shape else flat.reshape(length, -1)
        out["routed_experts"] = experts[:length].to(torch.int16)
    for name, value in out.items():
        rows.setdefault(name, []).append(value)
    return {"prompt_len": p, "response_len": length - p, "seq_len": length}


def _row_values(rows: TensorDict, names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    # unbind once per field: indexing a nested tensor row by row costs a dispatch each time.
    return {name: list(rows[name].unbind(0)) for name in names}


def to_verl_rows(
    meta: BatchMeta, rows: TensorDict, *, version_offset: int = 0, group_size: int | None = None
) -> VerlRows:
    """rlstream's jagged rows of `meta` (from `materialize(..., layout="jagged")`) in verl's names.

    A weight version w is verl step ``w - version_offset``. Every row goes in, a rejected one as a
    row that weighs nothing, except the groups verl cannot take (module doc); `group_size` (verl's
    rollout.n), when given, is checked.
    """
    names = [n for n in (*RLSTREAM_FIELDS, "routed_experts") if n in set(rows.keys())]
    values = _row_values(rows, names)
    every, unusable = _rows_of(meta, values, group_size)
    out: dict[str, list[torch.Tensor]] = {}
    keys, tags, uids = [], [], []
    plain: dict[str, list[Any]] = {name: [] for name in VERL_NON_TENSOR_FIELDS}
    for row, g_index, session, reason in every:
        group = meta.groups[g_index]
        tag = dict(group.tags[session])
        one = {n: values[n][row] for n in names}
        sizes = _one_row(out, one, tag) if reason is None else _rejected_row(out, one, tag)
        step = int(tag.get("weight_version", group.group_min_wv)) - version_offset
        keys.append(verl_key(group.group_id, session))
        uids.append(verl_uid(group.group_id) if reason is None else rejected_uid(group.group_id, session))
        for name, value in _non_tensor(tag, step, rejected=reason is not None).items():
            plain[name].append(value)
        verl_tag = {
            "status": "success",
            **sizes,
            "global_steps": group.group_min_wv - version_offset,
            "min_global_steps": step,
            "max_global_steps": step,
            "rlstream_group_id": group.group_id,
            "rlstream_sample_id": group.sample_ids[session],
        }
        if reason is not None:
            # verl's own flag for a row without signal: its metrics and sample counts leave it out.
            verl_tag.update(is_padding=True, rlstream_rejected=reason)
        tags.append(verl_tag)
    rejected = sum(reason is not None for *_, reason in every)
    if not keys:
        return VerlRows([], None, [], rejected, unusable)
    fields: dict[str, Any] = {n: torch.nested.as_nested_tensor(v, layout=torch.jagged) for n, v in out.items()}
    fields["sample_mask"] = torch.stack(
        [
            values["sample_mask"][row].to(torch.float32) if reason is None else torch.tensor(0.0)
            for row, *_, reason in every
        ]
    )
    fields["uid"] = NonTensorStack(*uids)
    for name, values_ in plain.items():
        fields[name] = NonTensorStack(*values_)
    return VerlRows(keys, TensorDict(fields, batch_size=[len(keys)]), tags, rejected, unusable)
