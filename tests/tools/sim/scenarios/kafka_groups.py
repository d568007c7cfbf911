"""Kafka scenarios of consumer groups, positions and metadata (claims K10-K15, K19).

Where the real broker is nondeterministic (which partitions move, when a round completes), a
scenario records the invariants both must satisfy instead of the exact values.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition

from tests.tools.sim.scenarios.observe import balanced, kerr, outcome, owned, settled

COOP = {"partition.assignment.strategy": "cooperative-sticky", "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


class Recorder:
    """Every rebalance callback of named consumers, in order: (name, "+"/"-"/"lost", partitions)."""

    def __init__(self):
        self.events: list[tuple[str, str, list[int]]] = []

    def subscribe(self, name: str, consumer, topic: str) -> None:
        def cb(kind: str):
            return lambda c, parts: self.events.append((name, kind, sorted(p.partition for p in parts)))

        consumer.subscribe([topic], on_assign=cb("+"), on_revoke=cb("-"), on_lost=cb("lost"))

    def of(self, name: str) -> list[tuple[str, list[int]]]:
        return [(kind, ps) for who, kind, ps in self.events if who == name]

    def take(self) -> list[tuple[str, str, list[int]]]:
        events, self.events = self.events, []
        return events


def _replay(start: list[int], events: list[tuple[str, list[int]]]) -> set[int]:
    """What a member holds after these callbacks, from `start` (cooperative: incremental)."""
    held = set(start)
    for kind, ps in events:
        held = held | set(ps) if kind == "+" else held - set(ps)
    return held


def cooperative_join_leave(w) -> dict:
    """K10: a second and a third member join, then the second leaves; invariants after each round."""
    t = w.topic(4)
    group = w.name("g")
    rec = Recorder()
    members = {}
    obs: dict = {}
    for step, name in enumerate(["a", "b", "c"]):
        members[name] = w.consumer(group, **COOP)
        rec.subscribe(name, members[name], t)
        before = {n: owned(c) for n, c in members.items()}
        settled(members, 4, w)
        gens = {n: c.consumer_group_metadata() for n, c in members.items()}
        events = rec.take()
        after = {n: owned(c) for n, c in members.items()}
        obs[f"join_{name}"] = {
            "balanced": balanced(after, 4),
            # Each member's callbacks account for what it holds.
            "callbacks_add_up": all(
                _replay(before.get(n, []), [(k, ps) for who, k, ps in events if who == n]) == set(after[n])
                for n in members
            ),
            # What a member kept, it was never asked to revoke.
            "kept_never_revoked": all(
                not set(before.get(n, []))
                & set(after[n])
                & {p for who, k, ps in events if who == n and k == "-" for p in ps}
                for n in members
            ),
            "newcomer_assigned": any(who == name and k == "+" for who, k, _ in events),
            # Under cooperative-sticky a round hands some members nothing, and they are told so.
            "empty_assign_calls": step == 0 or any(k == "+" and not ps for _, k, ps in events),
            "first_member_all": step > 0 or after == {"a": [0, 1, 2, 3]},
            "one_generation": len({md_generation(md) for md in gens.values()}) == 1,
        }
    gen_before = md_generation(members["a"].consumer_group_metadata())
    members.pop("b").close()
    rec.take()
    settled(members, 4, w)
    events = rec.take()
    obs["leave_b"] = {
        "balanced": balanced({n: owned(c) for n, c in members.items()}, 4),
        "no_revocation": all(k != "-" for _, k, _ in events),
        "generation_moved": md_generation(members["a"].consumer_group_metadata()) > gen_before,
    }
    for c in members.values():
        c.close()
    return obs


def md_generation(md) -> int:
    """The generation in a consumer-group metadata (the model's object, or librdkafka's bytes)."""
    if isinstance(md, bytes):
        return int.from_bytes(md[7:11], "little")
    return md.generation


def eager_join(w) -> dict:
    """K10, eager (range): the first member gives everything up before the round hands out partitions."""
    t = w.topic(4)
    group = w.name("g")
    conf = {"partition.assignment.strategy": "range", "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
    rec = Recorder()
    a = w.consumer(group, **conf)
    rec.subscribe("a", a, t)
    settled({"a": a}, 4, w)
    b = w.consumer(group, **conf)
    rec.subscribe("b", b, t)
    settled({"a": a, "b": b}, 4, w)
    after = {"a": owned(a), "b": owned(b)}
    obs = {
        "a_events": [(k, len(ps)) for k, ps in rec.of("a")],
        "b_events": [(k, len(ps)) for k, ps in rec.of("b")],
        "balanced": balanced(after, 4),
        "contiguous": all(ps == list(range(ps[0], ps[0] + len(ps))) for ps in after.values()),
    }
    a.close()
    b.close()
    return obs


def static_rejoin(w) -> dict:
    """K11: a static member closed and replaced under its instance id; the other member sees nothing."""
    t = w.topic(4)
    group = w.name("g")
    rec = Recorder()
    a = w.consumer(group, **COOP, **{"group.instance.id": "ia"})
    b = w.consumer(group, **COOP, **{"group.instance.id": "ib"})
    rec.subscribe("a", a, t)
    rec.subscribe("b", b, t)
    settled({"a": a, "b": b}, 4, w)
    held_a, gen = owned(a), md_generation(a.consumer_group_metadata())
    rec.take()
    a.close()
    a2 = w.consumer(group, **COOP, **{"group.instance.id": "ia"})
    rec.subscribe("a2", a2, t)
    settled({"a2": a2, "b": b}, 4, w, timeout_s=5.0)
    events = rec.take()
    obs = {
        "closing_revokes": ("a", "-", held_a) in events,
        "same_partitions": owned(a2) == held_a,
        "same_generation": md_generation(a2.consumer_group_metadata()) == gen,
        "other_untouched": not [e for e in events if e[0] == "b"],
        "a2_events": [(k, ps == held_a) for who, k, ps in events if who == "a2"],
    }
    # A second live consumer under the same instance id fences the first.
    a3 = w.consumer(group, **COOP, **{"group.instance.id": "ia"})
    rec.subscribe("a3", a3, t)
    errors: list = []

    def fenced() -> bool:
        for m in a2.consume(10, 0.05):
            if m.error() is not None:
                errors.append((kerr(m.error()), "group.instance.id" in m.error().str()))
        a3.consume(10, 0.05)
        b.consume(10, 0.05)
        return bool(errors) and owned(a3) == held_a

    w.wait(fenced, 20, "the first consumer fenced by its twin")
    events = rec.take()
    obs["twin"] = {
        "error": errors[0],
        "fenced_assignment": owned(a2),
        "fenced_callbacks": [e for e in events if e[0] == "a2"],
        "twin_partitions": owned(a3) == held_a,
        "other_untouched": not [e for e in events if e[0] == "b"],
        "consume_after": outcome(lambda: [m.error() for m in a2.consume(1, 0.3)]),
    }
    for c in (a2, a3, b):
        c.close()
    return obs


def static_session_timeout(w) -> dict:
    """K12: a static member that closes keeps its partitions until its session times out."""
    t = w.topic(2)
    group = w.name("g")
    conf = {**COOP, "session.timeout.ms": 3000, "heartbeat.interval.ms": 300}
    a = w.consumer(group, **conf, **{"group.instance.id": "ia"})
    b = w.consumer(group, **conf)
    a.subscribe([t])
    b.subscribe([t])
    settled({"a": a, "b": b}, 2, w)
    a.close()
    start = w.now()
    w.wait(lambda: bool(b.consume(10, 0.05)) or len(b.assignment()) == 2, 20, "the survivor to take everything")
    took = w.now() - start
    b.close()
    return {"after_session_timeout": 2.5 <= took <= 3.0 + 3.0}


def max_poll_exceeded(w) -> dict:
    """K13: a dynamic member that does not poll for max.poll.interval.ms leaves; its next poll."""
    t = w.topic(2)
    group = w.name("g")
    conf = {**COOP, "session.timeout.ms": 3000, "heartbeat.interval.ms": 300, "max.poll.interval.ms": 3000}
    rec = Recorder()
    c = w.consumer(group, **conf)
    b = w.consumer(group, **conf)
    rec.subscribe("c", c, t)
    rec.subscribe("b", b, t)
    settled({"c": c, "b": b}, 2, w)
    held = owned(c)
    rec.take()
    start = w.now()
    w.wait(lambda: bool(b.consume(10, 0.05)) or len(b.assignment()) == 2, 15, "the survivor to take everything")
    left_after = w.now() - start
    got = c.consume(10, 1.0)
    first = rec.take()
    obs = {
        "left_at_once": left_after <= 3.0 + 1.5,
        "lost_first": [e for e in first if e[0] == "c"][:1] == [("c", "lost", held)],
        "errors": [kerr(m.error()) for m in got if m.error() is not None],
    }
    settled({"c": c, "b": b}, 2, w)
    obs["rejoined_balanced"] = balanced({"c": owned(c), "b": owned(b)}, 2)
    c.close()
    b.close()
    return obs


def positions(w) -> dict:
    """K14: positions, seeks, pauses, and an offset past the end."""
    t = w.topic(1)
    p = w.producer()
    for i in range(5):
        p.produce(t, partition=0, value=b"%d" % i)
    p.flush(10)
    tp = TopicPartition(t, 0)
    c = w.consumer()
    c.assign([TopicPartition(t, 0, 0)])
    obs = {"before_any": c.position([tp])[0].offset}
    obs["first_two"] = [m.offset() for m in _consume(w, c, 2)]
    obs["after_two"] = c.position([tp])[0].offset
    c.seek(TopicPartition(t, 0, 4))
    obs["after_seek"] = c.position([tp])[0].offset
    obs["from_seek"] = [m.offset() for m in _consume(w, c, 5, settle_s=1.0)]
    obs["seek_unassigned"] = outcome(lambda: c.seek(TopicPartition(t, 3, 1)))
    c.pause([tp])
    c.unassign()
    c.assign([TopicPartition(t, 0, 0)])
    obs["paused_after_reassign"] = [m.offset() for m in c.consume(5, 1.0)]
    c.resume([tp])
    obs["resumed"] = [m.offset() for m in _consume(w, c, 5, settle_s=2.0)]
    c.close()
    beyond = w.consumer()
    beyond.assign([TopicPartition(t, 0, 10)])
    obs["past_end_reset"] = [m.offset() for m in _consume(w, beyond, 5, settle_s=2.0)]
    beyond.close()
    return obs


def _consume(w, c, n: int, settle_s: float = 3.0) -> list:
    got: list = []
    deadline = w.now() + settle_s
    while len(got) < n and w.now() < deadline:
        got += [m for m in c.consume(n - len(got), 0.2) if m.error() is None]
    return got


def metadata(w) -> dict:
    """K15, K19: metadata, unknown topics and partitions, a record to a topic that does not exist."""
    t = w.topic(3)
    missing = w.name("missing")
    c = w.consumer()
    md = c.list_topics(t, timeout=10).topics[t]
    gone = c.list_topics(missing, timeout=10).topics.get(missing)
    obs = {
        "partitions": sorted(md.partitions),
        "leader": md.partitions[0].leader,
        "missing": (kerr(gone.error), dict(gone.partitions)) if gone is not None else None,
        "watermarks_missing_topic": outcome(lambda: c.get_watermark_offsets(TopicPartition(missing, 0), timeout=3)),
        "watermarks_missing_partition": outcome(lambda: c.get_watermark_offsets(TopicPartition(t, 7), timeout=3)),
    }
    sub = w.consumer()
    sub.subscribe([missing])
    events: list = []
    w.wait(lambda: events.extend(m for m in sub.consume(10, 0.1) if m.error() is not None) or bool(events), 10,
           "the unknown-topic event")  # fmt: skip
    obs["subscribe_missing"] = (kerr(events[0].error()), events[0].topic() == missing)
    sub.close()
    p = w.producer(**{"message.timeout.ms": 1500})
    reports: list = []
    p.produce(missing, value=b"q", on_delivery=lambda err, msg: reports.append(kerr(err) if err else "delivered"))
    obs["flush_missing_topic"] = p.flush(5)
    obs["report_missing_topic"] = reports
    c.close()
    return obs
