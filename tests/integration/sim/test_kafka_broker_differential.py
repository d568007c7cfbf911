"""The Kafka model held to a broker of this module's own: compaction, retention and the broker down.

Its cleaner and retention check run every 500 ms (the session's broker keeps Kafka's 15 s and
5 min), and the broker-down test stops and restarts it, which the session's broker must never do.
Claims: tests/tools/sim/kafka/__init__.py (K16-K18).
"""

from __future__ import annotations

import pytest

from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from tests.tools.sim.scenarios import kafka_broker
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


def test_compaction_keeps_the_last_record_of_each_key_below_the_active_segment(real):
    """K16."""
    seen = both(real, kafka_broker.compaction)
    assert seen["records"] == seen["expected"] and (10, b"k2", None) in seen["records"]


def test_retention_deletes_old_records_and_moves_the_log_start(real):
    """K17."""
    seen = both(real, kafka_broker.retention)
    assert seen["low"] == 3 and seen["from_zero"] == [3, 4]


def test_what_each_call_sees_while_the_broker_is_down(real):
    """K18 (the broker stopped and started again on its data)."""
    seen = both(real, kafka_broker.broker_down)
    assert seen["committed"] == ("_TIMED_OUT", False, False, False)
    assert seen["commit_txn"] == ("_TIMED_OUT", False, True, False) and seen["commit_txn_after"] == ("ok", None)
    assert seen["visible"] == [b"a", b"t"]
