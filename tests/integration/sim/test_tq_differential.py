"""The TQ model held to the real TQ 0.1.11: the same operations on both, what the client saw compared.

Each scenario (tests/tools/sim/scenarios/tq.py) runs on the session's TQ, its pool of released
indexes drained first so that allocations come from its counter, and on a fresh model whose
counter starts there: global indexes then compare exactly, FIFO reuse and set orders included.
Claims: tests/tools/sim/tq/__init__.py (T1-T7).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import tq as scenarios
from tests.tools.sim.worlds import ModelTQ, RealTQ


@pytest.fixture(scope="module")
def real(tq_session):
    world = RealTQ()
    yield world
    world.cleanup()


def both(real: RealTQ, scenario, *args):
    real.drain()
    return scenario(real, *args), scenario(ModelTQ(first_index=real.base), *args)


def test_indexes_one_pool_for_all_partitions_reused_first_in_first_out(real):
    """T1, T3, T6: a partition's first key takes its pre-allocated index; released indexes are reused in
    release order by any partition; a key put again keeps its index and merges its tags."""
    seen, model = both(real, scenarios.index_pool)
    assert seen == model
    assert seen["reused"]["b"]["indexes"] == seen["first"]["a"]["indexes"][:1] + seen["first"]["b"]["indexes"]


def test_a_stale_clear_deletes_the_new_owners_data_and_leaves_its_entry_ready(real):
    """T4, T5: the index a clear looked up went to another partition's key before the clear ran."""
    seen, model = both(real, scenarios.stale_clear)
    assert seen == model
    assert seen["same_index"] and seen["after_clear_meta"]["ready"]
    assert seen["get_after_storage_clear"] == ("error", "StorageKeyNotFoundError")


def test_gets_by_meta_rows_fields_marked_and_missing(real):
    """T5: rows in the order asked, absent keys left out, rows without a common field, a row being cleared."""
    seen, model = both(real, scenarios.gets)
    assert seen == model
    assert not seen["marked"]["ready"] and seen["marked"]["fields"] == []


def test_a_put_stopped_between_its_requests_and_finished_later(real):
    """T2, T7: after the allocation the key is listed with no tags and no data; the rest applied later
    leaves what a whole put leaves."""
    seen, model = both(real, scenarios.put_steps)
    assert seen == model
    assert seen["listed_after_alloc"]["S"]["s1"] == {} and seen["listed"]["S"]["s1"] == {"key": "s1"}


_part = st.integers(0, 1)
_keys = st.lists(st.sampled_from(scenarios.KEYS), min_size=1, max_size=3, unique=True)
_slot = st.integers(0, 1)
_op = st.one_of(
    st.tuples(st.just("put"), _part, _keys),
    st.tuples(st.just("clear"), _part, _keys),
    st.tuples(st.just("get"), _part, _keys),
    st.tuples(st.just("list"), _part),
    st.tuples(st.just("lookup"), _part, _keys, _slot),
    st.tuples(st.just("stale_clear"), _slot),
    st.tuples(st.just("stale_storage"), _slot),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=14))
def test_sequences_of_puts_clears_gets_lists_and_stale_clears(real, ops):
    """T1-T6 over generated sequences: the model's client sees what TQ's does after every step."""
    seen, model = both(real, scenarios.sequence, ops)
    assert seen == model
