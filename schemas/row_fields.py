"""The names a training row's own fields take, which a packed multimodal input (a NeMo Gym call's
attachment) may not: media under one of them would overwrite the field or its geometry tag.
"""

from __future__ import annotations

from schemas.multimodal import ROW_SHAPES_SUFFIX
from schemas.violations import _INVALID_MASK, _MALFORMED_MASK, _VIOLATION_COUNTS_KEY

ROLLOUT_ENVIRONMENT = "rollout_environment"
# Row fields of every batch (`schemas.payload.record_to_train_batch`).
ROW_FIELDS = frozenset(
    {
        "input_ids",
        "input_lengths",
        "generation_logprobs",
        "token_mask",
        "sample_mask",
        "prompt_ids_for_adv",
        "mask_sample",
        "truncated",
        "total_reward",
        "routed_experts",
        _INVALID_MASK,
        _MALFORMED_MASK,
        _VIOLATION_COUNTS_KEY,
        ROLLOUT_ENVIRONMENT,
    }
)


def taken_by_row(name: str) -> bool:
    """Whether `name` is a row field's, or has the form of a packed field's geometry tag."""
    return name in ROW_FIELDS or name.endswith(ROW_SHAPES_SUFFIX)
