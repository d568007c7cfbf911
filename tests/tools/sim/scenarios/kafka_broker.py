"""Kafka scenarios that need a broker of their own: compaction, retention, the broker down (K16-K18).

The broker's cleaner and retention run in the background on the real broker (every 500 ms on the
test's broker); on the model `w.clean(topic)` runs them when the scenario says so.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

from tests.tools.sim.scenarios.observe import kerr, outcome, read, settled

COMPACTED = {
    "cleanup.policy": "compact",
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.001",
    "delete.retention.ms": "600000",
    "min.compaction.lag.ms": "0",
}


def compaction(w) -> dict:
    """K16: each record in a segment of its own; the cleaner keeps the last of each key below the
    active segment, a tombstone included, and leaves the active segment's record alone."""
    t = w.topic(1, **COMPACTED)
    p = w.producer()
    values = [(b"k%d" % (i % 4), None if i == 10 else b"v%d" % i) for i in range(12)]
    for key, value in values:
        p.produce(t, partition=0, key=key, value=value)
        p.flush(10)
        w.sleep(0.15)  # past segment.ms: the next record rolls a new segment
    # The last of each key below the active segment (the last record's), then the active one.
    below = {key: (off, value) for off, (key, value) in enumerate(values[:-1])}
    expected = sorted([(off, key, value) for key, (off, value) in below.items()] + [(11, *values[-1])])
    w.clean(t)
    w.wait(lambda: read(w, t, settle_s=1.0)["records"] == expected, 60, "the cleaner to compact the topic")
    after = read(w, t)
    return {"records": after["records"], "low": after["low"], "high": after["high"], "expected": expected}


def retention(w) -> dict:
    """K17: records older than retention.ms leave from the start; the log start moves past them.

    The old records carry timestamps ten minutes back (each rolls a segment of its own, as its
    predecessor's looks that old): expired at the broker's next check, while the fresh ones are
    kept for the minute of retention, however slow the machine.
    """
    t = w.topic(1, **{"retention.ms": "60000", "segment.ms": "100"})
    p = w.producer()
    old = int((w.wall() - 600) * 1000)
    for i in range(3):
        p.produce(t, partition=0, value=b"old%d" % i, timestamp=old + i)
        p.flush(10)
    for i in range(2):
        p.produce(t, partition=0, value=b"new%d" % i)
        p.flush(10)
    w.clean(t)
    c = w.consumer()
    w.wait(lambda: c.get_watermark_offsets(TopicPartition(t, 0), timeout=10)[0] >= 3, 60, "retention to delete")
    c.close()
    after = read(w, t)
    stale = w.consumer()
    stale.assign([TopicPartition(t, 0, 0)])  # below the log start: reset to it (auto.offset.reset earliest)
    got = [m.offset() for m in stale.consume(10, 3.0) if m.error() is None]
    stale.close()
    return {"low": after["low"], "high": after["high"], "records": after["records"], "from_zero": got}


def broker_down(w) -> dict:
    """K18: what each call sees while the only broker is down, and the same calls once it is back."""
    t = w.topic(1)
    group = w.name("g")
    c = w.consumer(group, **{"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    c.subscribe([t])
    acked = w.producer(**{"message.timeout.ms": 3000})
    acked.produce(t, partition=0, value=b"a")
    acked.flush(10)
    settled({"c": c}, 1, w)
    txp = w.txn_producer(w.name("d"))
    txp.init_transactions(30)
    txp.begin_transaction()
    txp.produce(t, partition=0, value=b"t")
    txp.flush(10)
    fresh = w.txn_producer(w.name("n"))
    w.down()
    obs = {
        "committed": outcome(lambda: c.committed([TopicPartition(t, 0)], timeout=2)),
        # Records it had prefetched may come (when depends on the fetch timing); errors do not.
        "consume_errors": outcome(lambda: [kerr(m.error()) for m in c.consume(10, 2) if m.error() is not None]),
        "list_topics": outcome(lambda: c.list_topics(t, timeout=2)),
        "commit": outcome(lambda: c.commit(offsets=[TopicPartition(t, 0, 1)], asynchronous=False)),
    }
    reports: list = []
    acked.produce(t, partition=0, value=b"b", on_delivery=lambda err, msg: reports.append(kerr(err) if err else "ok"))
    obs["flush_short"] = acked.flush(1)
    obs["flush_past_timeout"] = acked.flush(5)
    obs["reports"] = reports
    obs["commit_txn"] = outcome(lambda: txp.commit_transaction(2))
    obs["init_txn"] = outcome(lambda: fresh.init_transactions(2))
    w.up()
    obs["commit_txn_after"] = outcome(lambda: txp.commit_transaction(60))
    obs["init_txn_after"] = outcome(lambda: fresh.init_transactions(60))
    obs["visible"] = [v for _, _, v in read(w, t, settle_s=10.0)["records"]]
    c.close()
    return obs
