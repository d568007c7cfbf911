"""A finalized group whose train rows are gone from TQ is handed back for regeneration, not dropped (issue 24).

After a whole-job restart Kafka still holds finalized records whose rows died with TQ. The trainer
sends each such group to `<prefix>.rollout.regenerate` (reason `train_rows_lost`), committed past
only once the broker took it, so rollout workers generate the prompt again; a group regenerated
`MAX_REGENERATIONS` times is dead-lettered instead, and with hand-back off the old alarm stays.
"""

from __future__ import annotations

import time

import msgspec

from schemas.deadletter import DeadLetter
from schemas.regenerate import MAX_REGENERATIONS, TRAIN_ROWS_LOST, Regenerate, regenerated_group_id
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import TRAIN
from tests.integration.trainer.staging import committed_at_end, finalize_groups
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.deadletters import MISSING_ROWS
from workers.trainer.policies import ready_first


def _run(kafka, tq_store, names, consumer_group, *, expect: int, **config) -> tuple[ExperienceConsumer, list[str]]:
    """Release every batch until `expect` groups were yielded and the commits reach the end of the topic."""
    yielded: list[str] = []
    consumer = ExperienceConsumer(
        kafka,
        tq_store,
        ConsumerConfig(prefix=names.prefix, consumer_group=consumer_group, **config),
        ready_first(),
        version=10,  # every group usable
        on_yield=lambda g, v: yielded.append(g.group_id),
    )
    deadline = time.monotonic() + 90
    try:
        while len(yielded) < expect or not committed_at_end(kafka, consumer_group, names.finalized):
            assert time.monotonic() < deadline, f"yielded {sorted(yielded)}, counts {consumer.counts}"
            if (batch := consumer.next_batch(4, timeout_s=0.5)) is not None:
                consumer.release(batch)
    finally:
        consumer.close()
    return consumer, yielded


def _handed_back(kafka, names) -> list[Regenerate]:
    return [Regenerate.from_bytes(r.value) for r in read_topic(kafka, names.regenerate)]


def _letters(kafka, names) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.trainer_deadletter)]


def test_a_group_whose_train_rows_are_gone_is_handed_back_once_and_its_neighbours_are_trained(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"hb-{unique}")
    lost = finalized["v1-g0"]
    tq_store.clear(TRAIN, list(lost.sample_ids))  # gone with TQ, as after a whole-job restart
    consumer, yielded = _run(kafka, tq_store, names, f"hb-{unique}", expect=len(finalized) - 1)
    assert sorted(yielded) == sorted(g for g in finalized if g != lost.group_id)
    (back,) = _handed_back(kafka, names)
    record = next(r for r in read_topic(kafka, names.finalized) if r.key == lost.group_id.encode())
    assert (back.group_id, back.prompt_idx, back.reason) == (lost.group_id, lost.prompt_idx, TRAIN_ROWS_LOST)
    assert back.new_group_id == regenerated_group_id(lost.group_id) and back.group_size == lost.total_row_count
    assert back.weight_version == lost.group_max_wv
    assert back.source == f"{names.finalized}[{record.partition}]@{record.offset}"
    assert not _letters(kafka, names)
    assert consumer.counts.handed_back == 1 and consumer.counts.lost == 1 and consumer.counts.missing_rows == 1

    # A second trainer reading the topic again (the commits name the record as resolved) hands back nothing more.
    again, _ = _run(kafka, tq_store, names, f"hb-{unique}", expect=0)
    assert len(_handed_back(kafka, names)) == 1 and again.counts.handed_back == 0


def test_a_group_regenerated_too_often_is_dead_lettered_not_handed_back_again(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"hbx-{unique}", versions=range(1), per_version=1)
    (original,) = finalized.values()
    gid = f"{original.group_id}~r{MAX_REGENERATIONS}"
    looping = msgspec.structs.replace(original, group_id=gid, sample_ids=tuple(f"{gid}_g{i}" for i in range(8)))
    producer = AckedProducer(kafka)
    producer.send([Outgoing(names.finalized, gid.encode(), looping.to_bytes())])
    producer.close()
    consumer, _ = _run(kafka, tq_store, names, f"hbx-{unique}", expect=1)
    assert not _handed_back(kafka, names)
    letters = _letters(kafka, names)
    assert [(d.error_kind, d.source_key) for d in letters] == [(MISSING_ROWS, gid.encode())]
    assert f"regenerated {MAX_REGENERATIONS} times" in letters[0].message
    assert consumer.counts.handed_back == 0 and consumer.counts.lost == 1


def test_with_hand_back_off_a_group_whose_rows_are_gone_stays_an_alarm(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"hbo-{unique}", versions=range(1))
    lost = finalized["v0-g1"]
    tq_store.clear(TRAIN, list(lost.sample_ids))
    consumer, _ = _run(kafka, tq_store, names, f"hbo-{unique}", expect=len(finalized) - 1, hand_back_lost_rows=False)
    assert not _handed_back(kafka, names)
    assert [d.error_kind for d in _letters(kafka, names)] == [MISSING_ROWS]
    assert consumer.counts.handed_back == 0
