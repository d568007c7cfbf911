"""The verl sampler over real finalized groups: verl's interface and field names, counts, waits, acks, versions.

verl itself is not installed here (tests/verl runs the sampler inside verl 0.9.1); these run the
sampler's own logic against the real broker and TQ.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import pytest
import torch

from schemas.deadletter import DeadLetter
from schemas.errors import InvalidArgument
from schemas.trainer_version import TrainerVersion
from streams.consumer import read_topic
from streams.errors import RowsUnsettled
from tests.integration.helpers import SMALL, stale_clear
from tests.integration.trainer.staging import committed_at_end, finalize_groups
from workers.adapters import verl_tq_guard
from workers.adapters.errors import SampleTimeout
from workers.adapters.verl_checkpoint import STATE_FILE, TRACKER, step_dir
from workers.adapters.verl_fields import verl_uid
from workers.adapters.verl_sampler import RlstreamReplayBuffer
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.deadletters import UNUSABLE_GROUP
from workers.trainer.policies import windowed

# What verl's _build_replay_buffer passes (tests/verl builds it from a real verl config).
VERL_KWARGS = dict(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2)


@pytest.fixture(autouse=True)
def _tq_unguarded():
    # The sampler guards TQ's close and checkpoints when verl builds it; the session's TQ needs them back.
    yield
    verl_tq_guard.uninstall()


def _sampler(kafka, tq_store, consumer, **settings) -> RlstreamReplayBuffer:
    options = {"poll_interval_s": 0.2, "group_size": SMALL.group_size, **settings}
    return RlstreamReplayBuffer(
        **VERL_KWARGS, sampler_kwargs={"rlstream": options}, consumer=consumer, store=tq_store, kafka=kafka
    )


def _consumer(kafka, tq_store, names, finalized, group: str, policy=None, **config) -> ExperienceConsumer:
    rl_partition = next(iter(finalized.values())).partition_id
    config = ConsumerConfig(prefix=names.prefix, consumer_group=group, train_partition=rl_partition, **config)
    return ExperienceConsumer(kafka, tq_store, config, policy or windowed(1))


def _check_row(verl: dict, rl: dict) -> None:
    """One verl row (as verl reads it back from TQ) against the rlstream row it came from."""
    length = int(rl["input_lengths"])
    p = int(rl["prompt_ids_for_adv"].shape[0])
    assert torch.equal(verl["input_ids"], rl["input_ids"][:length])
    assert torch.equal(verl["prompts"], rl["prompt_ids_for_adv"])
    assert torch.equal(verl["responses"], rl["input_ids"][p:length])
    assert verl["response_mask"].tolist() == rl["token_mask"][p:length].long().tolist()
    assert torch.equal(verl["rollout_log_probs"], rl["generation_logprobs"][p:length])
    assert verl["rm_scores"][-1].item() == pytest.approx(float(rl["total_reward"]))
    assert verl["rm_scores"][:-1].abs().sum().item() == 0.0


def test_the_verl_sampler_hands_real_groups_to_verls_partition_in_verls_names(kafka, tq_store, unique):
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta

    names, finalized = finalize_groups(kafka, tq_store, f"vs-{unique}", versions=range(2), per_version=2)
    rl_partition = next(iter(finalized.values())).partition_id
    verl_partition = f"verl.{unique}"  # verl's own "train" in a real run; unique here, the TQ is shared
    sample_ids = [s for g in finalized.values() for s in g.sample_ids]
    rl_rows = dict(zip(sample_ids, tq_store.get(rl_partition, sample_ids).unbind(0)))
    sampler = _sampler(kafka, tq_store, _consumer(kafka, tq_store, names, finalized, f"vs-{unique}"))
    keys: list[str] = []
    try:
        # Step 2 trains weights labelled 1: groups of versions 0 and 1 are within windowed(1).
        uids, _ = sampler.wait_for_sampleable(2, verl_partition, 4, timeout_s=60.0)
        assert uids == {verl_uid(g) for g in finalized} and sampler.get_sampleable_count(2, verl_partition) == 4
        started = time.monotonic()
        with pytest.raises(SampleTimeout, match="4 of 5"):
            sampler.wait_for_sampleable(2, verl_partition, 5, timeout_s=1.0)
        assert 1.0 <= time.monotonic() - started < 10.0
        with pytest.raises(InvalidArgument, match="rlstream's train partition"):
            sampler.sample(2, rl_partition, 1)

        batch, metrics = sampler.sample(2, verl_partition, 3)
        keys += batch.keys
        assert isinstance(batch, KVBatchMeta) and batch.partition_id == verl_partition
        # Every rollout of a group is a row (rollout.n of them), the rejected ones masked.
        assert metrics["rlstream/groups"] == 3.0 and len(batch.keys) == 3 * SMALL.group_size
        assert sampler.get_sampleable_count(2, verl_partition) == 1

        # Read back as verl's trainer does: jagged fields by name, uid as a non-tensor column.
        fields = ["prompts", "responses", "input_ids", "response_mask", "rollout_log_probs", "rm_scores", "uid"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=verl_partition, select_fields=fields)
        assert data["prompts"].offsets().diff().tolist() == [t["prompt_len"] for t in batch.tags]
        assert data["responses"].to_padded_tensor(padding=0).shape[0] == len(batch.keys)
        for i, tag in enumerate(batch.tags):
            if "rlstream_rejected" in tag:
                assert data["response_mask"][i].sum().item() == 0
                continue
            assert data["uid"][i] == verl_uid(tag["rlstream_group_id"])
            _check_row({f: data[f][i] for f in fields if f != "uid"}, rl_rows[tag["rlstream_sample_id"]])

        last, _ = sampler.sample(2, verl_partition, 1)
        keys += last.keys
        assert {t["rlstream_group_id"] for t in batch.tags + last.tags} == set(finalized)
        assert sampler.get_sampleable_count(2, verl_partition) == 0
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


def test_a_batch_is_acked_when_verl_asks_for_the_next_not_when_it_is_handed_out(kafka, tq_store, unique):
    """verl trains a batch after `sample` returns: a crash in between must not lose its groups."""
    names, finalized = finalize_groups(kafka, tq_store, f"va-{unique}", versions=range(1), per_version=3)
    rl_partition = next(iter(finalized.values())).partition_id
    verl_partition = f"verl.{unique}"
    group = f"va-{unique}"
    first = _sampler(kafka, tq_store, _consumer(kafka, tq_store, names, finalized, group))
    try:
        batch, _ = first.sample(1, verl_partition, 2)
        handed = {t["rlstream_group_id"] for t in batch.tags}
        held = [s for g in handed for s in finalized[g].sample_ids]
        assert tq_store.present(rl_partition, held) == set(held), "rows of an untrained batch stay"
    finally:
        first.close()  # the trainer dies before training the batch

    # Long enough for the new consumer to join the consumer group on a loaded machine.
    second = _sampler(kafka, tq_store, _consumer(kafka, tq_store, names, finalized, group), wait_timeout_s=60.0)
    again = None
    try:
        again, _ = second.sample(1, verl_partition, 3)
        # The restarted trainer gets all three, the two handed out before the crash among them.
        assert {t["rlstream_group_id"] for t in again.tags} == set(finalized)
        assert not committed_at_end(kafka, group, names.finalized)
        # Asking for the next batch says the last one was trained: its groups are acked then, even
        # when no next batch comes.
        second.settings = replace(second.settings, wait_timeout_s=1.0)
        with pytest.raises(SampleTimeout):
            second.sample(2, verl_partition, 1)
        all_rows = [s for g in finalized.values() for s in g.sample_ids]
        assert not tq_store.present(rl_partition, all_rows), "acked groups' rows are cleared after the commit"
        assert committed_at_end(kafka, group, names.finalized)
    finally:
        if again is not None:
            tq_store.clear(verl_partition, list(again.keys))
        second.close()


def test_counting_the_next_step_decides_nothing(kafka, tq_store, unique):
    """verl's on_step_end asks for the count at global_steps + 1 before it trains there."""
    names, finalized = finalize_groups(kafka, tq_store, f"vc-{unique}", versions=range(2), per_version=1)
    verl_partition = f"verl.{unique}"
    sampler = _sampler(
        kafka, tq_store, _consumer(kafka, tq_store, names, finalized, f"vc-{unique}", policy=windowed(0))
    )
    keys: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while sampler.get_sampleable_count(1, verl_partition) < 2:  # both read, usable at step 1 (weights 0)
            assert time.monotonic() < deadline, "the finalized groups were not read"
            time.sleep(0.05)
        # At step 3 (weights 2) neither is fresh enough for windowed(0); asking must evict neither.
        assert sampler.get_sampleable_count(3, verl_partition) == 0
        batch, _ = sampler.sample(1, verl_partition, 2)
        keys += batch.keys
        assert {t["rlstream_group_id"] for t in batch.tags} == {"v0-g0", "v1-g0"}
        assert sampler.consumer.counts.evicted_stale == 0
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


def test_the_trainers_version_goes_to_the_admission_gates_once_per_step(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"vv-{unique}", versions=range(1), per_version=3)
    verl_partition = f"verl.{unique}"
    sampler = _sampler(
        kafka, tq_store, _consumer(kafka, tq_store, names, finalized, f"vv-{unique}"), trainer_id=f"verl-{unique}"
    )
    keys: list[str] = []
    try:
        for step in (1, 1, 2):  # two samples in step 1 (parameter_sync_step 2), one in step 2
            batch, _ = sampler.sample(step, verl_partition, 1)
            keys += batch.keys
            sampler.get_sampleable_count(step + 1, verl_partition)  # never publishes
        records = [TrainerVersion.from_bytes(r.value) for r in read_topic(kafka, names.trainer_version)]
        # The weights verl trains with at step S are labelled S - 1: that is the trainer's version.
        assert [(r.trainer_id, r.version, r.lost_groups) for r in records] == [
            (f"verl-{unique}", 0, 0),
            (f"verl-{unique}", 1, 0),
        ]
        assert {r.consumer_group for r in records} == {f"vv-{unique}"} and records[0].batch_groups == 1
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


def test_an_async_save_is_durable_only_once_verls_tracker_shows_it(kafka, tq_store, unique, tmp_path):
    """Megatron's async_save: on_save comes before the workers finish writing and before verl's tracker."""
    names, finalized = finalize_groups(kafka, tq_store, f"vd-{unique}", versions=range(1), per_version=2)
    rl_partition = next(iter(finalized.values())).partition_id
    verl_partition = f"verl.{unique}"
    group, root = f"vd-{unique}", str(tmp_path)
    consumer = _consumer(kafka, tq_store, names, finalized, group, checkpointed=True)
    # Long enough for the consumer to join its consumer group on a loaded machine.
    sampler = _sampler(kafka, tq_store, consumer, checkpoint_dir=root, wait_timeout_s=60.0)
    keys: list[str] = []
    try:
        batch, _ = sampler.sample(1, verl_partition, 2)
        keys += batch.keys
        sampler.settings = replace(sampler.settings, wait_timeout_s=1.0)
        sampler.on_checkpoint(1, step_dir(root, 1), async_save=True)
        assert os.path.exists(os.path.join(step_dir(root, 1), STATE_FILE))
        rows = [s for g in finalized.values() for s in g.sample_ids]
        assert tq_store.present(rl_partition, rows) == set(rows), "not durable while verl's save is pending"
        assert not committed_at_end(kafka, group, names.finalized)
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write("1")  # Megatron's finalize writes verl's tracker once the save is complete
        with pytest.raises(SampleTimeout):
            sampler.sample(2, verl_partition, 1)  # verl's next step: the save is durable now
        assert not tq_store.present(rl_partition, rows) and committed_at_end(kafka, group, names.finalized)
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


def test_a_group_verl_cannot_take_is_dead_lettered_not_crashed_on_after_every_restart(kafka, tq_store, unique, caplog):
    """A group of another size than rollout.n: verl would crash on it, restart, get it again and crash again."""
    names, finalized = finalize_groups(
        kafka,
        tq_store,
        f"vb-{unique}",
        versions=range(1),
        per_version=3,
        shapes={"v0-g1": replace(SMALL, group_size=4)},
    )
    verl_partition = f"verl.{unique}"
    group = f"vb-{unique}"
    # Long enough for the consumer to join its consumer group on a loaded machine.
    sampler = _sampler(kafka, tq_store, _consumer(kafka, tq_store, names, finalized, group), wait_timeout_s=60.0)
    keys: list[str] = []
    try:
        with caplog.at_level(logging.ERROR, logger="rlstream.trainer"):
            batch, _ = sampler.sample(1, verl_partition, 2)
            keys += batch.keys
            # The bad group is never handed to verl; it is met in this sample or the next, by arrival order.
            assert {t["rlstream_group_id"] for t in batch.tags} == {"v0-g0", "v0-g2"}
            assert len(batch.keys) == 2 * SMALL.group_size
            sampler.settings = replace(sampler.settings, wait_timeout_s=1.0)
            with pytest.raises(SampleTimeout):
                sampler.sample(2, verl_partition, 1)  # verl trained the batch; nothing else is usable
        assert sampler.consumer.counts.unusable == 1 and sampler.consumer.counts.lost == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("v0-g1" in e and "rollout.n" in e for e in errors), errors
        deadline = time.monotonic() + 60
        while not committed_at_end(kafka, group, names.finalized):
            assert time.monotonic() < deadline, "the bad group's offset never passed"
            sampler.consumer.poll(0.2)
        assert not tq_store.present(next(iter(finalized.values())).partition_id, list(finalized["v0-g1"].sample_ids))
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()
    letters = [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.trainer_deadletter)]
    assert [(d.error_kind, d.source_key) for d in letters] == [(UNUSABLE_GROUP, b"v0-g1")]


class RowsVanishAfterSelect(ExperienceConsumer):
    """Another client clears the first selected group's rows between select and materialize, once."""

    vanish = True

    def select(self, *args, **kwargs):
        meta = super().select(*args, **kwargs)
        if meta is not None and self.vanish:
            type(self).vanish = False
            self._store.clear(meta.train_partition, list(meta.groups[0].sample_ids))
        return meta


def test_rows_gone_between_select_and_materialize_make_the_sampler_select_again(kafka, tq_store, unique):
    """The consumer withdraws such a batch and expects its caller to select again, not to hand verl an error."""
    names, finalized = finalize_groups(kafka, tq_store, f"vm-{unique}", versions=range(1), per_version=3)
    rl_partition = next(iter(finalized.values())).partition_id
    config = ConsumerConfig(
        prefix=names.prefix, consumer_group=f"vm-{unique}", train_partition=rl_partition, hand_back_lost_rows=False
    )
    consumer = RowsVanishAfterSelect(kafka, tq_store, config, windowed(1))
    verl_partition = f"verl.{unique}"
    sampler = _sampler(kafka, tq_store, consumer, wait_timeout_s=30.0)
    keys: list[str] = []
    try:
        batch, _ = sampler.sample(1, verl_partition, 2)
        keys += batch.keys
        assert len({t["rlstream_group_id"] for t in batch.tags}) == 2 and consumer.counts.missing_rows == 1
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


class RowBrokenAfterSelect(ExperienceConsumer):
    """Between select and materialize, once, a clear whose lookup went stale deletes the storage of one
    row of the first selected group while TQ's controller keeps the row mapped and ready."""

    broken: list[str] = []

    def select(self, *args, **kwargs):
        meta = super().select(*args, **kwargs)
        if meta is not None and not self.broken:
            self.broken.append(meta.groups[0].group_id)
            stale_clear(meta.train_partition, [meta.groups[0].sample_ids[0]])
        return meta


def test_a_row_a_stale_clear_deleted_makes_the_sampler_hand_its_group_back_and_select_again(kafka, tq_store, unique):
    """Read as missing, never as TQError: raising would crash verl, whose restart would meet the same row."""
    names, finalized = finalize_groups(kafka, tq_store, f"vb-{unique}", versions=range(1), per_version=3)
    rl_partition = next(iter(finalized.values())).partition_id
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"vb-{unique}", train_partition=rl_partition)
    consumer = RowBrokenAfterSelect(kafka, tq_store, config, windowed(1))
    verl_partition = f"verl.{unique}"
    sampler = _sampler(kafka, tq_store, consumer, wait_timeout_s=30.0)
    keys: list[str] = []
    try:
        batch, _ = sampler.sample(1, verl_partition, 2)
        keys += batch.keys
        groups = {t["rlstream_group_id"] for t in batch.tags}
        assert len(groups) == 2 and consumer.broken[0] not in groups and consumer.counts.handed_back == 1
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()


class UnsettledOnce:
    """The session's TQ store, with the first get of rlstream's train rows unsettled (`RowsUnsettled`: rows
    that kept moving while read, or a controller failure while the read was checked)."""

    def __init__(self, store, partition: str):
        self._store, self._partition, self.raised = store, partition, 0

    def get(self, partition, keys, select=None):
        if partition == self._partition and not self.raised:
            self.raised += 1
            raise RowsUnsettled(f"rows of {len(keys)} key(s) of TQ partition {partition!r} kept moving")
        return self._store.get(partition, keys, select)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_rows_tq_cannot_settle_now_make_the_sampler_select_the_same_groups_again(kafka, tq_store, unique):
    """Not now, not missing: nothing dead-lettered or handed back, and no TQError raised into verl."""
    names, finalized = finalize_groups(kafka, tq_store, f"vu-{unique}", versions=range(1), per_version=2)
    rl_partition = next(iter(finalized.values())).partition_id
    store = UnsettledOnce(tq_store, rl_partition)
    config = ConsumerConfig(prefix=names.prefix, consumer_group=f"vu-{unique}", train_partition=rl_partition)
    consumer = ExperienceConsumer(kafka, store, config, windowed(1))
    verl_partition = f"verl.{unique}"
    sampler = _sampler(kafka, store, consumer, wait_timeout_s=30.0)
    keys: list[str] = []
    try:
        batch, _ = sampler.sample(1, verl_partition, 2)
        keys += batch.keys
        assert store.raised == 1 and len({t["rlstream_group_id"] for t in batch.tags}) == 2
        assert consumer.counts.handed_back == 0 and consumer.counts.lost == 0
    finally:
        tq_store.clear(verl_partition, keys)
        sampler.close()
