"""The pipeline's topics: names under a prefix, and their specs on one broker and on a cluster."""

import pytest

from schemas.errors import InvalidArgument
from workers.topics import TopicNames, default_replication, pipeline_topics


def test_names_take_the_prefix():
    names = TopicNames("run1")
    assert (names.receipts, names.state, names.replay("x")) == (
        "run1.rollout.receipts",
        "run1.reassembler.state",
        "run1.replay.x",
    )
    assert TopicNames().finalized == "experience.finalized"


def test_one_broker_gets_unreplicated_topics_and_a_compacted_state_changelog():
    specs = {s.name: s for s in pipeline_topics(TopicNames("p"), 6)}
    assert {s.replication_factor for s in specs.values()} == {1}
    assert all("min.insync.replicas" not in s.config for s in specs.values())
    state = specs["p.reassembler.state"]
    assert state.config["cleanup.policy"] == "compact" and state.partitions == 6
    assert specs["p.experience.deadletter"].partitions == 1


def test_three_replicas_default_to_two_in_sync_and_extra_config_reaches_every_topic():
    specs = pipeline_topics(TopicNames("p"), 4, replication_factor=3, config={"retention.ms": "3600000"})
    assert {s.replication_factor for s in specs} == {3}
    assert {s.config["min.insync.replicas"] for s in specs} == {"2"}
    assert {s.config["retention.ms"] for s in specs} == {"3600000"}
    # The changelog stays compacted whatever the extra config says.
    overridden = pipeline_topics(TopicNames("p"), 4, replication_factor=3, config={"cleanup.policy": "delete"})
    assert overridden[-1].config["cleanup.policy"] == "compact"


def test_replication_follows_the_cluster_size_up_to_three():
    assert [default_replication(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 3]


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(InvalidArgument, match="partitions"):
        pipeline_topics(TopicNames(), 0)
    with pytest.raises(InvalidArgument, match="replication factor"):
        pipeline_topics(TopicNames(), 1, replication_factor=0)


def test_two_replicas_keep_writing_with_one_broker_down():
    specs = pipeline_topics(TopicNames("p"), 4, replication_factor=2)
    assert {s.config["min.insync.replicas"] for s in specs} == {"1"}


def test_the_topics_a_resume_reads_past_what_was_consumed_never_expire_unless_the_user_says_so():
    # Receipts past the reassemblers' offsets, finalized records past the trainer's cut and hand-backs past
    # the rollout workers' feed are what a restarted job still needs, however long it was down; with the
    # broker's default (7 days) a job down a week lost them (issue 30).
    specs = {s.name: s for s in pipeline_topics(TopicNames("p"), 2)}
    kept = {"p.rollout.receipts", "p.experience.finalized", "p.rollout.regenerate"}
    assert {n for n, s in specs.items() if s.config.get("retention.ms") == "-1"} == kept
    assert "retention.ms" not in specs["p.reassembler.state"].config  # compacted: entries stay until tombstoned
    mine = {s.name: s for s in pipeline_topics(TopicNames("p"), 2, config={"retention.ms": "86400000"})}
    assert {mine[n].config["retention.ms"] for n in kept} == {"86400000"}


def test_the_progress_topic_keeps_its_tombstones_minutes_not_the_broker_s_day():
    """Every trainer reads the progress topic whole; a tombstone only has to outlast one such read (seconds),
    and the broker's default (a day) kept a day of them in every read."""
    (progress,) = [s for s in pipeline_topics(TopicNames("p"), 4) if s.name == TopicNames("p").trainer_progress]
    assert progress.config["cleanup.policy"] == "compact"
    assert 60_000 <= int(progress.config["delete.retention.ms"]) <= 3_600_000
    mine = pipeline_topics(TopicNames("p"), 4, config={"delete.retention.ms": "7200000"})
    assert {s.config.get("delete.retention.ms") for s in mine if s.name == progress.name} == {"7200000"}
