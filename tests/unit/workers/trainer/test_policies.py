"""Consumption policies: what each decides for a group of a given weight version, their order, their errors."""

import pytest

from schemas.errors import InvalidArgument, RlstreamError
from schemas.finalized import FinalizedGroup
from workers.trainer.policies import (
    Decision,
    InOrder,
    ReadyFirst,
    Windowed,
    in_order,
    policy_by_name,
    ready_first,
    weight_fifo,
    windowed,
)


def group(min_wv: int, gid: str | None = None) -> FinalizedGroup:
    return FinalizedGroup(
        group_id=gid or f"g-v{min_wv}",
        prompt_idx=0,
        partition_id="train",
        sample_ids=("s0",),
        tags=({},),
        group_min_wv=min_wv,
        group_max_wv=min_wv,
        canonical_output_tokens=1,
        valid_row_count=1,
        total_row_count=1,
        rejection_reasons=(None,),
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
    )


def test_windowed_yields_within_the_bound_and_evicts_beyond_it():
    p = windowed(2)
    assert [p.decide(group(v), 5) for v in (6, 5, 4, 3)] == [Decision.YIELD] * 4
    assert p.decide(group(2), 5) is Decision.EVICT
    assert p.decide(group(0), 5) is Decision.EVICT
    assert windowed(0).decide(group(4), 5) is Decision.EVICT
    assert not p.too_far_ahead(group(100), 0)


def test_windowed_keeps_arrival_order():
    ready = [group(1, "a"), group(3, "b"), group(2, "c")]
    assert [g.group_id for g in windowed(2).order(ready)] == ["a", "b", "c"]


def test_weight_fifo_takes_the_oldest_version_first_and_arrival_order_within_one():
    ready = [group(3, "a"), group(1, "b"), group(2, "c"), group(1, "d")]
    assert [g.group_id for g in weight_fifo(2).order(ready)] == ["b", "d", "c", "a"]
    assert weight_fifo(1).decide(group(3), 4) is Decision.YIELD
    assert weight_fifo(1).decide(group(2), 4) is Decision.EVICT
    assert policy_by_name("weight_fifo", max_staleness_versions=1) == weight_fifo(1)


def test_in_order_yields_only_the_current_version_holds_later_evicts_earlier():
    p = in_order(1)
    assert p.decide(group(5), 5) is Decision.YIELD
    assert p.decide(group(6), 5) is Decision.HOLD
    assert p.decide(group(9), 5) is Decision.HOLD
    assert p.decide(group(4), 5) is Decision.EVICT
    ready = [group(5, "x"), group(5, "y")]
    assert [g.group_id for g in p.order(ready)] == ["x", "y"]


def test_in_order_reports_held_groups_beyond_its_lookahead():
    p = in_order(1)
    assert not p.too_far_ahead(group(6), 5)
    assert p.too_far_ahead(group(7), 5)
    assert in_order(0).too_far_ahead(group(6), 5)


def test_ready_first_yields_anything_not_newer_than_the_trainer_and_never_evicts():
    p = ready_first()
    assert p.decide(group(0), 5) is Decision.YIELD
    assert p.decide(group(5), 5) is Decision.YIELD
    assert p.decide(group(6), 5) is Decision.HOLD
    assert not p.too_far_ahead(group(60), 5)
    ready = [group(3, "a"), group(1, "b")]
    assert [g.group_id for g in p.order(ready)] == ["a", "b"]


def test_policy_by_name_builds_each_policy():
    assert policy_by_name("windowed", max_staleness_versions=3) == Windowed(3)
    assert policy_by_name("in_order", max_lookahead_versions=2) == InOrder(2)
    assert policy_by_name("ready_first") == ReadyFirst()


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("newest", {}, "unknown consumption policy 'newest'; choose one of windowed, in_order, ready_first"),
        ("windowed", {}, "missing: max_staleness_versions"),
        ("ready_first", {"max_staleness_versions": 2}, "unknown: max_staleness_versions"),
        ("windowed", {"max_staleness_versions": -1}, "max_staleness_versions must be >= 0"),
        ("in_order", {"max_lookahead_versions": -2}, "max_lookahead_versions must be >= 0"),
    ],
)
def test_policy_by_name_rejects_bad_names_and_parameters_with_a_clear_error(name, params, message):
    with pytest.raises(InvalidArgument, match=message) as err:
        policy_by_name(name, **params)
    assert isinstance(err.value, RlstreamError) and isinstance(err.value, ValueError)
