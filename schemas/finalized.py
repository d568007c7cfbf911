"""`FinalizedGroup`: what a reassembler publishes once a prompt group's rows are packed in TQ."""

from __future__ import annotations

import msgspec

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import all_finite, at_least, non_empty, optional_non_empty, same_length

# A per-row tag value; `<field>__row_shapes` is a list[int] ([length, *per-token shape]) for a
# token-aligned field, and NeMo RL's {"shapes": [[...], ...], "pad": bool} for a packed multimodal one.
TagValue = str | int | float | bool | None | list[int] | dict[str, bool | list[list[int]]]


class SourceRange(msgspec.Struct, frozen=True):
    """The receipt offsets (inclusive) in one input partition that a finalized group consumed."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int

    def __post_init__(self) -> None:
        non_empty("source_range.topic", self.topic)
        at_least("source_range.partition", self.partition, 0)
        at_least("source_range.first_offset", self.first_offset, 0)
        at_least("source_range.last_offset", self.last_offset, self.first_offset)


class FinalizedGroup(Message, frozen=True, tag="finalized_group"):
    """Sample IDs, per-row tags, weight-version range and counts of one finalized prompt group.

    `sample_ids` and `tags` are parallel; `rejection_reasons` has one entry per row
    (`total_row_count`). A dropped group may carry no sample IDs, but must say why.
    """

    group_id: str
    prompt_idx: int
    partition_id: str
    sample_ids: tuple[str, ...]
    tags: tuple[dict[str, TagValue], ...]
    group_min_wv: int
    group_max_wv: int
    canonical_output_tokens: int
    valid_row_count: int
    total_row_count: int
    rejection_reasons: tuple[str | None, ...]
    dropped: bool
    drop_reason: str | None
    metrics: dict[str, float]
    source: SourceRange | None
    finalized_at_ms: int = 0

    def _validate(self) -> None:
        non_empty("finalized_group.group_id", self.group_id)
        non_empty("finalized_group.partition_id", self.partition_id)
        at_least("finalized_group.prompt_idx", self.prompt_idx, 0)
        at_least("finalized_group.group_min_wv", self.group_min_wv, 0)
        at_least("finalized_group.group_max_wv", self.group_max_wv, self.group_min_wv)
        at_least("finalized_group.canonical_output_tokens", self.canonical_output_tokens, 0)
        at_least("finalized_group.valid_row_count", self.valid_row_count, 0)
        at_least("finalized_group.total_row_count", self.total_row_count, self.valid_row_count)
        at_least("finalized_group.finalized_at_ms", self.finalized_at_ms, 0)
        same_length("finalized_group", ("sample_ids", "tags"), (self.sample_ids, self.tags))
        if len(self.rejection_reasons) != self.total_row_count:
            raise SchemaError(
                "finalized_group.rejection_reasons",
                f"has {len(self.rejection_reasons)} entries but total_row_count is {self.total_row_count}",
            )
        valid = sum(reason is None for reason in self.rejection_reasons)
        if valid != self.valid_row_count:
            raise SchemaError(
                "finalized_group.valid_row_count",
                f"is {self.valid_row_count} but {valid} rows have no rejection reason",
            )
        if self.dropped:
            non_empty("finalized_group.drop_reason", self.drop_reason or "")
        else:
            optional_non_empty("finalized_group.drop_reason", self.drop_reason)
            if self.drop_reason is not None:
                raise SchemaError("finalized_group.drop_reason", "is set but dropped is False")
            if len(self.sample_ids) != self.total_row_count:
                raise SchemaError(
                    "finalized_group.sample_ids",
                    f"has {len(self.sample_ids)} entries but total_row_count is {self.total_row_count}",
                )
        all_finite("finalized_group.metrics", self.metrics)
        for i, tag in enumerate(self.tags):
            all_finite(f"finalized_group.tags[{i}]", tag)
