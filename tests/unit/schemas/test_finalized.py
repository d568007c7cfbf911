import math

import pytest

from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup, SourceRange


def group(**changes):
    fields = dict(
        group_id="g",
        prompt_idx=1,
        partition_id="train",
        sample_ids=("g_g0", "g_g1"),
        tags=({"weight_version": 3, "shape": [4, 8]}, {"weight_version": 3, "x": None}),
        group_min_wv=3,
        group_max_wv=4,
        canonical_output_tokens=10,
        valid_row_count=1,
        total_row_count=2,
        rejection_reasons=(None, "missing_receipt"),
        dropped=False,
        drop_reason=None,
        metrics={"ms": 1.5},
        source=SourceRange("t", 0, 5, 9),
    )
    fields.update(changes)
    return FinalizedGroup(**fields)


def test_valid_group_round_trips_with_tag_value_types():
    message = group()
    back = FinalizedGroup.from_bytes(message.to_bytes())
    assert back == message
    assert back.tags[0]["shape"] == [4, 8]
    assert back.source == SourceRange("t", 0, 5, 9)


@pytest.mark.parametrize(
    "changes,path",
    [
        ({"tags": ({},)}, "finalized_group.tags"),
        ({"rejection_reasons": (None,)}, "finalized_group.rejection_reasons"),
        ({"valid_row_count": 2}, "finalized_group.valid_row_count"),
        ({"group_max_wv": 2}, "finalized_group.group_max_wv"),
        ({"drop_reason": "stale"}, "finalized_group.drop_reason"),
        ({"dropped": True}, "finalized_group.drop_reason"),
        ({"sample_ids": (), "tags": ()}, "finalized_group.sample_ids"),
        ({"metrics": {"ms": math.nan}}, 'finalized_group.metrics["ms"]'),
        ({"tags": ({"a": math.inf}, {})}, 'finalized_group.tags[0]["a"]'),
        ({"group_id": ""}, "finalized_group.group_id"),
    ],
)
def test_group_checks(changes, path):
    with pytest.raises(SchemaError) as info:
        group(**changes)
    assert info.value.path == path


def test_a_dropped_group_may_carry_no_rows():
    dropped = group(
        dropped=True,
        drop_reason="all_rollouts_failed",
        sample_ids=(),
        tags=(),
        valid_row_count=0,
        rejection_reasons=("rollout_failed", "missing_receipt"),
    )
    assert FinalizedGroup.from_bytes(dropped.to_bytes()).dropped


def test_source_range_checks():
    with pytest.raises(SchemaError) as info:
        SourceRange("t", 0, 9, 5)
    assert info.value.path == "source_range.last_offset"


def test_tag_of_an_unsupported_type_is_rejected_on_decode():
    import msgspec

    raw = msgspec.msgpack.decode(group().to_bytes())
    raw["tags"][1]["x"] = {"nested": 1}
    with pytest.raises(SchemaError) as info:
        FinalizedGroup.from_bytes(msgspec.msgpack.encode(raw))
    assert info.value.path.startswith("finalized_group.tags[1]")
