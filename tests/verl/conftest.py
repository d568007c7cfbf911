"""tests/verl: rlstream inside verl 0.9.1's own code on CPU (`make test-verl`, .venv-verl only).

The session's real Kafka broker and Ray/TQ are the integration suite's fixtures; the tiny model,
tokenizer and datasets verl needs are built here from configs (nothing downloaded).
"""

from __future__ import annotations

import pytest

# The integration suite's session fixtures: one real broker, one Ray with TQ (not its collection hook).
from tests.integration.conftest import broker, kafka, make_topic, tq_session, tq_store, unique  # noqa: F401
from tests.verl.tiny import TinyFiles, build_tiny_files


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyFiles:
    return build_tiny_files(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def _tq_unguarded():
    # rlstream's replay buffer guards TQ's close and checkpoints when verl builds it; the session's
    # TQ gets TQ's own functions back after each test.
    yield
    from workers.adapters import verl_tq_guard

    verl_tq_guard.uninstall()
