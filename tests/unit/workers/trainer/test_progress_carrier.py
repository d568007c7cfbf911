"""The resolved records past a trainer's commit survive a restart at any number (issue 30, item 3b).

Commit metadata holds about 870 alternating ranges (3,500 characters); past that the last ranges were
left out, and their records, trained already and their rows cleared, were handed back after a restart
to be trained twice. Driven here with the in-memory Kafka; tests/integration/trainer/test_progress.py
does it on the real broker.
"""

from __future__ import annotations

import pytest
from confluent_kafka import TopicPartition

from schemas.regenerate import Regenerate
from schemas.trainer_progress import TrainerProgress
from tests.unit.workers.trainer.trainer_kafka import GROUP, NAMES, Pipeline, group
from workers.trainer.position import MAX_METADATA_CHARS, carried, decode_ranges
from workers.trainer.progress import MAX_ATTEMPTS, ProgressCarrier


def _handed_back(pipe: Pipeline) -> list[str]:
    return [Regenerate.from_bytes(m.value()).group_id for m in pipe.broker.records(NAMES.regenerate)]


def _train_all(pipe: Pipeline, consumer, version: int) -> list[str]:
    """Train what is usable at `version` until two rounds in a row read and train nothing."""
    trained: list[str] = []
    idle = 0
    while idle < 2:
        pipe.clock.now += 60
        read = consumer.poll(0)
        meta = consumer.select(version, min_groups=1, max_groups=500, timeout_s=0.0)
        if meta is not None:
            trained += [g.group_id for g in meta.groups]
            consumer.ack(meta)
        idle = 0 if read or meta is not None else idle + 1
    return trained


def _alternating(pipe: Pipeline, n: int) -> list:
    """n records, every other one of a version the first trainer never reaches (so it holds them)."""
    groups = [group(f"g{i}", weight_version=5 * (i % 2), rows=1) for i in range(n)]
    pipe.finalize(groups)
    return groups


def test_a_restart_with_more_resolved_ranges_than_commit_metadata_holds_hands_nothing_back():
    pipe = Pipeline()
    groups = _alternating(pipe, 2_000)
    first = pipe.consumer(version=0)
    trained = _train_all(pipe, first, 0)
    assert len(trained) == 1_000
    first.close()
    offset, metadata = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    assert offset == 1  # the first held record: 999 resolved ranges past it, ~4,000 characters of metadata
    second = pipe.consumer(version=5)
    again = _train_all(pipe, second, 5)
    assert _handed_back(pipe) == [] and second.counts.missing_rows == 0
    assert second.counts.reread == 999
    assert sorted(again) == sorted(g.group_id for g in groups[1::2])
    assert len(metadata) < MAX_METADATA_CHARS


def _live_entries(pipe: Pipeline) -> dict[bytes, bytes]:
    """The progress topic as compaction would leave it: the latest value per key, tombstones gone."""
    latest: dict[bytes, bytes | None] = {}
    for m in pipe.broker.records(NAMES.trainer_progress):
        latest[m.key()] = m.value()
    return {k: v for k, v in latest.items() if v is not None}


def test_the_commit_names_its_entry_and_the_entries_no_commit_needs_are_tombstoned():
    pipe = Pipeline()
    _alternating(pipe, 2_000)
    first = pipe.consumer(version=0)
    _train_all(pipe, first, 0)
    first.close()
    offset, metadata = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    token, chunks = carried(metadata)
    # Every entry written for an earlier commit was tombstoned once a later one landed.
    (entry,) = [TrainerProgress.from_bytes(v) for v in _live_entries(pipe).values()]
    assert (entry.token, entry.offset, entry.chunks) == (token, offset, chunks) == (token, 1, 1)
    assert entry.decoded() == [(o, o) for o in range(2, 2_000, 2)]
    second = pipe.consumer(version=5)
    _train_all(pipe, second, 5)
    assert pipe.broker.committed(GROUP, NAMES.finalized, 0) == (2_000, "")
    assert _live_entries(pipe) == {}  # its commits need none: the entry it found on assignment is gone too


def test_an_entry_written_for_a_commit_that_failed_is_never_taken_for_the_standing_one():
    pipe = Pipeline()
    groups = _alternating(pipe, 2_000)
    first = pipe.consumer(version=0)
    _train_all(pipe, first, 0)
    standing = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    # 400 more records, 200 of them trained: their entry is written, but every commit fails, and the
    # trainer dies.
    more = [group(f"h{i}", weight_version=5 * (i % 2), rows=1) for i in range(400)]
    pipe.finalize(more)
    pipe.broker.faults.commits = 1_000
    assert len(_train_all(pipe, first, 0)) == 200
    first.close()
    assert pipe.broker.committed(GROUP, NAMES.finalized, 0) == standing
    tokens = {TrainerProgress.from_bytes(v).token for v in _live_entries(pipe).values()}
    # The standing entry, and those written for the commits that failed (at most MAX_ATTEMPTS).
    assert carried(standing[1])[0] in tokens and 2 <= len(tokens) <= 1 + MAX_ATTEMPTS
    pipe.broker.faults.commits = 0
    second = pipe.consumer(version=5)
    again = _train_all(pipe, second, 5)
    # The 999 the standing commit names are not trained again; the 200 whose commit failed are (at least
    # once, never handed back: their rows were kept).
    assert second.counts.reread == 999 and _handed_back(pipe) == [] and second.counts.missing_rows == 0
    assert sorted(again) == sorted([g.group_id for g in groups[1::2]] + [g.group_id for g in more])
    assert _live_entries(pipe) == {}


def test_a_partition_whose_commit_names_an_entry_gone_missing_is_not_read_until_it_is_back():
    pipe = Pipeline()
    _alternating(pipe, 2_000)
    first = pipe.consumer(version=0)
    _train_all(pipe, first, 0)
    first.close()
    log = pipe.broker.logs[(NAMES.trainer_progress, 0)]
    kept, log[:] = list(log), []  # the entry is gone (the topic recreated, say)
    second = pipe.consumer(version=5)
    assert _train_all(pipe, second, 5) == [] and second.counts.reread == 0 and _handed_back(pipe) == []
    log[:] = kept
    assert len(_train_all(pipe, second, 5)) == 1_000 and second.counts.reread == 999 and _handed_back(pipe) == []
    assert _live_entries(pipe) == {}  # the entry found late is tombstoned too once a commit needs it no more


def test_a_commit_whose_entry_is_not_acknowledged_waits_and_is_never_made_with_fewer_ranges():
    pipe = Pipeline()
    _alternating(pipe, 2_000)
    pipe.broker.faults.unknown_topics = {NAMES.trainer_progress}
    first = pipe.consumer(version=0)
    _train_all(pipe, first, 0)
    named = [decode_ranges(e[3], e[4]) for e in pipe.broker.events if e[0] == "commit"]
    assert all(len(r) < 999 for r in named)  # the commits that fit inline were made; the rest waits
    pipe.broker.faults.unknown_topics = set()
    pipe.clock.now += 60
    first.poll(0)
    offset, metadata = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    assert offset == 1 and carried(metadata) is not None
    first.close()


def test_entries_of_many_chunks_are_read_back_whole_and_inline_metadata_of_older_trainers_still_reads():
    pipe = Pipeline()
    clients = pipe.broker.clients()
    writer = ProgressCarrier(clients, NAMES.trainer_progress, GROUP, NAMES.finalized, "run-a", chunk_ranges=3)
    ranges = [(o, o) for o in range(12, 2_012, 2)]
    metadata = writer.metadata(0, 10, ranges)
    token, chunks = carried(metadata)
    assert chunks == 334
    reader = ProgressCarrier(clients, NAMES.trainer_progress, GROUP, NAMES.finalized, "run-b")
    old = "rlstream.trainer/1:2.0,1.3"  # written by a trainer before the progress topic
    got = reader.read(
        [TopicPartition(NAMES.finalized, 0, 10, metadata=metadata), TopicPartition(NAMES.finalized, 1, 5, metadata=old)]
    )
    assert got.unreadable == {} and got.ranges == {0: ranges, 1: [(7, 7), (8, 11)]}


def test_while_commits_fail_a_partition_writes_a_bounded_number_of_entries_however_long_it_trains():
    pipe = Pipeline()
    _alternating(pipe, 2_000)
    first = pipe.consumer(version=0, max_poll_records=50)
    pipe.broker.faults.commits = 100_000
    trained = []
    for _ in range(40):  # many rounds, each resolving more: every commit fails
        trained += _train_all(pipe, first, 0)
        pipe.finalize([group(f"x{len(trained)}-{i}", weight_version=5 * (i % 2), rows=1) for i in range(20)])
    assert len(trained) > 1_000
    assert len(_live_entries(pipe)) <= MAX_ATTEMPTS and pipe.commits() == []
    pipe.broker.faults.commits = 0
    first.poll(0)
    assert len(_live_entries(pipe)) == 1  # the commit landed: only its entry is left


def test_commits_that_time_out_after_the_broker_took_them_keep_the_entry_the_standing_one_names():
    pipe = Pipeline()
    groups = _alternating(pipe, 2_000)
    first = pipe.consumer(version=0, max_poll_records=100)
    pipe.broker.faults.commits, pipe.broker.faults.commits_land = 100_000, True
    assert len(_train_all(pipe, first, 0)) == 1_000
    first.close()
    offset, metadata = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    tokens = {TrainerProgress.from_bytes(v).token for v in _live_entries(pipe).values()}
    assert carried(metadata)[0] in tokens and len(tokens) <= 1 + MAX_ATTEMPTS
    # The first trainer never learnt its commits landed, so it cleared no rows: the commit stops at the
    # first trained record, and names all 1,000.
    assert offset == 0 and len(pipe.present(groups)) == 2_000
    pipe.broker.faults.commits = 0
    second = pipe.consumer(version=5)
    again = _train_all(pipe, second, 5)
    assert second.counts.reread == 1_000 and _handed_back(pipe) == [] and second.counts.missing_rows == 0
    assert sorted(again) == sorted(g.group_id for g in groups[1::2])
    assert not pipe.present(groups)  # the successor cleared what the first left


def _carrying_trainer(pipe: Pipeline):
    """A trainer whose commit names a progress entry: 1,200 alternating records, 950 of those usable trained."""
    _alternating(pipe, 2_400)
    first = pipe.consumer(version=0, max_poll_records=5_000, max_waiting_groups=5_000)
    for _ in range(3):
        first.poll(0)
    first.ack(first.select(0, min_groups=950, max_groups=950, timeout_s=0.0))
    assert carried(pipe.broker.committed(GROUP, NAMES.finalized, 0)[1]) is not None
    return first


def test_while_the_coordinator_is_away_the_standing_commit_is_asked_for_with_backoff_not_on_every_ack():
    """Past MAX_ATTEMPTS entries a commit asks the broker for the standing commit; that call blocks up to 5 s,
    and it was made again on every poll and every ack while the coordinator did not answer."""
    pipe = Pipeline()
    first = _carrying_trainer(pipe)
    pipe.broker.faults.commits = pipe.broker.faults.committed = 10**6
    before = pipe.broker.faults.committed_calls
    for _ in range(30):  # one ack a round, no time passing
        first.ack(first.select(0, min_groups=1, max_groups=1, timeout_s=0.0))
        first.poll(0)
    assert pipe.broker.faults.committed_calls - before == 1
    pipe.clock.now += 0.6  # past the first delay: asked once more
    first.poll(0)
    first.poll(0)
    assert pipe.broker.faults.committed_calls - before == 2
    pipe.broker.faults.commits = pipe.broker.faults.committed = 0  # back: the commits go through
    pipe.clock.now += 60
    first.poll(0)
    assert pipe.broker.committed(GROUP, NAMES.finalized, 0)[0] == 1 and len(_live_entries(pipe)) == 1
    first.close()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_partition_whose_entry_cannot_be_written_holds_back_only_its_own_commit(checkpointed):
    """One ProgressUnavailable returned False for the whole batch: every partition's commit waited for one
    partition's progress entry."""
    pipe = Pipeline(partitions=2)
    _alternating(pipe, 2_000)  # partition 0: its commit needs an entry
    pipe.finalize([group(f"b{i}", rows=1) for i in range(10)], partition=1)  # partition 1: inline
    pipe.broker.faults.unknown_topics = {NAMES.trainer_progress}
    consumer = pipe.consumer(version=0, checkpointed=checkpointed)
    _train_all(pipe, consumer, 0)
    if checkpointed:
        consumer.checkpoint_durable(consumer.state_dict())
    assert pipe.broker.committed(GROUP, NAMES.finalized, 1) == (10, "")  # past all ten, rows cleared
    assert not pipe.present([group(f"b{i}", rows=1) for i in range(10)])
    standing = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    # Partition 0 waits for its entry: never a commit naming fewer ranges than it resolved.
    assert standing is None or (standing[0] <= 1 and carried(standing[1]) is None)
    pipe.broker.faults.unknown_topics = set()
    pipe.clock.now += 60
    consumer.poll(0)
    offset, metadata = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    assert offset == 1 and len(decode_ranges(offset, metadata) if carried(metadata) is None else [0] * 999) == 999
    consumer.close()


def _progress_reads(consumer) -> int:
    return consumer._clients.reads.count(NAMES.trainer_progress)


def test_a_trainer_whose_commits_name_no_entry_never_reads_the_progress_topic_on_assignment():
    """Read whole and at once inside poll, for nothing: no commit it read needed an entry."""
    pipe = Pipeline(partitions=2)
    for part in (0, 1):
        pipe.finalize([group(f"g{part}-{i}", weight_version=5 * (i % 2), rows=1) for i in range(20)], partition=part)
    first = pipe.consumer(version=0)
    assert len(_train_all(pipe, first, 0)) == 20
    first.close()
    second = pipe.consumer(version=5)
    assert len(_train_all(pipe, second, 5)) == 20 and second.counts.reread == 18
    assert _progress_reads(second) == 0
    second.close()


def test_the_progress_topic_is_read_once_for_an_assignment_however_often_its_partitions_are_asked_about():
    """Each retry of a partition whose commit could not be read read the whole topic again."""
    pipe = Pipeline(partitions=2)
    for part in (0, 1):
        pipe.finalize([group(f"g{part}-{i}", weight_version=5 * (i % 2), rows=1) for i in range(2_000)], partition=part)
    first = pipe.consumer(version=0)
    _train_all(pipe, first, 0)
    first.close()
    assert all(carried(pipe.broker.committed(GROUP, NAMES.finalized, p)[1]) for p in (0, 1))
    pipe.broker.faults.unreadable = {1}  # partition 1's commit unreadable for a while
    second = pipe.consumer(version=5)
    for _ in range(5):
        pipe.clock.now += 60
        second.poll(0)
    pipe.broker.faults.unreadable = set()
    again = _train_all(pipe, second, 5)
    assert len(again) == 2_000 and second.counts.reread == 2 * 999 and _handed_back(pipe) == []
    assert _progress_reads(second) == 1
    second.close()


def test_an_ack_past_what_commit_metadata_holds_writes_one_entry_not_one_for_each_of_its_two_commits():
    """The commit naming the acked record and the one passing it, once its rows are gone, name the same resolved
    set: the second names the first's entry rather than writing its own (acknowledged by every replica)."""
    pipe = Pipeline()
    pipe.finalize([group("x", weight_version=3, rows=1)])  # at the commit offset, held until version 3
    _alternating(pipe, 2_000)
    first = pipe.consumer(version=0)
    assert len(_train_all(pipe, first, 0)) == 1_000
    assert carried(pipe.broker.committed(GROUP, NAMES.finalized, 0)[1]) is not None
    written, commits = len(_live_entries(pipe)), len(pipe.commits())
    entries = len([m for m in pipe.broker.records(NAMES.trainer_progress) if m.value() is not None])
    first.ack(first.select(3, min_groups=1, max_groups=1, timeout_s=0.0))  # x
    assert [e[3] for e in pipe.commits()[commits:]] == [0, 2]  # naming x, then past it
    assert len([m for m in pipe.broker.records(NAMES.trainer_progress) if m.value() is not None]) == entries + 1
    assert len(_live_entries(pipe)) == written
    first.close()
    second = pipe.consumer(version=5)
    assert len(_train_all(pipe, second, 5)) == 1_000 and _handed_back(pipe) == []
    assert second.counts.reread == 999 and second.counts.missing_rows == 0


def test_a_predecessor_s_leftover_entries_go_once_the_successor_writes_its_own():
    """Commits naming no entry are not read back from the progress topic on assignment, so entries an earlier
    trainer left (its commits failed) are found and tombstoned when a successor first writes one."""
    pipe = Pipeline()
    _alternating(pipe, 4_000)
    first = pipe.consumer(version=0, max_poll_records=200)
    first.poll(0)  # assigned
    first.poll(0)
    first.ack(first.select(0, min_groups=50, max_groups=50, timeout_s=0.0))  # inline: it lands
    standing = pipe.broker.committed(GROUP, NAMES.finalized, 0)
    assert carried(standing[1]) is None
    pipe.broker.faults.commits = 1_000
    for _ in range(10):  # past what metadata holds: entries written, every commit fails
        first.poll(0)
        meta = first.select(0, min_groups=1, max_groups=200, timeout_s=0.0)
        if meta is not None:
            first.ack(meta)
    first.close()
    assert pipe.broker.committed(GROUP, NAMES.finalized, 0) == standing and len(_live_entries(pipe)) >= 1
    pipe.broker.faults.commits = 0
    second = pipe.consumer(version=0)
    _train_all(pipe, second, 0)
    assert len(_live_entries(pipe)) == 1  # its own commit's; the first trainer's went
    second.close()
