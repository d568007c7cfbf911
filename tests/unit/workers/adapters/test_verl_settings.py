"""What ``sampler_kwargs.rlstream`` builds: the consumer's defaults in a verl deployment."""

from __future__ import annotations

from tests.unit.memory_store import InMemoryStore
from workers.adapters.verl_settings import consumer_from_options
from workers.trainer.policies import ready_first


def test_lost_rows_are_dead_lettered_not_handed_back_unless_the_user_says_so():
    """A hand-back goes to rollout.regenerate, which nothing reads in a verl deployment."""
    options = {"bootstrap_servers": "localhost:1", "prefix": "p"}
    default = consumer_from_options(options, InMemoryStore(), ready_first())
    chosen = consumer_from_options({**options, "hand_back_lost_rows": True}, InMemoryStore(), ready_first())
    try:
        assert default.config.hand_back_lost_rows is False
        assert chosen.config.hand_back_lost_rows is True
    finally:
        default.close()
        chosen.close()
