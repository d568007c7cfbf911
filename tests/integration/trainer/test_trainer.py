"""The trainer's consumer against the real broker and TQ: policies by weight version, restarts, tensors."""

import torch
from prometheus_client import CollectorRegistry

from streams.admin import TopicSpec, create_topics
from streams.consumer import read_topic
from streams.tq import TRAIN
from tests.integration.trainer.staging import finalize_groups
from workers.telemetry.prometheus import PrometheusTrainerSensor
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import in_order, policy_by_name, windowed

VERSIONS = range(6)


def _finalized_by_version(kafka, tq_store, unique, per_version=5):
    """Groups produced by policies of versions 0..5, published shuffled and finalized by a real worker."""
    return finalize_groups(kafka, tq_store, f"tr-{unique}", versions=VERSIONS, per_version=per_version, seed=3)


def test_windowed_never_yields_staler_than_bound_and_accounts_for_every_group(kafka, tq_store, unique):
    names, finalized = _finalized_by_version(kafka, tq_store, unique)
    yielded, evicted = [], []
    registry = CollectorRegistry()
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}"),
        windowed(1),
        version=2,
        on_yield=lambda g, v: yielded.append((g.group_id, v - g.group_min_wv)),
        on_evict=lambda g, v: evicted.append((g.group_id, v - g.group_min_wv)),
        sensor=PrometheusTrainerSensor(registry),
    )
    try:
        for version in (2, 3, 4, 5, 6):
            consumer.set_version(version)
            while (batch := consumer.next_batch(4, timeout_s=3.0)) is not None:
                assert all(s <= 1 for s in batch.staleness)
                assert batch.tensors["input_ids"].shape[0] == len(batch.sample_ids)
                consumer.release(batch)
    finally:
        consumer.close()
    assert yielded and evicted
    assert all(s <= 1 for _, s in yielded)
    assert all(s > 1 for _, s in evicted)
    ids = [g for g, _ in yielded] + [g for g, _ in evicted]
    assert sorted(ids) == sorted(finalized)
    assert consumer.counts.yielded + consumer.counts.evicted_stale == len(finalized)
    get = registry.get_sample_value
    assert get("rlstream_trainer_yielded_groups_total") == len(yielded)
    assert get("rlstream_trainer_evicted_groups_total") == len(evicted)
    assert get("rlstream_trainer_staleness_versions_sum") == sum(max(0, s) for _, s in yielded)


def test_in_order_never_yields_out_of_version_order(kafka, tq_store, unique):
    names, finalized = _finalized_by_version(kafka, tq_store, unique, per_version=4)
    order, ahead = [], {}
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}"),
        in_order(1),
        on_yield=lambda g, v: order.append(g.group_min_wv),
    )
    try:
        for version in VERSIONS:
            consumer.set_version(version)
            while (batch := consumer.next_batch(3, timeout_s=3.0)) is not None:
                assert {g.group_min_wv for g in batch.groups} == {version}
                consumer.release(batch)
            ahead[version] = consumer.counts.ahead
    finally:
        consumer.close()
    assert order == sorted(order) and len(order) > 0
    # Held groups more than one version ahead of the trainer, as it stands after each version.
    assert ahead == {v: 4 * max(0, len(VERSIONS) - 2 - v) for v in VERSIONS}
    assert consumer.counts.yielded + consumer.counts.evicted_stale == len(finalized)


def test_restarted_consumer_resumes_with_nothing_lost_and_nothing_twice(kafka, tq_store, unique):
    names, finalized = _finalized_by_version(kafka, tq_store, unique, per_version=4)
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}")
    released = []
    first = ExperienceConsumer(kafka, tq_store, cfg, policy_by_name("ready_first"), version=10)
    try:
        for _ in range(3):
            batch = first.next_batch(3, timeout_s=10.0)
            assert batch is not None
            released += [g.group_id for g in batch.groups]
            first.release(batch)
        # Yielded but never released: the trainer died mid-step, so these must come back.
        unreleased = first.next_batch(3, timeout_s=10.0)
        assert unreleased is not None
    finally:
        first.close()
    second = ExperienceConsumer(kafka, tq_store, cfg, policy_by_name("ready_first"), version=10)
    try:
        while (batch := second.next_batch(5, timeout_s=5.0)) is not None:
            released += [g.group_id for g in batch.groups]
            second.release(batch)
    finally:
        second.close()
    assert sorted(released) == sorted(finalized)
    assert set(g.group_id for g in unreleased.groups) <= set(released[9:])


def test_batch_tensors_match_the_packed_rows_in_tq(kafka, tq_store, unique):
    names, finalized = _finalized_by_version(kafka, tq_store, unique, per_version=2)
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}"),
        policy_by_name("ready_first"),
        version=10,
    )
    try:
        batch = consumer.next_batch(3, timeout_s=10.0)
        assert batch is not None
        rows = tq_store.get(TRAIN, list(batch.sample_ids), select=["input_ids"])["input_ids"].unbind()
        lengths = batch.tensors["input_lengths"].tolist()
        for i, row in enumerate(rows):
            assert torch.equal(batch.tensors["input_ids"][i, : lengths[i]], row)
            assert (batch.tensors["input_ids"][i, lengths[i] :] == 0).all()
        consumer.release(batch)
    finally:
        consumer.close()


def test_groups_evicted_as_stale_go_to_the_replay_topic(kafka, tq_store, unique):
    names, finalized = _finalized_by_version(kafka, tq_store, unique, per_version=1)
    create_topics(kafka, [TopicSpec(names.replay("stale"), 1)])
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=f"tr-{unique}", stale_replay="stale")
    consumer = ExperienceConsumer(kafka, tq_store, cfg, windowed(0), version=5)
    try:
        batch = consumer.next_batch(1, timeout_s=10.0)
        assert batch is not None and [g.group_id for g in batch.groups] == ["v5-g0"]
        consumer.release(batch)
        assert consumer.next_batch(1, timeout_s=2.0) is None
    finally:
        consumer.close()
    replayed = sorted(r.key.decode() for r in read_topic(kafka, names.replay("stale")))
    assert replayed == sorted(g for g in finalized if g != "v5-g0") and consumer.counts.evicted_stale == 5
    assert not tq_store.present(TRAIN, [s for g in finalized.values() for s in g.sample_ids])
