"""Every differential scenario on the models alone, checked against what the real systems showed.

The same scenarios run against the real broker and TQ in tests/integration/sim/; here they run in
the model's virtual time (milliseconds), so a change to a model that breaks a claim fails at once.
"""

from __future__ import annotations

import pytest

from tests.tools.sim.scenarios import facts
from tests.tools.sim.worlds import ModelKafka, ModelTQ


@pytest.mark.parametrize("scenario", [*facts.KAFKA, *facts.KAFKA_OWN_BROKER], ids=lambda fn: fn.__name__)
def test_kafka_scenario(scenario):
    check = facts.KAFKA.get(scenario) or facts.KAFKA_OWN_BROKER[scenario]
    check(scenario(ModelKafka()))


@pytest.mark.parametrize("scenario", list(facts.TQ), ids=lambda fn: fn.__name__)
def test_tq_scenario(scenario):
    facts.TQ[scenario](scenario(ModelTQ(first_index=1000)))


def test_a_scenario_replays_identically_from_its_seed():
    first, second = ModelKafka(seed=5), ModelKafka(seed=5)
    facts.kafka_txn.fencing(first)
    facts.kafka_txn.fencing(second)
    assert list(first.env.history) == list(second.env.history) and len(first.env.history) > 50
