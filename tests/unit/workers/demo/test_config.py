"""The demo's settings: documented, bounded, and the staleness bound handed to the chosen policy."""

import pytest

from streams.errors import ConfigError
from streams.settings import decode, encode, fields_of, load
from workers.demo.config import DemoConfig
from workers.trainer.policies import InOrder, ReadyFirst, Windowed, policy_by_name


def test_every_setting_but_the_shape_has_a_doc_line():
    assert all(f.doc for f in fields_of(DemoConfig) if f.name != "shape")


@pytest.mark.parametrize(
    "policy,expected", [("windowed", Windowed(3)), ("in_order", InOrder(3)), ("ready_first", ReadyFirst())]
)
def test_max_staleness_is_the_policy_bound(policy, expected):
    cfg = DemoConfig(policy=policy, max_staleness=3)
    assert policy_by_name(cfg.policy, **cfg.policy_params) == expected


@pytest.mark.parametrize(
    "overrides", [{"groups": 0}, {"producers": 0}, {"policy": "newest"}, {"produce_rate_groups_s": 0}]
)
def test_out_of_bounds_settings_are_refused(overrides):
    with pytest.raises(ConfigError, match="demo settings"):
        load(DemoConfig, env={}, overrides=overrides)


def test_flags_and_environment_arrive_as_strings_and_survive_a_round_trip():
    cfg = load(DemoConfig, env={"RLSTREAM_DEMO_GROUPS": "24"}, overrides={"timeout_s": "60", "policy": "in_order"})
    assert (cfg.groups, cfg.timeout_s, cfg.policy) == (24, 60.0, "in_order")
    assert decode(DemoConfig, encode(cfg)) == cfg
