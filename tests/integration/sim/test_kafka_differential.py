"""The Kafka model held to the real broker: the same client calls on both, what the clients saw compared.

Each scenario (tests/tools/sim/scenarios/kafka_*.py; the claims it covers in its docstring, the
list in tests/tools/sim/kafka/__init__.py) runs on the session's broker and on a fresh model
cluster. Error codes and flags, offsets, records, positions and watermarks compare exactly; where
the broker's choice is nondeterministic (which partitions move in a rebalance, when a round
completes) the scenario records invariants both must satisfy. Then the facts the real broker
showed are checked (scenarios/facts.py), so a claim fails even if both runs drift together.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.tools.sim.scenarios import facts, kafka_seq
from tests.tools.sim.worlds import ModelKafka, RealKafka


@pytest.fixture(scope="module")
def real(kafka) -> RealKafka:
    return RealKafka(kafka)


def both(real: RealKafka, scenario, *args):
    seen = scenario(real, *args)
    model = scenario(ModelKafka(), *args)
    assert seen == model, _diff(seen, model)
    return seen


def _diff(seen, model) -> str:
    if not (isinstance(seen, dict) and isinstance(model, dict)):
        return f"real {seen!r}\nmodel {model!r}"
    keys = sorted(set(seen) | set(model), key=str)
    return "\n".join(
        f"{k}:\n  real  {seen.get(k)!r}\n  model {model.get(k)!r}" for k in keys if seen.get(k) != model.get(k)
    )


@pytest.mark.parametrize("scenario", list(facts.KAFKA), ids=lambda fn: fn.__name__)
def test_the_model_sees_what_the_broker_shows(real, scenario):
    facts.KAFKA[scenario](both(real, scenario))


_step = st.one_of(
    st.tuples(st.just("produce"), st.integers(0, 1), st.integers(0, 1)),
    st.tuples(st.just("plain"), st.integers(0, 1)),
    st.tuples(st.just("begin"), st.integers(0, 1)),
    st.tuples(st.just("commit"), st.integers(0, 1)),
    st.tuples(st.just("abort"), st.integers(0, 1)),
    st.tuples(st.just("fence"), st.integers(0, 1)),
)


# No shrinking against the broker (each example takes seconds there): a failing example is printed
# whole, and replays on the model alone in milliseconds.
@settings(
    max_examples=8,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(_step, min_size=1, max_size=12))
def test_generated_transaction_sequences(real, steps):
    """K1, K2, K4, K5 over generated interleavings of two transactional producers and a plain one."""
    both(real, kafka_seq.transactions, steps)


# The long run, for `make drills` (about 2 s an example against the broker).
@pytest.mark.drill
@settings(
    max_examples=150,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=st.lists(_step, min_size=1, max_size=25))
def test_generated_transaction_sequences_long(real, steps):
    both(real, kafka_seq.transactions, steps)
