"""The TQ model held to the real TQ 0.1.11: the same operations on both, what the client saw compared.

Each scenario (tests/tools/sim/scenarios/tq.py) runs on the session's TQ, its pool of released
indexes drained first so that allocations come from its counter, and on a fresh model whose
counter starts there: global indexes then compare exactly, FIFO reuse and set orders included.
Claims: tests/tools/sim/tq/__init__.py (T1-T8).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import facts
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


@pytest.mark.parametrize("scenario", list(facts.TQ), ids=lambda fn: fn.__name__)
def test_the_model_sees_what_tq_shows(real, scenario):
    seen, model = both(real, scenario)
    assert seen == model
    facts.TQ[scenario](seen)


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
    st.tuples(st.just("held"), _part, _slot),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=14))
def test_sequences_of_puts_clears_gets_lists_and_stale_clears(real, ops):
    """T1-T6 and T8 over generated sequences: the model's client sees what TQ's does after every step."""
    seen, model = both(real, scenarios.sequence, ops)
    assert seen == model


# The long run, for `make drills`.
@pytest.mark.drill
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=30))
def test_sequences_long(real, ops):
    seen, model = both(real, scenarios.sequence, ops)
    assert seen == model
