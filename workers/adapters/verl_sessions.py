"""One verl agent-loop session as an rlstream rollout: its turns, its receipt and the segments to stage.

verl's agent loop (``AgentLoopOutput``) gives a session as the prompt ids, the response ids (model
output and tool/environment tokens alike), a response mask that is 1 on model output, the output's
logprobs and the weight versions it was generated with (``extra_fields`` min/max_global_steps, the
labels verl's ``update_weights(global_steps)`` gave the rollout servers). rlstream wants turns:
each model call's new input (the prompt, then each observation) and its output. The mask's runs
give them back: a run of 1s is a call's output, a run of 0s the observation fed to the next call.

Ids: the group is verl's prompt uid, the rollout ``{uid}-s{session}`` (staged under
``{uid}-s{session}/c{turn}``), so a prompt verl dispatches again after a crash stages and publishes
onto the same names, and the reassembler refuses the receipts of a group it closed already.
Versions: the first call is taken at the session's lowest label, later ones at its highest (verl
keeps no per-call label), each plus ``version_offset``. Logprobs default to 0 when verl did not
compute them (``rollout.calculate_log_probs=False``).

A group is always ``rollout.n`` rollouts (`group_rollouts`): verl's trainer sizes its mini-batches by
it, and a group of another size could only be dead-lettered by the sampler. A session that raised,
or whose output cannot be converted, is a failed receipt; so is each session verl did not ask for
(``__rollout_n__`` below rollout.n). A group whose receipts cannot be published at all is published
as failed receipts only (`failed_group`, nothing staged), so the reassembler closes it either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from workers.rollout.convert import Turn, failed_rollout, staged_rollout
from workers.rollout.publisher import StagedRollout

log = logging.getLogger("rlstream.adapters.verl")


def rollout_id(uid: str, session_id: int) -> str:
    return f"{uid}-s{session_id}"


def _runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[start]):
            runs.append((1 if mask[start] else 0, start, i))
            start = i
    return runs


def session_turns(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response_mask: Sequence[int],
    response_logprobs: Sequence[float] | None,
    *,
    first_version: int,
    last_version: int,
) -> list[Turn]:
    """The calls of one session: turn 0's input is exactly the prompt, later inputs the observations."""
    if len(response_mask) != len(response_ids):
        raise ValueError(f"response_mask has {len(response_mask)} entries, response_ids {len(response_ids)}")
    logprobs = list(response_logprobs) if response_logprobs is not None else [0.0] * len(response_ids)
    if len(logprobs) != len(response_ids):
        raise ValueError(f"response_logprobs has {len(logprobs)} entries, response_ids {len(response_ids)}")
    turns: list[Turn] = []
    pending = list(prompt_ids)
    if response_mask and not response_mask[0]:
        # An observation before any output: the prompt stays turn 0's input alone (it is verl's prompt).
        turns.append(Turn(pending, [], [], first_version))
        pending = []
    for value, start, end in _runs(response_mask):
        if not value:
            pending = pending + list(response_ids[start:end])
            continue
        version = first_version if not turns else last_version
        turns.append(Turn(pending, list(response_ids[start:end]), logprobs[start:end], version))
        pending = []
    if pending or not turns:  # a trailing observation, or a session without output
        turns.append(Turn(pending, [], [], last_version if turns else first_version))
    return turns


def _label(extra_fields: Mapping[str, Any], name: str) -> int:
    value = extra_fields.get(name)
    return int(value) if value is not None else 0


def session_rollout(
    uid: str,
    session_id: int,
    group_size: int,
    output: Mapping[str, Any],
    *,
    prompt_idx: int,
    environment: str,
    version_offset: int = 0,
    max_response_length: int | None = None,
) -> StagedRollout:
    """A finished session (verl's ``AgentLoopOutput`` fields as a mapping) as a rollout to publish."""
    extra = output.get("extra_fields") or {}
    first = _label(extra, "min_global_steps") + version_offset
    last = max(first, _label(extra, "max_global_steps") + version_offset)
    response = list(output["response_ids"])
    turns = session_turns(
        output["prompt_ids"],
        response,
        output["response_mask"],
        output.get("response_logprobs"),
        first_version=first,
        last_version=last,
    )
    reward = output.get("reward_score")
    return staged_rollout(
        turns,
        rollout_id=rollout_id(uid, session_id),
        group_id=uid,
        prompt_idx=max(0, prompt_idx),
        rollout_index=session_id,
        group_size=group_size,
        reward=float(reward) if reward is not None else 0.0,
        environment=environment,
        truncated=max_response_length is not None and len(response) >= max_response_length,
    )


def failed_session(
    uid: str, session_id: int, group_size: int, *, prompt_idx: int, environment: str, reason: str
) -> StagedRollout:
    """A session whose agent loop raised: a failed receipt, so the group still closes with n rollouts."""
    return failed_rollout(
        rollout_id=rollout_id(uid, session_id),
        group_id=uid,
        prompt_idx=max(0, prompt_idx),
        rollout_index=session_id,
        group_size=group_size,
        environment=environment,
        failure_reason=reason[:200] or "agent loop failed",
    )


def failed_group(uid: str, group_size: int, *, prompt_idx: int, environment: str, reason: str) -> list[StagedRollout]:
    """Every session of the group as a failed receipt: the reassembler closes it (and dead-letters it)."""
    return [
        failed_session(uid, i, group_size, prompt_idx=prompt_idx, environment=environment, reason=reason)
        for i in range(group_size)
    ]


def group_rollouts(
    uid: str,
    group_size: int,
    outputs: Sequence[Mapping[str, Any] | BaseException],
    *,
    prompt_idx: int,
    environment: str,
    asked: int | None = None,
    version_offset: int = 0,
    max_response_length: int | None = None,
) -> list[StagedRollout]:
    """The group's `group_size` rollouts from the outputs of the sessions that ran (an exception: it raised).

    `asked`: how many sessions verl asked for (``__rollout_n__``); those it did not ask for fail.
    """
    where = {"prompt_idx": prompt_idx, "environment": environment}
    staged = []
    for i in range(group_size):
        out = outputs[i] if i < len(outputs) else None
        if out is None:
            reason = f"verl asked for {asked} sessions of this prompt (__rollout_n__), rollout.n is {group_size}"
            staged.append(failed_session(uid, i, group_size, reason=reason, **where))
            continue
        if not isinstance(out, BaseException):
            try:
                staged.append(
                    session_rollout(
                        uid,
                        i,
                        group_size,
                        out,
                        version_offset=version_offset,
                        max_response_length=max_response_length,
                        **where,
                    )
                )
                continue
            except Exception as exc:  # noqa: BLE001 - one bad session must not leave its group open
                out = exc
        log.error("session %d of prompt %s failed", i, uid, exc_info=out)
        staged.append(failed_session(uid, i, group_size, reason=f"{type(out).__name__}: {out}", **where))
    return staged


def reaches_trainer(staged: Sequence[StagedRollout]) -> bool:
    """Whether the reassembler finalizes the group (a usable rollout) rather than dead-letter it."""
    return any(r.receipt.failure_reason is None for r in staged)
