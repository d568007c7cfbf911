"""The trainer consumer's settings: defaults, topics under the prefix, bounds, file and environment."""

import pytest

from streams.errors import ConfigError
from streams.settings import fields_of, load
from workers.trainer.config import ConsumerConfig


def test_defaults_and_topics_under_the_prefix():
    c = ConsumerConfig(prefix="run1")
    assert c.consumer_group == "trainer"
    assert c.finalized_topic == "run1.experience.finalized"
    assert c.topics.replay("stale") == "run1.replay.stale"
    assert ConsumerConfig(prefix="run1", input_topic="run1.replay.x").finalized_topic == "run1.replay.x"
    assert c.pad_value_dict == {"input_ids": 0}


def test_every_setting_has_a_doc_line():
    assert all(f.doc for f in fields_of(ConsumerConfig))


@pytest.mark.parametrize(
    "overrides",
    [{"max_poll_records": 0}, {"max_waiting_groups": 0}, {"consumer_group": ""}, {"session_timeout_ms": 10}],
)
def test_out_of_bounds_settings_are_refused(overrides):
    with pytest.raises(ConfigError, match="trainer settings"):
        load(ConsumerConfig, env={}, overrides=overrides)


def test_max_poll_interval_cannot_be_below_the_session_timeout():
    with pytest.raises(ConfigError, match="max_poll_interval_ms .2000. must be at least session_timeout_ms .5000."):
        load(ConsumerConfig, env={}, overrides={"max_poll_interval_ms": 2000, "session_timeout_ms": 5000})
    assert ConsumerConfig().max_poll_interval_ms == 300_000


def test_file_then_environment_then_flags():
    file = {"trainer": {"prefix": "f", "max_poll_records": 7, "consumer_group": "from-file"}}
    env = {"RLSTREAM_TRAINER_MAX_POLL_RECORDS": "9"}
    c = load(ConsumerConfig, file=file, env=env, overrides={"consumer_group": "from-flag"})
    assert (c.prefix, c.max_poll_records, c.consumer_group) == ("f", 9, "from-flag")
