"""The metadata-first trainer API: select hands out metadata only, materialize fetches rows, ack settles them."""

import logging
import time

import pytest
import torch

from schemas.deadletter import DeadLetter
from schemas.errors import InvalidArgument
from schemas.finalized import FinalizedGroup
from schemas.metadata_guard import assert_metadata_only
from schemas.regenerate import Regenerate
from streams.consumer import read_topic
from streams.errors import MissingKeysError
from streams.tq import TRAIN
from tests.integration.helpers import stale_clear
from tests.integration.trainer.staging import committed_at_end, finalize_groups
from workers.trainer.batch import BatchMeta
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.dataset import ExperienceDataset, stateful_loader
from workers.trainer.deadletters import UNUSABLE_GROUP
from workers.trainer.policies import in_order, ready_first


def _consumer(kafka, tq_store, names, unique, **config):
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=f"se-{unique}", **config)
    return ExperienceConsumer(kafka, tq_store, cfg, ready_first())


def test_select_hands_out_metadata_that_materializes_padded_or_jagged_and_ack_settles(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(2), per_version=2)
    consumer = _consumer(kafka, tq_store, names, unique)
    try:
        assert consumer.select(3, min_groups=5, max_groups=8, timeout_s=3.0) is None  # only 4 exist
        meta = consumer.select(3, min_groups=2, max_groups=3, timeout_s=30.0)
        assert isinstance(meta, BatchMeta) and 2 <= len(meta) <= 3 and meta.version == 3
        assert_metadata_only(meta.groups, path="meta.groups")
        assert meta.sample_ids == tuple(s for g in meta.groups for s in g.sample_ids)
        padded = consumer.materialize(meta)
        jagged = consumer.materialize(meta, fields=["input_ids"], layout="jagged")
        assert set(jagged.keys()) == {"input_ids"} and padded.batch_size[0] == len(meta.sample_ids)
        lengths = padded["input_lengths"].tolist()
        for i, row in enumerate(jagged["input_ids"].unbind()):
            assert torch.equal(padded["input_ids"][i, : lengths[i]], row)
        with pytest.raises(InvalidArgument, match="layout"):
            consumer.materialize(meta, layout="ragged")
        consumer.ack(meta)
        assert not tq_store.present(TRAIN, list(meta.sample_ids))
        rest = consumer.select(3, min_groups=1, max_groups=8, timeout_s=30.0)
        assert rest is not None and {g.group_id for g in rest.groups} | {g.group_id for g in meta.groups} == set(
            finalized
        )
        consumer.ack(rest)
        assert committed_at_end(kafka, f"se-{unique}", names.finalized)
        with pytest.raises(InvalidArgument, match="checkpointed"):
            consumer.state_dict()
    finally:
        consumer.close()


def test_rows_cleared_by_someone_else_after_select_withdraw_the_batch_even_with_their_places_reused(
    kafka, tq_store, unique
):
    import transfer_queue as tq

    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(1), per_version=3)
    consumer = _consumer(kafka, tq_store, names, unique)
    others = []
    try:
        meta = consumer.select(1, min_groups=1, max_groups=1, timeout_s=30.0)
        lost = list(meta.sample_ids)
        rows = tq.kv_batch_get(lost, TRAIN)
        # Another client clears them (the consumer's store cannot know), then puts rows that TQ
        # places where the cleared ones were.
        tq.kv_clear(lost, TRAIN)
        others = [f"other-{unique}_g{i}" for i in range(len(lost))]
        tq.kv_batch_put(others, TRAIN, rows, [{"group_id": f"other-{unique}"}] * len(lost))
        with pytest.raises(MissingKeysError) as err:
            consumer.materialize(meta)
        assert sorted(err.value.missing) == sorted(lost)
        assert consumer.counts.missing_rows == 1
        rest = consumer.select(1, min_groups=2, max_groups=2, timeout_s=30.0)
        assert rest is not None and {g.group_id for g in rest.groups} == set(finalized) - {meta.groups[0].group_id}
        assert consumer.materialize(rest).batch_size[0] == len(rest.sample_ids)
        consumer.ack(rest)
    finally:
        tq_store.clear(TRAIN, others)
        consumer.close()


def test_a_row_a_stale_clear_deleted_under_its_key_is_handed_back_never_a_crash_and_the_rest_is_trained(
    kafka, tq_store, unique
):
    # TQ still maps the row (select's lookup finds it, tagged), but a clear whose lookup went stale
    # deleted its storage: materialize reads it as missing, never TQError("kept moving") after every
    # restart; the group is handed back, its key released by the trainer's own clear after the commit.
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(2), per_version=2)
    consumer = _consumer(kafka, tq_store, names, unique)
    try:
        meta = consumer.select(3, min_groups=4, max_groups=4, timeout_s=30.0)
        broken = next(g for g in meta.groups if g.group_id == "v1-g0")
        stale_clear(TRAIN, [broken.sample_ids[1]])
        with pytest.raises(MissingKeysError) as err:
            consumer.materialize(meta)
        assert err.value.missing == [broken.sample_ids[1]]
        rest = consumer.select(3, min_groups=3, max_groups=8, timeout_s=30.0)
        assert rest is not None and {g.group_id for g in rest.groups} == set(finalized) - {"v1-g0"}
        assert consumer.materialize(rest).batch_size[0] == len(rest.sample_ids)
        consumer.ack(rest)

        def settled() -> bool:
            backs = [Regenerate.from_bytes(r.value).group_id for r in read_topic(kafka, names.regenerate)]
            released = not tq_store.present(TRAIN, list(broken.sample_ids))
            return backs == ["v1-g0"] and released and committed_at_end(kafka, f"se-{unique}", names.finalized)

        deadline = time.monotonic() + 60
        while not settled():  # the consumer's polls acknowledge the hand-back, commit, then clear
            assert time.monotonic() < deadline, "the hand-back never committed and released the broken group's keys"
            assert consumer.select(3, min_groups=1, max_groups=8, timeout_s=0.5) is None
        assert consumer.counts.handed_back == 1
    finally:
        consumer.close()


def test_a_withdrawn_group_is_decided_again_at_the_version_the_trainer_moved_to(kafka, tq_store, unique):
    """select(0), set_version(1), materialize finds another group's rows gone: the group put back must
    not keep its version-0 decision, or select(1) hands out a version-0 group that in_order must evict."""
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(2), per_version=2)
    evicted: list[str] = []
    cfg = ConsumerConfig(prefix=names.prefix, consumer_group=f"se-{unique}")
    consumer = ExperienceConsumer(kafka, tq_store, cfg, in_order(0), on_evict=lambda g, v: evicted.append(g.group_id))
    try:
        meta = consumer.select(0, min_groups=2, max_groups=2, timeout_s=30.0)
        assert meta is not None and {g.group_min_wv for g in meta.groups} == {0}
        consumer.set_version(1)  # the trainer moves on while the batch is out
        gone, kept = meta.groups
        tq_store.clear(TRAIN, list(gone.sample_ids))  # someone else clears one group's rows
        with pytest.raises(MissingKeysError):
            consumer.materialize(meta)
        rest = consumer.select(1, min_groups=1, max_groups=4, timeout_s=30.0)
        assert rest is not None
        assert [(g.group_id, g.group_min_wv) for g in rest.groups if g.group_min_wv != 1] == []
        assert evicted == [kept.group_id] and consumer.counts.missing_rows == 1
        consumer.ack(rest)
    finally:
        consumer.close()


def test_a_stateful_dataloader_resumes_from_its_checkpoint_with_nothing_lost_or_twice(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(2), per_version=3)
    trained: list[str] = []  # the "model"
    consumer = _consumer(kafka, tq_store, names, unique, checkpointed=True)
    dataset = ExperienceDataset(consumer, lambda: 5, min_groups=1, max_groups=2, poll_s=10.0)
    loader = stateful_loader(dataset)
    batches = iter(loader)
    for _ in range(2):
        trained += next(batches)["group_ids"]
    checkpoint = {"model": list(trained), "loader": loader.state_dict()}
    dataset.checkpoint_durable(checkpoint["loader"])
    lost = next(batches)["group_ids"]  # trained, then the trainer dies before its next checkpoint
    consumer.close()

    model = list(checkpoint["model"])
    consumer = _consumer(kafka, tq_store, names, unique, checkpointed=True)
    dataset = ExperienceDataset(
        consumer, lambda: 5, min_groups=1, max_groups=2, poll_s=1.0, stop=lambda: len(model) >= len(finalized)
    )
    loader = stateful_loader(dataset)
    loader.load_state_dict(checkpoint["loader"])
    try:
        for batch in loader:
            assert batch["input_ids"].shape[0] == batch["input_lengths"].shape[0]
            model += batch["group_ids"]
            assert len(model) <= len(finalized) + 2, "no end in sight"
    finally:
        consumer.close()
    assert sorted(model) == sorted(finalized)
    assert set(lost) <= set(model[len(checkpoint["model"]) :])


def test_a_handed_out_group_the_trainer_cannot_use_is_dead_lettered_and_its_offset_passes(
    kafka, tq_store, unique, caplog
):
    """A framework that cannot turn a selected group into its rows (verl: another group size than
    rollout.n) must not crash on it after every restart: the group is resolved as lost instead."""
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(1), per_version=3)
    consumer = _consumer(kafka, tq_store, names, unique)
    try:
        meta = consumer.select(1, min_groups=3, max_groups=3, timeout_s=30.0)
        bad = meta.groups[1]
        with caplog.at_level(logging.ERROR, logger="rlstream.trainer"):
            consumer.dead_letter(meta, {bad.group_id: "8 rows, the framework wants 4"})
        consumer.ack(
            BatchMeta(
                meta.version,
                (meta.groups[0], meta.groups[2]),
                (meta.positions[0], meta.positions[2]),
                meta.train_partition,
            )
        )
        deadline = time.monotonic() + 60
        while not committed_at_end(kafka, f"se-{unique}", names.finalized):
            assert time.monotonic() < deadline, "the dead letter never let the offset pass"
            consumer.poll(0.2)
        assert consumer.counts.lost == 1 and consumer.counts.unusable == 1
        assert not tq_store.present(TRAIN, list(meta.sample_ids))
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(bad.group_id in e and "the framework wants 4" in e for e in errors)
    finally:
        consumer.close()
    letters = [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.trainer_deadletter)]
    assert [(d.error_kind, d.source_key) for d in letters] == [(UNUSABLE_GROUP, bad.group_id.encode())]
    assert FinalizedGroup.from_bytes(letters[0].original) == finalized[bad.group_id]
    again = _consumer(kafka, tq_store, names, unique)
    try:
        assert again.select(1, min_groups=1, timeout_s=3.0) is None, "a restarted trainer never gets it again"
    finally:
        again.close()


def test_a_batch_given_back_untrained_is_selected_again(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"se-{unique}", versions=range(1), per_version=2)
    consumer = _consumer(kafka, tq_store, names, unique)
    try:
        meta = consumer.select(1, min_groups=2, max_groups=2, timeout_s=30.0)
        assert consumer.select(1, min_groups=1, timeout_s=0.5) is None  # both are out
        consumer.give_back(meta)
        again = consumer.select(2, min_groups=2, max_groups=2, timeout_s=5.0)
        assert again is not None and {g.group_id for g in again.groups} == set(finalized)
        consumer.ack(again)
        assert consumer.counts.lost == 0 and not tq_store.present(TRAIN, list(again.sample_ids))
    finally:
        consumer.close()
