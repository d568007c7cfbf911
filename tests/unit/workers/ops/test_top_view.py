"""`rlstream top`'s screen rendered from given figures: rates between two snapshots, lag rows, the staleness
histogram, losses, TQ, endpoints; and figures that could not be read shown as such."""

import dataclasses
import math

from workers.ops.scrape import Figures, Scrape
from workers.ops.top import metrics_of
from workers.ops.top_view import Endpoint, Metrics, PartitionLag, Snapshot, TrainerState, render

NOW = 1_800_000_000.0


def _snapshot(
    at: float, *, receipts_end: int, consumed: float, finalized: float, trained: float, **metrics
) -> Snapshot:
    return Snapshot(
        at=at,
        prefix="run1",
        bootstrap_servers="k:9092",
        receipts_end=receipts_end,
        lags=(
            PartitionLag("reassemblers.run1", "run1.rollout.receipts", 0, 900, 1000, 100),
            PartitionLag("reassemblers.run1", "run1.rollout.receipts", 1, None, 200, 200),
            PartitionLag("trainer.run1", "run1.experience.finalized", 0, 41, 42, 1),
        ),
        trainers=(TrainerState("trainer.run1", "trainer.run1", 7, 24, 3, int((at - 5) * 1000)),),
        endpoints=(Endpoint("http://w0:9400/metrics"), Endpoint("http://t:9300/metrics", "Connection refused")),
        metrics=Metrics(
            receipts_consumed=consumed,
            groups_finalized=finalized,
            groups_trained=trained,
            evicted=4,
            dead_letters={"decode_error": 2, "late_receipt": 0, "all_rollouts_failed": 8},
            trainer_undecodable=0,
            trainer_missing_rows=1,
            staleness={0.0: 10, 1.0: 15, 2.0: 15, 3.0: 16, 4.0: 16, 6.0: 16, math.inf: 16},
            trainer_version=7,
            tq_rows={"rlstream.staging": 412, "rlstream.train": 96},
            open_groups=12,
            paused=0,
            aborts=1,
            fences=0,
            **metrics,
        ),
    )


def _line(lines: list[str], start: str) -> str:
    found = [line.strip() for line in lines if line.strip().startswith(start)]
    assert found, (start, lines)
    return found[0]


def test_the_screen_shows_every_figure_with_rates_from_the_previous_snapshot():
    prev = _snapshot(NOW - 2, receipts_end=1000, consumed=900, finalized=100, trained=90)
    now = _snapshot(NOW, receipts_end=1200, consumed=1100, finalized=125, trained=110)
    lines = render(now, prev)
    assert lines[0].startswith("rlstream top · prefix run1 · broker k:9092")
    assert _line(lines, "trainer") == (
        "trainer      version 7  (trainer.run1, 24 groups a version, 3 lost, published 5s ago)"
    )
    throughput = _line(lines, "throughput")
    assert "receipts in 100.0/s" in throughput and "consumed 100.0/s" in throughput
    assert "groups finalized 12.5/s" in throughput and "trained 10.0/s" in throughput
    rows = [
        line.split() for line in lines if line.split()[:1] in (["run1.rollout.receipts"], ["run1.experience.finalized"])
    ]
    assert rows == [
        ["run1.rollout.receipts", "reassemblers.run1", "0", "900", "1000", "100"],
        ["run1.rollout.receipts", "reassemblers.run1", "1", "-", "200", "200"],  # no commit yet: -
        ["run1.experience.finalized", "trainer.run1", "0", "41", "42", "1"],
    ]
    bars = [line for line in lines if "│" in line]
    assert [b.split("│")[0].strip() for b in bars] == ["0", "1", "2", "3"], "trailing empty buckets are left out"
    assert bars[0].endswith("10 (62%)") and bars[1].endswith("5 (31%)") and bars[3].endswith("1 (6%)")
    widths = [b.split("│")[1].count("█") for b in bars]
    assert widths == [32, 16, 0, 3], "bars in proportion to the largest bucket"
    assert _line(lines, "evictions") == "evictions    4 stale (3.5% of 114 taken in)"
    dead = _line(lines, "dead letters")
    assert "all_rollouts_failed 8, decode_error 2 ·" in dead and "late_receipt" not in dead
    assert "rows missing 1" in dead
    assert _line(lines, "TQ rows held") == "TQ rows held rlstream.staging 412, rlstream.train 96"
    assert "open groups 12" in _line(lines, "reassemblers") and "aborts 1" in _line(lines, "reassemblers")
    assert _line(lines, "metrics endpoints") == "metrics endpoints: 1 of 2 up"
    assert _line(lines, "http://t:9300/metrics") == "http://t:9300/metrics  DOWN: Connection refused"


def test_the_first_screen_waits_for_rates_and_a_counter_that_went_back_is_no_rate():
    first = render(_snapshot(NOW, receipts_end=1200, consumed=1100, finalized=125, trained=110))
    assert _line(first, "throughput").count("…") == 4
    restarted = _snapshot(NOW + 1, receipts_end=1300, consumed=20, finalized=2, trained=111)
    throughput = _line(render(restarted, _snapshot(NOW, receipts_end=1200, consumed=1100, finalized=125,
                                                   trained=110)), "throughput")  # fmt: skip
    assert "consumed …" in throughput and "receipts in 100.0/s" in throughput


def test_figures_that_could_not_be_read_show_as_such_and_nothing_breaks():
    snap = Snapshot(
        at=NOW,
        prefix="run1",
        bootstrap_servers="k:9092",
        kafka_error='KafkaError{code=_TRANSPORT,val=-195,str="Failed to get metadata: transport failure"}',
        endpoints=(Endpoint("http://t:9300/metrics", "timed out"),),
    )
    lines = render(snap, snap)
    text = "\n".join(lines)
    assert "trainer      version n/a  (nothing on the version topic)" in text
    assert "throughput   receipts in n/a  consumed n/a  groups finalized n/a  trained n/a" in text
    assert _line(lines, "n/a: Kafka").startswith("n/a: Kafka KafkaError{code=_TRANSPORT")
    why = "no endpoint that answered reports it"
    assert _line(lines, "evictions") == f"evictions    n/a: {why}"
    assert _line(lines, "dead letters") == f"dead letters n/a: {why}"
    assert _line(lines, "TQ rows held").startswith(f"TQ rows held n/a: {why}")
    assert "open groups n/a" in _line(lines, "reassemblers")
    assert _line(lines, "http://t:9300/metrics") == "http://t:9300/metrics  DOWN: timed out"
    assert "n/a: no metrics endpoint given" in "\n".join(render(Snapshot(at=NOW, prefix="p", bootstrap_servers="k")))


def test_no_group_trained_yet_is_said_not_drawn():
    lines = render(_snapshot(NOW, receipts_end=1, consumed=1, finalized=0, trained=0,
                             ).__class__(at=NOW, prefix="p", bootstrap_servers="k",
                                         metrics=Metrics(staleness={0.0: 0, math.inf: 0})))  # fmt: skip
    assert "  (no group trained yet)" in lines


def test_the_screen_figures_come_from_the_exported_metric_names():
    scrapes = [Scrape("a", (
        ("rlstream_trainer_staleness_versions_bucket", {"prefix": "p", "le": "0.0"}, 3.0),
        ("rlstream_trainer_staleness_versions_bucket", {"prefix": "p", "le": "+Inf"}, 5.0),
        ("rlstream_trainer_version", {"prefix": "p"}, 4.0),
        ("rlstream_pool_worker_exits_total", {"prefix": "p", "worker": "w-0", "how": "fenced"}, 1.0),
        ("rlstream_pool_worker_exits_total", {"prefix": "p", "worker": "w-0", "how": "crashed"}, 5.0),
        ("tq_partition_samples_total", {"partition_id": "rlstream.train"}, 8.0),
    ))]  # fmt: skip
    m = metrics_of(Figures(scrapes, "p"))
    assert m.staleness == {0.0: 3, math.inf: 5}
    assert m.trainer_version == 4 and m.pool_fenced_exits == 1 and m.tq_rows == {"rlstream.train": 8}
    assert m.evicted is None and m.receipts_consumed is None


def test_tq_rows_of_many_other_partitions_are_one_summary_not_a_line_that_fills_the_screen():
    # A TQ shared by other jobs (here: the test suite's) had hundreds of partitions: the line wrapped
    # over 20 lines of a 60-line terminal and pushed the endpoints off the screen.
    others = {f"sim.{i:04d}.P0": float(i % 3) for i in range(300)}
    snap = _snapshot(NOW, receipts_end=1200, consumed=1100, finalized=125, trained=110)
    snap = dataclasses.replace(
        snap, metrics=dataclasses.replace(snap.metrics, tq_rows={"rlstream.train": 96, "rlstream.staging": 4, **others})
    )
    held = _line(render(snap), "TQ rows held")
    total = sum(others.values())
    assert held == f"TQ rows held rlstream.staging 4, rlstream.train 96 · 300 other partitions: {total:.0f} rows"
    few = dataclasses.replace(
        snap, metrics=dataclasses.replace(snap.metrics, tq_rows={"rlstream.train": 1, "verl.ab12": 5, "verl.cd34": 0})
    )
    assert _line(render(few), "TQ rows held") == "TQ rows held rlstream.train 1 · verl.ab12 5, verl.cd34 0"
