"""The sensor interfaces: the do-nothing defaults, the reassembler's running totals and fan_out."""

from workers.telemetry.sensors import PoolSensor, ReassemblerSensor, ReassemblerStats, TrainerSensor, fan_out


def test_base_sensors_accept_every_reading_and_keep_nothing():
    r, t = ReassemblerSensor(), TrainerSensor()
    r.on_receipts(3)
    r.on_commit(seconds=0.1, finalized=2, dead_letters={"decode_error": 1})
    r.on_abort()
    r.on_open_groups(4, paused=True)
    r.on_lag("t", {0: 5})
    r.on_swept(2)
    r.on_handed_back(1)
    t.on_yield(3, 1)
    t.on_evict(2)
    t.on_duplicate()
    r.on_fenced("producer")
    t.on_version(4)
    p = PoolSensor()
    p.on_worker("w-0")
    p.on_exit("w-0", "crashed")
    p.on_restart("w-0", by_spare=True)
    p.on_running(2, spare_ready=True)
    assert vars(r) == {} and vars(t) == {} and vars(p) == {}


def test_reassembler_stats_fold_readings_into_totals():
    s = ReassemblerStats()
    s.on_receipts(5)
    s.on_receipts(3)
    s.on_commit(seconds=0.25, finalized=2, dead_letters={"decode_error": 1})
    s.on_commit(seconds=0.5, finalized=1, dead_letters={"decode_error": 2, "validation_error": 1})
    s.on_abort()
    s.on_retry("restore")
    s.on_retry("producer")
    s.on_open_groups(7, paused=True)
    s.on_open_groups(4, paused=False)
    s.on_swept(2)
    s.on_swept(0)
    s.on_handed_back(2)
    assert s.snapshot() == {
        "receipts": 8,
        "finalized": 3,
        "dead_letters": {"decode_error": 3, "validation_error": 1},
        "transactions": 2,
        "aborts": 1,
        "retries": 2,
        "open_groups": 4,
        "swept": 2,
        "handed_back": 2,
    }
    assert s.commit_seconds_total == 0.75 and s.paused is False
    snap = s.snapshot()
    snap["dead_letters"]["decode_error"] = 99
    assert s.dead_letters["decode_error"] == 3, "a snapshot is a copy"


class _Recorder(TrainerSensor):
    def __init__(self) -> None:
        self.calls = []

    def on_yield(self, version, group_min_wv):
        self.calls.append(("yield", version, group_min_wv))

    def on_evict(self, n=1):
        self.calls.append(("evict", n))


def test_fan_out_passes_every_reading_to_each_sensor():
    a, b = _Recorder(), _Recorder()
    both = fan_out(a, b)
    both.on_yield(4, 2)
    both.on_evict(n=3)
    both.on_duplicate()  # a reading neither overrides still reaches both (and is ignored)
    assert a.calls == b.calls == [("yield", 4, 2), ("evict", 3)]


def test_fan_out_of_one_sensor_is_that_sensor():
    stats = ReassemblerStats()
    assert fan_out(stats) is stats
    fan_out(stats, ReassemblerSensor()).on_receipts(2)
    assert stats.receipts == 2
