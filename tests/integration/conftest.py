"""Shared, session-scoped integration fixtures: one real Kafka broker and one Ray/TQ for the whole suite."""

from __future__ import annotations

import gc
import uuid
from pathlib import Path

import pytest

from streams.admin import TopicSpec, create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig


@pytest.fixture(scope="session")
def broker(tmp_path_factory) -> LocalBroker:
    data_dir = Path(tmp_path_factory.mktemp("kafka"))
    with LocalBroker(BrokerConfig(data_dir=data_dir)) as b:
        yield b
        # Destroy clients still held in reference cycles while the broker can still answer them;
        # otherwise each logs connection errors until the interpreter exits.
        gc.collect()


@pytest.fixture(scope="session")
def kafka(broker) -> KafkaConfig:
    return KafkaConfig(broker.bootstrap_servers)


@pytest.fixture(scope="session")
def tq_session():
    from streams.tq import TQConfig, init_tq

    session = init_tq(TQConfig())
    yield session
    session.close()


@pytest.fixture(scope="session")
def tq_store(tq_session):
    from streams.tq import TQStore

    return TQStore()


@pytest.fixture
def unique() -> str:
    """A short unique name, so tests sharing the session broker never share topics or groups."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def make_topic(kafka, unique):
    def make(name: str = "t", partitions: int = 1, **config: str) -> str:
        topic = f"test.{unique}.{name}"
        create_topics(kafka, [TopicSpec(topic, partitions, config)])
        return topic

    return make


# The files that take minutes, run first, longest first (their wall times in one `make test` on 2
# cores, in seconds): with the suite spread over processes, a long file started last would leave the
# others idle at the end.
LONG_FIRST = (
    "test_chaos_drill.py",  # 365
    "test_trainer_faults.py",  # 176
    "test_live_run.py",  # 142
    "test_job_restart.py",  # 135
    "test_broker_loss.py",  # 115
    "test_job_resume.py",  # 86
    "test_trainer.py",  # 77
    "test_crash_recovery.py",  # 69
    "test_reassembler.py",  # 62
    "test_grpo.py",  # 45
    "test_zombie.py",  # 45
    "test_broker.py",  # 37
    "test_pool_restart.py",  # 37
    "test_verl_sampler.py",  # 36
    "test_replay.py",  # 32
    "test_kafka_broker_differential.py",  # 31
    "test_resume_old_job.py",  # 29
    "test_demo.py",
    "test_no_system_java.py",
    "test_restart.py",
)


def pytest_collection_modifyitems(config, items):
    # Everything under tests/integration talks to the real broker or Ray/TQ: mark it so
    # `-m "not integration"` (make test-unit) leaves it out.
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    # A stable sort: files keep their order otherwise, and the unit tests come last.
    items.sort(
        key=lambda item: (
            rank.get(Path(item.fspath).name, len(rank)) if here in Path(item.fspath).parents else len(rank) + 1
        )
    )
