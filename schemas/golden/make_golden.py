"""Write the golden vectors: `<kind>.msgpack` (bytes) and `<kind>.json` (their `to_dict()` form).

Run by hand after a deliberate wire change: `python schemas/golden/make_golden.py`. The package
never imports this file; tests compare decoding against the committed files.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.deadletter import DECODE_ERROR, DeadLetter
from schemas.finalized import FinalizedGroup, SourceRange
from schemas.gym_receipt import GymCallRecord, GymReceipt, GymRolloutReceipt
from schemas.receipt import CallRecord, Receipt
from schemas.request import ReassemblyRequest, RolloutReassemblerActorConfig
from schemas.state import GroupState, PartitionProgress
from schemas.regenerate import STAGING_LOST, Regenerate
from schemas.trainer_progress import TrainerProgress
from schemas.trainer_version import TrainerVersion

HERE = Path(__file__).resolve().parent

RECEIPT = Receipt(
    rollout_id="rollout-7f3a",
    group_id="group-000042",
    prompt_idx=42,
    rollout_index=1,
    group_size=4,
    reward=0.75,
    mask_sample=True,
    loss_multiplier=1.0,
    environment="math",
    failure_reason=None,
    manifest=(
        CallRecord("rollout-7f3a/call-0", "call-0", None, 0, 12, 12, 7, "0a1b2c3d4e5f6071"),
        CallRecord(
            "rollout-7f3a/call-1", "call-1", "call-0", 12, 9, 21, 8, "8192a3b4c5d6e7f8",
            invalid_tool_call=True,
        ),
    ),
    truncated=False,
)

# A NeMo Gym receipt of two calls (a text root and a token_in child) as rlstream carries it.
GYM_RECEIPT = GymReceipt(
    group_id="group-000042",
    prompt_idx=42,
    rollout_index=2,
    group_size=4,
    reward=0.5,
    mask_sample=True,
    loss_multiplier=1.0,
    environment="math",
    receipt=GymRolloutReceipt(
        rollout_id="group-000042_g2",
        reward=0.5,
        terminal_model_call_id="call-1",
        manifest=(
            GymCallRecord(
                model_call_id="call-0", prev_len=0, delta_len=5, cum_len=5, weight_version=7,
                digest="a" * 64, extras_digest="b" * 64, staging_key="group-000042_g2/call-0", mode="text",
                chain_hash="c" * 64, cumulative_hash="d" * 64, response_id="resp-0", admitted_at=1.5,
            ),
            GymCallRecord(
                model_call_id="call-1", parent_call_id="call-0", prev_len=5, delta_len=3, cum_len=8,
                weight_version=8, digest="e" * 64, extras_digest="b" * 64,
                staging_key="group-000042_g2/call-1", chain_hash="f" * 64, cumulative_hash="0" * 64,
                response_id="resp-1", output_fingerprint="1" * 64, fingerprint_version=1,
            ),
        ),
        terminal_selection="response_id",
        terminal_attribution_reason="response_id_match",
    ),
    invalid_tool_call_calls=("call-1",),
)

EXAMPLES = {
    "receipt": RECEIPT,
    "gym_receipt": GYM_RECEIPT,
    "finalized_group": FinalizedGroup(
        group_id="group-000042",
        prompt_idx=42,
        partition_id="train",
        sample_ids=("group-000042_g0", "group-000042_g1"),
        tags=(
            {"weight_version": 7, "prompt_idx": 42, "group_id": "group-000042",
             "rollout_index": 0, "num_invalid_tool_calls": 0,
             "routed_experts__row_shapes": [21, 8]},
            {"weight_version": 7, "prompt_idx": 42, "group_id": "group-000042",
             "rollout_index": 1, "num_invalid_tool_calls": 1,
             "routed_experts__row_shapes": [1, 8]},
        ),
        group_min_wv=7,
        group_max_wv=8,
        canonical_output_tokens=21,
        valid_row_count=1,
        total_row_count=2,
        rejection_reasons=(None, "missing_staging_row"),
        dropped=False,
        drop_reason=None,
        metrics={"finalize_ms": 3.5, "fetch_ms": 1.25},
        source=SourceRange("rlstream.rollout.receipts", 3, 1200, 1201),
        finalized_at_ms=1_764_000_000_000,
    ),
    "dead_letter": DeadLetter(
        source_topic="rlstream.rollout.receipts",
        source_partition=3,
        source_offset=1187,
        source_key=b"group-000041",
        original=b"\x81\xa4kind\xa7receipt\xff",
        error_kind=DECODE_ERROR,
        message="receipt: MessagePack data is malformed",
        worker_id="reassembler-0",
        time_ms=1_764_000_000_123,
        redrive_count=1,
        source_timestamp_ms=1_763_999_999_500,
    ),
    "group_state": GroupState(
        group_id="group-000042",
        status="closed",
        partition=3,
        first_offset=1200,
        last_offset=1201,
        first_seen_ms=1_763_999_999_000,
        outcome="finalized",
        finalized_at_ms=1_764_000_000_000,
        staging_keys=("rollout-7f3a/call-0", "rollout-7f3a/call-1"),
        closed_event_ms=1_763_999_999_800,
    ),
    "partition_progress": PartitionProgress(
        partition=3, emitted_through=1201, time_ms=1_764_000_000_000, horizon_ms=1_763_990_000_000, restore_from=5120
    ),
    "reassembly_request": ReassemblyRequest(
        group_id="group-000042",
        rollout_ids=("rollout-11aa", "rollout-7f3a"),
        canonical_sample_ids=("group-000042_g0", "group-000042_g1"),
        receipts=(None, RECEIPT.to_dict()),
        rewards=(0.0, 0.75),
        fallback_weight_version=6,
        prompt_idx=42,
        mask_sample=(False, True),
        loss_multiplier=0.5,
    ),
    "regenerate": Regenerate(
        prompt_idx=17,
        group_id="g-17",
        new_group_id="g-17~r1",
        group_size=4,
        weight_version=3,
        reason=STAGING_LOST,
        source="p.rollout.receipts[2]@41",
        worker_id="reassembler-0",
        time_ms=1_700_000_000_000,
    ),
    "trainer_version": TrainerVersion(
        trainer_id="trainer-0",
        consumer_group="trainers",
        version=12,
        batch_groups=32,
        time_ms=1_764_000_000_456,
        lost_groups=3,
        run="5f0c2a9e1b7d4c63",
    ),
    "trainer_progress": TrainerProgress(
        consumer_group="trainers",
        topic="run1.experience.finalized",
        partition=3,
        offset=1_204,
        token="5f0c2a9e1b7d4c63.2a",
        chunk=1,
        chunks=2,
        base=1_790,
        ranges=(2, 0, 3, 4, 1, 0),
        time_ms=1_764_000_000_789,
    ),
    "reassembler_config": RolloutReassemblerActorConfig(
        partition_id="train",
        staging_partition="staging",
        pad_token_id=151643,
        router_replay_enabled=True,
        defer_routed_experts_to_policy=False,
        max_seq_len=8192,
    ),
}


def main() -> None:
    for kind, message in EXAMPLES.items():
        assert message.kind() == kind
        (HERE / f"{kind}.msgpack").write_bytes(message.to_bytes())
        text = json.dumps(message.to_dict(), indent=2, sort_keys=True) + "\n"
        (HERE / f"{kind}.json").write_text(text)
        print(f"wrote {kind}.msgpack and {kind}.json")


if __name__ == "__main__":
    main()
