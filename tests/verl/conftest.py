"""tests/verl: rlstream inside verl 0.9.1's own code on CPU (`make test-verl`, .venv-verl only).

The session's real Kafka broker and Ray/TQ are the integration suite's fixtures; the tiny model,
tokenizer and datasets verl needs are built here from configs (nothing downloaded).
"""

from __future__ import annotations

import pytest

from tests.integration import conftest as integration
from tests.verl.tiny import TinyFiles, build_tiny_files

# The integration suite's session fixtures: one real broker, one Ray with TQ (not its collection hook).
broker, kafka, tq_session, tq_store = (
    integration.broker,
    integration.kafka,
    integration.tq_session,
    integration.tq_store,
)
unique, make_topic = integration.unique, integration.make_topic


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyFiles:
    return build_tiny_files(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def verl_services(tiny, tq_session, tmp_path_factory):
    """The stand-in rollout server and verl's reward workers (named Ray actors: one set per session)."""
    import ray

    from tests.verl.cpu_verl import compose, cpu_overrides, shared_services

    shared = shared_services(compose(cpu_overrides(tiny, str(tmp_path_factory.mktemp("unused")))))
    yield shared
    for actor in [shared.server, *shared.reward_loop_manager.reward_loop_workers]:
        ray.kill(actor)


@pytest.fixture
def verl_run(kafka, tq_store, unique, tiny, tmp_path, verl_services):
    """A verl run under a unique prefix, with rlstream's reassembler running for it."""
    from tests.integration.helpers import setup_topics
    from tests.verl.cpu_verl import ReassemblerThread, VerlRun

    prefix = f"verl-{unique}"
    names = setup_topics(kafka, prefix, partitions=2)
    run = VerlRun(
        names, prefix, f"verl-{unique}", str(tmp_path / "checkpoints"), tiny, kafka.bootstrap_servers, verl_services
    )
    reassembler = ReassemblerThread(kafka, tq_store, prefix)
    yield run
    reassembler.close()


@pytest.fixture(autouse=True)
def _verl_partitions_empty(request):
    """Each test starts as a fresh verl run: nothing in verl's own partitions (the session's TQ is shared)."""
    if "tq_session" not in request.fixturenames:
        yield
        return
    import transfer_queue as tq

    for partition in ("train", "val"):
        keys = list(tq.kv_list(partition).get(partition, {}))
        if keys:
            tq.kv_clear(keys=keys, partition_id=partition)
    yield


@pytest.fixture(autouse=True)
def _tq_unguarded():
    # rlstream's replay buffer guards TQ's close and checkpoints when verl builds it; the session's
    # TQ gets TQ's own functions back after each test.
    yield
    from workers.adapters import verl_tq_guard

    verl_tq_guard.uninstall()
