"""Kafka scenarios of offsets, visibility and transactions (claims K1-K9): each returns what its clients saw.

Each runs unchanged on the real broker (`RealKafka`) and on the model (`ModelKafka`); the
differential tests assert both saw the same, the model's unit tests what the real broker showed.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

from tests.tools.sim.scenarios.observe import kerr, outcome, read, settled


def offsets_and_visibility(w) -> dict:
    """K1-K3: plain records, a committed, an aborted and an open transaction, then the open one committed."""
    t = w.topic(2)
    plain = w.producer()
    for i in range(2):
        plain.produce(t, partition=0, key=b"p", value=b"plain%d" % i)
    plain.flush(10)
    a = w.txn_producer(w.name("a"))
    a.init_transactions(30)
    a.begin_transaction()
    a.produce(t, partition=0, value=b"a0")
    a.produce(t, partition=0, value=b"a1")
    a.produce(t, partition=1, value=b"a2")
    a.commit_transaction(30)
    a.begin_transaction()
    a.produce(t, partition=0, value=b"aborted")
    a.flush(10)
    a.abort_transaction(30)
    c = w.txn_producer(w.name("c"))
    c.init_transactions(30)
    c.begin_transaction()
    c.produce(t, partition=0, value=b"open")
    c.flush(10)
    plain.produce(t, partition=0, value=b"after-open")
    plain.flush(10)
    seen = w.consumer()
    before = seen.get_watermark_offsets(TopicPartition(t, 0), cached=True)
    obs = {
        "cached_before_fetch": before,
        "open": {
            "rc": read(w, t, 0),
            "ru": read(w, t, 0, read_committed=False),
            "rc_p1": read(w, t, 1),
        },
    }
    seen.assign([TopicPartition(t, 0, 0)])
    seen.consume(100, 1.0)
    obs["cached_after_fetch"] = seen.get_watermark_offsets(TopicPartition(t, 0), cached=True)
    seen.close()
    c.commit_transaction(30)
    obs["committed"] = {"rc": read(w, t, 0), "ru": read(w, t, 0, read_committed=False)}
    return obs


def fencing(w) -> dict:
    """K4: a second init_transactions under the same id, then each of the first producer's calls."""
    t = w.topic(1)
    sequences = {
        "commit_then_abort": ["commit", "abort"],
        "produce_poll_commit": ["produce", "poll", "poll", "commit"],
        "send_offsets": ["send_offsets"],
        "begin": ["begin"],
        "produce_flush": ["produce_nocb", "flush", "flush"],
    }
    obs = {}
    for label, steps in sequences.items():
        tid = w.name("f")
        first = w.txn_producer(tid)
        first.init_transactions(30)
        first.begin_transaction()
        for i in range(2):
            first.produce(t, value=b"first%d" % i)
        first.flush(10)
        second = w.txn_producer(tid)
        second.init_transactions(30)
        reports: list = []

        def report(err, msg, reports=reports):
            reports.append(kerr(err) if err is not None else "delivered")

        md = w.consumer().consumer_group_metadata()
        calls = {
            "produce": lambda f=first: f.produce(t, value=b"late", on_delivery=report),
            "produce_nocb": lambda f=first: f.produce(t, value=b"late"),
            "poll": lambda f=first: f.poll(2),
            "flush": lambda f=first: f.flush(5),
            "commit": lambda f=first: f.commit_transaction(10),
            "abort": lambda f=first: f.abort_transaction(10),
            "begin": lambda f=first: f.begin_transaction(),
            "send_offsets": lambda f=first, md=md: f.send_offsets_to_transaction([TopicPartition(t, 0, 1)], md, 10),
        }
        got = [(step, _ok_value(outcome(calls[step]))) for step in steps]
        obs[label] = {"calls": got, "reports": reports}
    obs["log"] = read(w, t, read_committed=False)["records"]
    obs["visible"] = read(w, t)["records"]
    return obs


def _ok_value(result):
    """Results whose value varies (a poll's count of events served) compare as "ok"."""
    return "ok" if result[0] == "ok" else result


def state_errors(w) -> dict:
    """K5: transactional calls out of turn."""
    t = w.topic(1)
    p = w.txn_producer(w.name("s"))
    obs = {
        "begin_before_init": outcome(p.begin_transaction),
        "produce_before_init": outcome(lambda: p.produce(t, value=b"x")),
    }
    p.init_transactions(30)
    obs["produce_outside"] = outcome(lambda: p.produce(t, value=b"x"))
    obs["commit_outside"] = outcome(lambda: p.commit_transaction(5))
    obs["abort_outside"] = outcome(lambda: p.abort_transaction(5))
    obs["init_twice"] = outcome(lambda: p.init_transactions(5))
    return obs


def txn_timeout(w) -> dict:
    """K6: a transaction left open past transaction.timeout.ms, and one begun with nothing added."""
    t = w.topic(1)
    tid = w.name("tt")
    p = w.txn_producer(tid, **{"transaction.timeout.ms": 2000})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(t, value=b"slow")
    p.flush(10)
    start = w.now()
    reader = w.consumer()
    w.wait(lambda: reader.get_watermark_offsets(TopicPartition(t, 0), timeout=10)[1] > 0, 15, "the timed-out abort")
    aborted_after = w.now() - start
    reader.close()
    obs = {
        "aborted_within": 2.0 <= aborted_after <= 2.0 + 1.0 + 1.5,
        "log": read(w, t, read_committed=False)["records"],
        "commit_after": outcome(lambda: p.commit_transaction(10)),
        "begin_after": outcome(p.begin_transaction),
    }
    again = w.txn_producer(tid)
    again.init_transactions(30)
    again.begin_transaction()
    again.produce(t, value=b"again")
    obs["successor_commit"] = outcome(lambda: again.commit_transaction(30))
    idle = w.txn_producer(w.name("idle"), **{"transaction.timeout.ms": 1000})
    idle.init_transactions(30)
    idle.begin_transaction()
    w.sleep(2.5)
    idle.produce(t, value=b"idle")
    obs["idle_commit"] = outcome(lambda: idle.commit_transaction(30))
    obs["visible"] = [v for _, _, v in read(w, t)["records"]]
    return obs


def offsets_in_transactions(w) -> dict:
    """K7: offsets sent in transactions; refusals by generation, membership and static replacement."""
    t = w.topic(2)
    group = w.name("g")
    conf = {
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        "partition.assignment.strategy": "cooperative-sticky",
    }
    a = w.consumer(group, **conf)
    a.subscribe([t])
    settled({"a": a}, 2, w)
    md1 = a.consumer_group_metadata()
    obs: dict = {}

    def txn(md, offset: int, metadata: str | None, *, commit: bool = True):
        p = w.txn_producer(w.name("o"))
        p.init_transactions(30)
        p.begin_transaction()
        p.produce(t, partition=0, value=b"x")
        tp = TopicPartition(t, 0, offset) if metadata is None else TopicPartition(t, 0, offset, metadata=metadata)
        sent = outcome(lambda: p.send_offsets_to_transaction([tp], md, 10))
        end = outcome(lambda: p.commit_transaction(30) if commit else p.abort_transaction(30))
        return p, sent, end

    _, obs["send_current"], obs["commit_current"] = txn(md1, 1, "meta-1")
    _, obs["send_aborted"], obs["abort"] = txn(md1, 5, "meta-5", commit=False)
    obs["committed_after"] = _committed(a, t, 0)
    b = w.consumer(group, **conf)
    b.subscribe([t])
    settled({"a": a, "b": b}, 2, w)
    obs["generation_moved"] = a.consumer_group_metadata() != md1
    stale, obs["send_old_generation"], obs["commit_old_generation"] = txn(md1, 2, None)
    obs["after_abortable"] = {
        "begin": outcome(stale.begin_transaction),
        "send_offsets": outcome(lambda: stale.send_offsets_to_transaction([TopicPartition(t, 0, 2)], md1, 10)),
        "produce": outcome(lambda: stale.produce(t, partition=0, value=b"y")),
        "abort": outcome(lambda: stale.abort_transaction(30)),
    }
    stale.begin_transaction()
    stale.produce(t, partition=0, value=b"z")
    obs["after_abort_commit"] = outcome(lambda: stale.commit_transaction(30))
    md_b = b.consumer_group_metadata()
    b.close()
    _, obs["send_member_gone"], _ = txn(md_b, 3, None)
    # What a consumer that is no member sends: one never subscribed, or one a heartbeat has just told
    # it was removed (librdkafka resets its member id and generation before the loss is served).
    outsider = w.consumer(group, **conf)
    obs["non_member_metadata_differs"] = outsider.consumer_group_metadata() != a.consumer_group_metadata()
    _, obs["send_non_member"], obs["abort_non_member"] = txn(outsider.consumer_group_metadata(), 4, None, commit=False)
    outsider.close()
    a.close()
    obs["committed_end"] = _committed(w.consumer(group), t, 0)
    # A static member replaced by another consumer under its instance id.
    sgroup = w.name("s")
    sconf = {**conf, "group.instance.id": "inst"}
    s1 = w.consumer(sgroup, **sconf)
    s1.subscribe([t])
    settled({"s1": s1}, 2, w)
    md_s1 = s1.consumer_group_metadata()
    s1.close()
    s2 = w.consumer(sgroup, **sconf)
    s2.subscribe([t])
    settled({"s2": s2}, 2, w)
    _, obs["send_replaced_static"], _ = txn(md_s1, 1, None)
    ghost = w.consumer(sgroup, **{**sconf, "group.instance.id": "ghost"})
    _, obs["send_non_member_static"], _ = txn(ghost.consumer_group_metadata(), 1, None, commit=False)
    ghost.close()
    _, obs["send_static_current"], obs["commit_static_current"] = txn(s2.consumer_group_metadata(), 1, None)
    s2.close()
    return obs


def _committed(c, topic: str, partition: int):
    (tp,) = c.committed([TopicPartition(topic, partition)], timeout=10)
    return (tp.offset, tp.metadata)


def committed_waits(w) -> dict:
    """K8: committed() while a transaction holds offsets for the partition, read_committed or not."""
    t = w.topic(1)
    group = w.name("g")
    member = w.consumer(group)
    member.subscribe([t])
    settled({"m": member}, 1, w)
    p = w.txn_producer(w.name("w"))
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(t, value=b"x")
    p.send_offsets_to_transaction([TopicPartition(t, 0, 1, metadata="pending")], member.consumer_group_metadata(), 10)
    rc, ru = w.consumer(group), w.consumer(group, read_committed=False)
    start = w.now()
    obs = {"rc_during": outcome(lambda: _committed_one(rc, t))}
    obs["rc_waited"] = w.now() - start >= 1.9
    start = w.now()
    obs["ru_during"] = outcome(lambda: _committed_one(ru, t))
    obs["ru_at_once"] = w.now() - start < 1.5
    p.commit_transaction(30)
    obs["rc_after"] = outcome(lambda: _committed_one(rc, t))
    member.close()
    return obs


def _committed_one(c, topic: str):
    (tp,) = c.committed([TopicPartition(topic, 0)], timeout=2)
    return (tp.offset, tp.metadata)


def commit_metadata(w) -> dict:
    """K9: a standalone commit, metadata at and past the limit, a non-member's commit in a live group."""
    t = w.topic(1)
    group = w.name("g")
    c = w.consumer(group)
    c.assign([TopicPartition(t, 0, 0)])
    obs = {}

    def commit_and_read(size: int):
        c.commit(offsets=[TopicPartition(t, 0, 3, metadata="x" * size)], asynchronous=False)
        (tp,) = c.committed([TopicPartition(t, 0)], timeout=10)
        return (tp.offset, len(tp.metadata or ""))

    for size in (4095, 4096):
        obs[f"metadata_{size}"] = outcome(lambda size=size: commit_and_read(size))
    obs["returns"] = outcome(
        lambda: [tp.offset for tp in c.commit(offsets=[TopicPartition(t, 0, 4)], asynchronous=False)]
    )
    member = w.consumer(group)
    member.subscribe([t])
    settled({"m": member}, 1, w)
    obs["non_member_in_live_group"] = outcome(lambda: c.commit(offsets=[TopicPartition(t, 0, 5)], asynchronous=False))
    obs["member_commit"] = outcome(
        lambda: [tp.offset for tp in member.commit(offsets=[TopicPartition(t, 0, 6)], asynchronous=False)]
    )
    obs["committed"] = _committed(c, t, 0)
    member.close()
    c.close()
    return obs
