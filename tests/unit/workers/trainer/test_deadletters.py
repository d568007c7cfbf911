"""The trainer's dead letters and their topic: bounded like the reassembler's, created with the pipeline."""

from prometheus_client import CollectorRegistry

from schemas.deadletter import MAX_KEY_BYTES, MAX_MESSAGE_CHARS, MAX_ORIGINAL_BYTES, DeadLetter
from workers.telemetry.prometheus import PrometheusTrainerSensor
from workers.topics import DEADLETTER_ROLE, TopicNames, pipeline_topics, topic_role
from workers.trainer.deadletters import UNDECODABLE_FINALIZED, make_letter


def test_a_letter_keeps_a_small_original_whole_and_bounds_a_large_one():
    small = make_letter("t", 2, 7, b"k", b"\xc1x", UNDECODABLE_FINALIZED, "bad", worker_id="trainer:t")
    assert (small.original, small.source_key, small.original_truncated) == (b"\xc1x", b"k", False)
    assert DeadLetter.from_bytes(small.to_bytes()) == small
    big = make_letter(
        "t", 0, 1, b"k" * 5000, b"z" * (MAX_ORIGINAL_BYTES + 1), UNDECODABLE_FINALIZED, "m" * 9000, worker_id="w"
    )
    assert big.original_truncated and big.original_size == MAX_ORIGINAL_BYTES + 1 and len(big.original_sha256) == 64
    assert len(big.source_key) == MAX_KEY_BYTES and len(big.message) == MAX_MESSAGE_CHARS
    tombstone = make_letter("t", 0, 3, None, None, UNDECODABLE_FINALIZED, "empty", worker_id="w")
    assert tombstone.original == b"" and tombstone.source_key is None


def test_the_trainer_dead_letter_topic_is_created_with_the_pipeline_and_read_as_dead_letters():
    names = TopicNames("run1")
    assert names.trainer_deadletter == "run1.trainer.deadletter"
    specs = {s.name: s for s in pipeline_topics(names, 4)}
    assert specs[names.trainer_deadletter].partitions == 1
    assert topic_role(names.trainer_deadletter) == DEADLETTER_ROLE
    assert topic_role(TopicNames().trainer_deadletter) == DEADLETTER_ROLE


def test_the_trainer_sensor_counts_undecodable_records_and_missing_rows():
    r = CollectorRegistry()
    sensor = PrometheusTrainerSensor(r)
    sensor.on_undecodable()
    sensor.on_undecodable(2)
    sensor.on_missing_rows()
    sensor.on_handed_back()
    assert r.get_sample_value("rlstream_trainer_undecodable_records_total") == 3
    assert r.get_sample_value("rlstream_trainer_missing_rows_total") == 1
    assert r.get_sample_value("rlstream_trainer_groups_handed_back_total") == 1
