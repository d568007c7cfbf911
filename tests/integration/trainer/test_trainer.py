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


def _media_group(tq_store, group_id, media):
    """A finalized group of 2 rows put in real TQ train, each row with one `media` segment (None: a text group)."""
    from schemas.finalized import FinalizedGroup
    from schemas.payload import Completion, PromptGroupRecord, pack_payload, record_to_train_batch

    log = [
        {"role": "user", "token_ids": torch.tensor([1, 2])},
        {"role": "assistant", "token_ids": torch.tensor([3]), "generation_logprobs": torch.tensor([-1.0])},
    ]
    rows = tuple(
        Completion(log, 1.0, False, True, multimodal={"pixel_values": [media]} if media is not None else {})
        for _ in range(2)
    )
    pad = {"input_ids": 0}
    batch = record_to_train_batch(
        PromptGroupRecord(torch.tensor([1, 2]), rows), pad_value_dict=pad, include_message_violation_fields=True
    )
    ids, fields, tags = pack_payload(batch, weight_version=0, group_id=group_id, prompt_idx=0)
    tq_store.put(TRAIN, ids, fields, tags)
    return FinalizedGroup(
        group_id=group_id, prompt_idx=0, partition_id=TRAIN, sample_ids=tuple(ids), tags=tuple(tags),
        group_min_wv=0, group_max_wv=0, canonical_output_tokens=6, valid_row_count=2, total_row_count=2,
        rejection_reasons=(None, None), dropped=False, drop_reason=None, metrics={}, source=None,
    )  # fmt: skip


def test_a_batch_of_a_text_group_and_vlm_groups_materializes_its_selected_fields_on_real_tq(tq_store, unique):
    import pytest

    from schemas.errors import InvalidArgument
    from schemas.multimodal import PackedRows
    from workers.trainer.batch import BatchMeta, materialize

    pixels = torch.randn(3, 4).to(torch.bfloat16)
    text, vlm = _media_group(tq_store, f"mt-{unique}-t", None), _media_group(tq_store, f"mt-{unique}-v", pixels)
    other = _media_group(tq_store, f"mt-{unique}-f", torch.randn(3, 4))  # float32 media
    try:
        meta = BatchMeta(0, (text, vlm), ((0, 0), (0, 1)), TRAIN)
        for fields in (["input_ids", "pixel_values"], None):
            batch = materialize(tq_store, meta, fields=fields, pad_value_dict={"input_ids": 0})
            media = PackedRows.from_wire(batch["pixel_values"], meta.tags, "pixel_values")
            assert [len(r) for r in media.rows] == [0, 0, 1, 1]
            assert torch.equal(media.rows[3][0].view(torch.int16), pixels.view(torch.int16))
            assert batch["input_ids"].tolist() == [[1, 2, 3]] * 4
        # Media of two dtypes in one batch: refused naming the field and the groups, not a RuntimeError.
        mixed = BatchMeta(0, (vlm, other), ((0, 0), (0, 1)), TRAIN)
        with pytest.raises(
            InvalidArgument, match=rf"'pixel_values'.*bfloat16: {vlm.group_id}.*float32: {other.group_id}"
        ):
            materialize(tq_store, mixed, fields=["input_ids", "pixel_values"], pad_value_dict={"input_ids": 0})
    finally:
        tq_store.clear(TRAIN, [*text.sample_ids, *vlm.sample_ids, *other.sample_ids])
