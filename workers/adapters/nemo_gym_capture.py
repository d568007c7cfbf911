"""NeMo Gym's capture driven end to end on CPU: engine turns through `RolloutTokenCapture` into a sink,
NeMo Gym's ledger, and the `GymReceipt` rlstream publishes.

What an inference worker and a NeMo Gym harness do around a rollout, with NeMo Gym's own code at
every step: each model call is admitted (`CaptureAdmission`: a text root, then token_in children
with their parent's exact prefix and chain hash), the engine's output goes through a
`CaptureAdapter` into `RolloutTokenCapture`, which stages the delta (and any attachments) in the
sink before it acknowledges the call with `CommitCoords`; the acknowledged call becomes a
`CallRecord` in NeMo Gym's capture ledger (`InMemoryLineageStore`), and at the rollout's end the
ledger's manifest becomes the `RolloutReceipt` (terminal chosen by NeMo Gym's parent-link walk unless
declared; a failed call poisons the receipt with NeMo Gym's reason). `SyntheticEngineAdapter` is the
small adapter for engine output given as plain token lists (no vLLM): the demo and the tests use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from schemas.gym_receipt import GymReceipt, GymRolloutReceipt


@dataclass(frozen=True, eq=False)
class EngineTurn:
    """One model call as an engine returns it: the tokens fed since the previous output, what it
    generated with their logprobs, and what the worker stages beside them.

    `attachments` (the processed media the call ran on, e.g. `{"pixel_values": tensor}`) are staged
    in the same write as the tokens; `fail` makes the worker report the call's capture as failed.
    """

    input_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    weight_version: int
    extras: Mapping[str, Any] | None = None
    attachments: Mapping[str, torch.Tensor] | None = None
    fail: bool = False


class SyntheticEngineAdapter:
    """NeMo Gym's `CaptureAdapter` over a plain response: `{"prompt_token_ids", "output_token_ids",
    "output_logprobs", "extras"}` (what a vLLM adapter reads from a chat completion)."""

    def enter_prefix(self, request_payload: dict[str, Any], prefix_ids: list[int]) -> dict[str, Any]:
        return {**request_payload, "prompt_token_ids": list(prefix_ids)}

    def extract_prompt_ids(self, response_payload: Any) -> list[int]:
        return list(response_payload["prompt_token_ids"])

    def extract_generation(self, response_payload: Any) -> tuple[list[int], list[float]]:
        return list(response_payload["output_token_ids"]), [float(x) for x in response_payload["output_logprobs"]]

    def extract_extras(self, response_payload: Any) -> dict[str, Any] | None:
        extras = response_payload.get("extras")
        return None if extras is None else dict(extras)


@dataclass
class CapturedRollout:
    """A rollout's NeMo Gym receipt and the coordinates each call was acknowledged with."""

    receipt: Any  # nemo_gym RolloutReceipt
    coords: list[Any] = field(default_factory=list)


def capture_rollout(
    capture: Any,
    rollout_id: str,
    turns: Sequence[EngineTurn],
    *,
    declared_terminal: str | None = None,
    failure_reason: str | None = None,
) -> CapturedRollout:
    """Run `turns` (call ids `c0, c1, ...`, each continuing the previous) through NeMo Gym's
    `capture` (a `RolloutTokenCapture`) and ledger, and build the rollout's receipt.

    `failure_reason` (the environment crashed, say) poisons the receipt as a harness does.
    Synchronous (NeMo Gym's ledger is async; each of its calls runs to completion here): call it
    from a thread without a running event loop.
    """
    from nemo_gym.token_id_capture.lineage import InMemoryLineageStore
    from nemo_gym.token_id_capture.staging import CallRecord, CaptureAdmission
    from nemo_gym.token_id_capture.staging.records import WORKER_CAPTURE_FAILED_REASON, CaptureLedgerCommit

    ledger = InMemoryLineageStore()  # one per rollout: its rows go with it
    cumulative: list[int] = []
    parent, parent_hash = None, None
    coords_out = []
    for i, turn in enumerate(turns):
        call_id = f"c{i}"
        admission = CaptureAdmission(
            rollout_id=rollout_id,
            model_call_id=call_id,
            parent_call_id=parent,
            prev_len=len(cumulative),
            mode="text" if parent is None else "token_in",
            required_prefix_token_ids=list(cumulative) if parent is not None else [],
            parent_chain_hash=parent_hash,
        )
        call = capture.begin_call(admission, weight_version=turn.weight_version)
        if turn.fail:
            coords = capture.fail_call(call, reason="engine error")
        else:
            request = capture.adapter.enter_prefix({}, list(cumulative))
            response = {
                "prompt_token_ids": request["prompt_token_ids"] + list(turn.input_ids),
                "output_token_ids": list(turn.output_ids),
                "output_logprobs": list(turn.output_logprobs),
                "extras": turn.extras,
            }
            coords = capture.complete_call_from_response(call, response, attachments=turn.attachments)
        coords_out.append(coords)
        if coords.disposition != "staged":
            asyncio.run(ledger.record_failure(rollout_id, call_id, WORKER_CAPTURE_FAILED_REASON))
            break
        record = CallRecord(
            model_call_id=call_id,
            parent_call_id=coords.parent_call_id,
            prev_len=coords.prev_len,
            delta_len=coords.delta_len,
            cum_len=coords.cum_len,
            weight_version=coords.weight_version,
            digest=coords.digest,
            extras_digest=coords.extras_digest,
            staging_key=coords.staging_key,
            mode=admission.mode,
            chain_hash=coords.chain_hash,
            cumulative_hash=coords.cumulative_hash,
            response_id=f"resp-{rollout_id}-{call_id}",
            admitted_at=float(i),
        )
        commit = CaptureLedgerCommit(
            rollout_id=rollout_id,
            record=record,
            request_items=[{"role": "user", "content": f"turn {i}"}],
            response_items=[{"role": "assistant", "content": f"answer {i}"}],
        )
        asyncio.run(ledger.record(commit))
        cumulative = response["prompt_token_ids"] + list(turn.output_ids)
        parent, parent_hash = call_id, coords.chain_hash
    manifest = asyncio.run(ledger.manifest(rollout_id))
    return CapturedRollout(
        receipt_from_manifest(rollout_id, manifest, declared_terminal=declared_terminal, failure_reason=failure_reason),
        coords_out,
    )


def receipt_from_manifest(
    rollout_id: str,
    manifest: Mapping[str, Any],
    *,
    reward: float | None = None,
    declared_terminal: str | None = None,
    failure_reason: str | None = None,
) -> Any:
    """NeMo Gym's `RolloutReceipt` of a ledger manifest: the declared terminal, else NeMo Gym's
    parent-link walk (`select_terminal_call`); a failed call, a failed rollout or a terminal that
    cannot be chosen poisons it with the reason."""
    from nemo_gym.token_id_capture.staging import RolloutReceipt, select_terminal_call
    from nemo_gym.token_id_capture.staging.records import RolloutManifest

    parsed = RolloutManifest.model_validate(manifest)
    records = list(parsed.records)
    method = "declared" if declared_terminal is not None else "heuristic"
    if declared_terminal is not None:
        terminal, reason = declared_terminal, None
    else:
        selection = select_terminal_call(records)
        terminal, reason = selection.terminal_model_call_id, selection.reason
    poison = failure_reason or (parsed.failures[0].reason if parsed.failures else None)
    if terminal is None:
        poison = poison or reason
    if poison is not None:
        return RolloutReceipt(
            rollout_id=rollout_id,
            reward=reward,
            manifest=records,
            capture_poisoned=True,
            failure_reason=poison,
            terminal_model_call_id=terminal,
            terminal_selection=method if terminal is not None else None,
        )
    return RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        manifest=records,
        terminal_model_call_id=terminal,
        terminal_selection=method,
    )


def gym_receipt(
    receipt: Any,
    *,
    group_id: str,
    prompt_idx: int,
    rollout_index: int,
    group_size: int,
    reward: float,
    environment: str = "unknown",
    mask_sample: bool = True,
    loss_multiplier: float = 1.0,
    truncated: bool = False,
    invalid_tool_call_calls: Sequence[str] = (),
    malformed_thinking_calls: Sequence[str] = (),
) -> GymReceipt:
    """The `GymReceipt` rlstream publishes for a NeMo Gym `RolloutReceipt` (a model or its dict)."""
    inner = receipt.model_dump(mode="json") if hasattr(receipt, "model_dump") else dict(receipt)
    return GymReceipt(
        group_id=group_id,
        prompt_idx=prompt_idx,
        rollout_index=rollout_index,
        group_size=group_size,
        reward=reward,
        mask_sample=mask_sample,
        loss_multiplier=loss_multiplier,
        environment=environment,
        receipt=msgspec.convert(inner, GymRolloutReceipt),
        truncated=truncated,
        invalid_tool_call_calls=tuple(invalid_tool_call_calls),
        malformed_thinking_calls=tuple(malformed_thinking_calls),
    )


class SyntheticGymGroups:
    """Prompt groups of synthetic rollouts (`workers.rollout.synthetic`) captured with NeMo Gym's own
    code into rlstream's TQ staging: what `rlstream demo --nemo-gym` produces.

    Every `media_every`-th group's first rollout runs its last call on a small image, staged as the
    attachment `pixel_values` (bfloat16) beside its tokens. A rollout that failed before its first turn
    is a poisoned receipt with the environment's reason, as a harness reports it.
    """

    def __init__(self, store: Any, *, media_every: int = 4, staging_partition: str | None = None) -> None:
        from nemo_gym.token_id_capture.staging import RolloutTokenCapture

        from workers.adapters.nemo_gym_staging import TQStagingSink

        kwargs = {} if staging_partition is None else {"staging_partition": staging_partition}
        self._capture = RolloutTokenCapture(
            sink=TQStagingSink(store, **kwargs), weight_version_fn=lambda: 0, adapter=SyntheticEngineAdapter()
        )
        self._media_every = media_every

    def make_group(
        self, group_id: str, prompt_idx: int, weight_version: int, *, shape: Any, seed: int = 0
    ) -> list[GymReceipt]:
        from workers.rollout.synthetic import group_prompt, rollout_turns

        prompt = group_prompt(group_id, shape=shape, seed=seed)
        out = []
        for i in range(shape.group_size):
            turns, reward = rollout_turns(group_id, i, weight_version, shape=shape, seed=seed, prompt=prompt)
            engine = [
                EngineTurn(
                    t.input_ids.tolist(),
                    t.output_ids.tolist(),
                    t.output_logprobs.tolist(),
                    t.weight_version,
                )
                for t in turns or ()
            ]
            if engine and i == 0 and self._media_every and prompt_idx % self._media_every == 0:
                last = engine[-1]
                image = torch.full((1, 4, 12), float(prompt_idx % 7) / 8, dtype=torch.bfloat16)
                engine[-1] = EngineTurn(
                    last.input_ids, last.output_ids, last.output_logprobs, last.weight_version,
                    attachments={"pixel_values": image},
                )  # fmt: skip
            rollout_id = f"{group_id}_g{i}"
            done = capture_rollout(
                self._capture, rollout_id, engine, failure_reason=None if turns is not None else "env_crashed"
            )
            flagged = [f"c{k}" for k, t in enumerate(turns or ()) if t.invalid_tool_call]
            malformed = [f"c{k}" for k, t in enumerate(turns or ()) if t.malformed_thinking]
            out.append(
                gym_receipt(
                    done.receipt,
                    group_id=group_id,
                    prompt_idx=prompt_idx,
                    rollout_index=i,
                    group_size=shape.group_size,
                    reward=reward,
                    environment="synthetic",
                    invalid_tool_call_calls=flagged,
                    malformed_thinking_calls=malformed,
                )
            )
        return out
