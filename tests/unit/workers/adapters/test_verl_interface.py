"""The sampler stands in for verl's v1 ReplayBufferAsync: signatures, construction kwargs, partition guard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from schemas.errors import InvalidArgument
from tests.unit.workers.adapters.verl_spec import CUSTOM_SAMPLER_KWARGS, incompatibilities, verl_base
from workers.adapters.verl_sampler import RlstreamReplayBuffer, VerlSamplerSettings, default_policy
from workers.trainer.policies import ReadyFirst, Windowed


def _sampler(train_partition: str = "rlstream.train") -> RlstreamReplayBuffer:
    consumer = SimpleNamespace(config=SimpleNamespace(train_partition=train_partition))
    return RlstreamReplayBuffer(**CUSTOM_SAMPLER_KWARGS, consumer=consumer, store=object())


def test_signatures_match_verls_replay_buffer():
    base, where = verl_base()
    assert incompatibilities(RlstreamReplayBuffer, base) == [], where


def test_the_signature_check_catches_a_sampler_verl_could_not_call():
    class Wrong:
        def __init__(self, sampler_kwargs): ...

        def sample(self, global_steps, batch_size, partition_id): ...

        def get_sampleable_count(self, global_steps, partition_id, extra): ...

        def wait_for_sampleable(self, global_steps, partition_id, target_count): ...

    problems = incompatibilities(Wrong, verl_base()[0])
    assert any(p.startswith("__init__") for p in problems)
    assert any(p.startswith("sample: parameter 2") for p in problems)
    assert any("'extra' has no default" in p for p in problems)


def test_verls_partition_may_not_be_rlstreams_nor_validation():
    sampler = _sampler(train_partition="train")
    with pytest.raises(InvalidArgument, match="rlstream's train partition"):
        sampler.get_sampleable_count(1, "train")
    with pytest.raises(InvalidArgument, match="training groups only"):
        _sampler().sample(1, "val", 2)


def test_settings_come_from_sampler_kwargs_and_the_rest_goes_to_the_consumer():
    settings, rest = VerlSamplerSettings.split({"version_offset": -1, "prefix": "p", "wait_timeout_s": 3.0})
    assert settings == VerlSamplerSettings(version_offset=-1, wait_timeout_s=3.0) and rest == {"prefix": "p"}
    assert _sampler().version_at(4) == 4
    with pytest.raises(InvalidArgument, match="store"):
        RlstreamReplayBuffer(**CUSTOM_SAMPLER_KWARGS, consumer=object())


def test_verls_drop_threshold_becomes_rlstreams_staleness_window():
    # verl drops a span of versions above the threshold; rlstream bounds the distance, one less.
    assert default_policy(VerlSamplerSettings(), 3) == Windowed(2)
    assert isinstance(default_policy(VerlSamplerSettings(), None), ReadyFirst)
    assert default_policy(VerlSamplerSettings(policy="windowed", policy_params={"max_staleness_versions": 5}), 3) == (
        Windowed(5)
    )
