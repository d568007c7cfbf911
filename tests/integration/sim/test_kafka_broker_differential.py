"""The Kafka model held to a broker of this module's own: compaction, retention and the broker down.

Its cleaner and retention check run every 500 ms (the session's broker keeps Kafka's 15 s and
5 min), and the broker-down test stops and restarts it, which the session's broker must never do.
Claims: tests/tools/sim/kafka/__init__.py (K16-K18).
"""

from __future__ import annotations

import pytest

from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from tests.tools.sim.scenarios import facts
from tests.tools.sim.worlds import ModelKafka, RealKafka

FAST_CLEANING = (
    ("log.retention.check.interval.ms", "500"),
    ("log.cleaner.backoff.ms", "500"),
    ("log.segment.delete.delay.ms", "0"),
    # The retention check's first run, 30 s after the start by default.
    ("log.initial.task.delay.ms", "0"),
)


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("sim-kafka")
    broker = LocalBroker(BrokerConfig(data_dir=data_dir, extra_properties=FAST_CLEANING)).start()
    yield broker
    broker.stop()


@pytest.fixture
def real(own_broker) -> RealKafka:
    return RealKafka(KafkaConfig(own_broker.bootstrap_servers), stop=own_broker.stop, start=own_broker.start)


def both(real, scenario):
    seen, model = scenario(real), scenario(ModelKafka())
    assert seen == model, f"real  {seen!r}\nmodel {model!r}"
    return seen


# The broker-down scenario last: it stops and restarts the broker the others use.
@pytest.mark.parametrize("scenario", list(facts.KAFKA_OWN_BROKER), ids=lambda fn: fn.__name__)
def test_the_model_sees_what_a_broker_of_its_own_shows(real, scenario):
    facts.KAFKA_OWN_BROKER[scenario](both(real, scenario))
